"""Running the ledger for tests: a real HTTP server on 127.0.0.1, on SQLite or on Postgres.

Postgres is used when ``GPUCLOUD_TEST_POSTGRES_URL`` names a reachable server (for example
``postgresql+psycopg://postgres@127.0.0.1:5432/test``): every use creates its own uniquely
named database through an autocommit connection to that URL's database and drops it
afterwards, so suites running side by side never share one.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import httpx

from gpucloud.ledger.app import create_app, wall_clock_ms
from gpucloud.ledger.db import LedgerDatabase
from gpucloud.web.service_tokens import Verifier, public_key_path
from gpucloud.web.serving import ThreadedServer
from support.databases import scratch_postgres
from support.forked import CliProcess
from support.ledger_auth import issuer_in, register

POSTGRES_URL_ENV = "GPUCLOUD_TEST_POSTGRES_URL"
REPO_ROOT = Path(__file__).resolve().parents[2]


def backends() -> list[str]:
    return ["sqlite", "postgres"] if os.environ.get(POSTGRES_URL_ENV) else ["sqlite"]


@functools.cache
def _ledger_template() -> Path:
    """A SQLite ledger migrated once per test process."""
    template = Path(tempfile.mkdtemp(prefix="ledger-template-")) / "ledger.db"
    database = LedgerDatabase(f"sqlite:///{template}")
    database.migrate()
    database.dispose()
    return template


def _migrated_sqlite_ledger(path: Path) -> None:
    """A migrated, empty ledger at `path`: a copy of `_ledger_template()` (SQLite's online
    backup), as `support.databases.MigratedSqlite` does for the control plane. Running the
    ledger's migrations into each test's fresh file took about 0.3 s a test."""
    with closing(sqlite3.connect(_ledger_template())) as source, closing(sqlite3.connect(path)) as copy:
        source.backup(copy)


@contextmanager
def ledger_database_url(backend: str, directory: Path, name: str = "ledger") -> Iterator[str]:
    """A migrated, empty ledger database: a file in `directory` (SQLite), or a database of its
    own on the Postgres server (migrated by the ledger as it starts)."""
    if backend == "sqlite":
        path = directory / (name + ".db")
        if not path.exists():
            _migrated_sqlite_ledger(path)
        yield f"sqlite:///{path}"
    else:
        with scratch_postgres(os.environ[POSTGRES_URL_ENV], "gpucloud_ledger") as url:
            yield url


def wait_until_healthy(url: str, *, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"ledger at {url} did not come up")
        time.sleep(0.05)


@contextmanager
def ledger_in_thread(
    database_url: str,
    *,
    issuer_dir: Path,
    clock_ms: Callable[[], int] = wall_clock_ms,
    metrics_tokens: tuple[str, ...] = (),
) -> Iterator[str]:
    """The ledger app served by uvicorn in a thread of this process, trusting the issuer key in
    `issuer_dir` (sign calls with `support.ledger_auth.LedgerAuth(issuer_dir)`) and scrapes with
    `metrics_tokens`; yields its URL."""
    verifier = Verifier(issuer_in(issuer_dir).public_key)
    app = create_app(database_url, control_plane=verifier, clock_ms=clock_ms, metrics_tokens=metrics_tokens)
    with ThreadedServer(app, name="ledger") as server:
        wait_until_healthy(server.url)
        register(server.url, issuer_dir)
        yield server.url


@contextmanager
def priced_ledger(
    backend: str, directory: Path, price_book: dict, *, metrics_tokens: tuple[str, ...] = ()
) -> Iterator[httpx.Client]:
    """A ledger on `backend` (a fresh database), served in a thread, with `price_book` as its
    first version; yields a client that signs its calls as the control plane."""
    from support.ledger_auth import LedgerAuth

    with (
        ledger_database_url(backend, directory) as database_url,
        ledger_in_thread(database_url, issuer_dir=directory, metrics_tokens=metrics_tokens) as url,
        httpx.Client(base_url=url, timeout=30, auth=LedgerAuth(directory)) as client,
    ):
        answer = client.post("/v1/price-book/versions", json=price_book)
        assert answer.status_code == 201, answer.text
        yield client


class LedgerProcess:
    """The ledger as its own OS process (``service.main``), for tests that kill it."""

    def __init__(self, database_url: str, port: int, log_path: Path, *, issuer_dir: Path) -> None:
        self.key = public_key_path(issuer_dir / "issuer_key.pem")
        issuer_in(issuer_dir)  # the key pair, made before the process starts
        self.database_url = database_url
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        register(self.url, issuer_dir)
        self._log_path = log_path
        self.process: CliProcess | None = None

    def start(self) -> None:
        """`gpucloud ledger`, forked from the test process's server that imported the CLI once
        (`support/forked.py`): a fresh interpreter spends about 1.5 CPU-seconds importing it, and
        the chaos test starts it again after every kill."""
        self.process = CliProcess(
            [
                "ledger",
                "--port",
                str(self.port),
                "--database-url",
                self.database_url,
                "--control-plane-key",
                str(self.key),
            ],
            env={"PATH": os.environ["PATH"], "GPUCLOUD_DATA_DIR": str(self._log_path.parent / "ledger-process")},
            log_path=self._log_path,
        )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None


def post_allocation_event(
    ledger: httpx.Client,
    allocation: str,
    kind: str,
    at_ms: int,
    node: str | None = None,
    *,
    gpu_type: str = "h100",
    price_class: str | None = None,
) -> None:
    """One allocation event of tenant `t1` (8 GPUs a node), as the control plane posts it; it must
    be taken (201)."""
    body = {
        "event_id": f"{allocation}/{kind}/{node}/{at_ms}",
        "allocation_id": allocation,
        "tenant_id": "t1",
        "kind": kind,
        "at_ms": at_ms,
        "node_id": node,
        "gpu_type": gpu_type if kind in ("start", "node_added") else None,
        "gpu_count": 8 if kind == "node_added" else None,
        "price_class": price_class,
    }
    answer = ledger.post("/v1/allocation-events", json=body)
    assert answer.status_code == 201, answer.text
