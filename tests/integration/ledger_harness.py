"""Running the ledger for tests: a real HTTP server on 127.0.0.1, on SQLite or on Postgres.

Postgres is used when ``GPUCLOUD_TEST_POSTGRES_URL`` names a reachable server (for example
``postgresql+psycopg://postgres@127.0.0.1:5432/test``): every use creates its own uniquely
named database through an autocommit connection to that URL's database and drops it
afterwards, so suites running side by side never share one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from gpucloud.ledger.app import create_app, wall_clock_ms

POSTGRES_URL_ENV = "GPUCLOUD_TEST_POSTGRES_URL"
REPO_ROOT = Path(__file__).resolve().parents[2]


def backends() -> list[str]:
    return ["sqlite", "postgres"] if os.environ.get(POSTGRES_URL_ENV) else ["sqlite"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def scratch_postgres_database(admin_url: str) -> Iterator[str]:
    """A fresh, uniquely named database on the server of ``admin_url``; dropped on exit."""
    name = f"gpucloud_ledger_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


@contextmanager
def ledger_database_url(backend: str, directory: Path, name: str = "ledger") -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{directory / (name + '.db')}"
    else:
        with scratch_postgres_database(os.environ[POSTGRES_URL_ENV]) as url:
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
def ledger_in_thread(database_url: str, *, clock_ms: Callable[[], int] = wall_clock_ms) -> Iterator[str]:
    """The ledger app served by uvicorn in a thread of this process; yields its base URL."""
    port = free_port()
    app = create_app(database_url, clock_ms=clock_ms)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name=f"ledger-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)


class LedgerProcess:
    """The ledger as its own OS process (``service.main``), for tests that kill it."""

    def __init__(self, database_url: str, port: int, log_path: Path) -> None:
        self.database_url = database_url
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        code = f"from gpucloud.ledger.app import main; main('127.0.0.1', {self.port}, {self.database_url!r})"
        with self._log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
            )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None
