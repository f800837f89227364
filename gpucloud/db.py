"""Database access: engine creation, schema migrations at start-up, and sessions.

SQLite (embedded default) and Postgres behave the same: SQLite runs in WAL mode with a busy
timeout so the API, the worker and the tests can share one file; every state change is a
compare-and-swap on a row's `generation`, which is what keeps concurrent writers honest on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlmodel import Session, SQLModel, create_engine

MIGRATIONS = Path(__file__).parent / "migrations"
# The longest a thread waits for a pooled connection (seconds, not minutes): past it the caller
# gets `sqlalchemy.exc.TimeoutError`, which the API answers 503 with Retry-After.
POOL_TIMEOUT_S = 10.0
# The Postgres advisory lock that lets one process at a time run the migrations.
MIGRATION_LOCK = 0x67707563_6C6F7564  # "gpucloud"


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _sqlite_begin(conn) -> None:
    # Take the write lock at BEGIN: a read-then-write transaction can then never fail to
    # upgrade its lock halfway (SQLITE_BUSY without waiting), so CAS loops stay simple.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


@lru_cache(maxsize=8)
def get_engine(url: str) -> sa.Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # One connection per process: SQLite has one writer at a time anyway, and threads that
        # queue on the pool are served in order, while threads racing for the file lock sleep in
        # SQLite's busy handler (up to 100 ms a try) and throughput collapses under load. A
        # thread waits for it at most POOL_TIMEOUT_S: the API then answers 503 with Retry-After.
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=1,
            max_overflow=0,
            pool_timeout=POOL_TIMEOUT_S,
        )
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        # pysqlite's own transaction handling would defer BEGIN; do it ourselves.
        sa.event.listen(engine, "connect", lambda c, r: setattr(c, "isolation_level", None))
        sa.event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True, pool_timeout=POOL_TIMEOUT_S)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(url: str) -> None:
    """Bring the schema to the newest migration (idempotent; run at every start-up)."""
    engine = get_engine(url)
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # API replicas and workers start together: one migrates, the others wait and then
            # find the schema current (SQLite's BEGIN IMMEDIATE serializes them already).
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        cfg = alembic_config(url)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session whose transaction commits on success and rolls back on any error."""
    with Session(get_engine(url), expire_on_commit=False) as session, session.begin():
        yield session


def rowcount(result: sa.Result[Any]) -> int:
    """How many rows an UPDATE or DELETE changed (what a compare-and-swap checks)."""
    return cast(sa.CursorResult[Any], result).rowcount


def table_of(model: type[SQLModel]) -> sa.Table:
    """The table of a SQLModel class, for Core statements over many rows at once."""
    return model.__table__  # type: ignore[attr-defined]  # SQLModel sets it on table classes


class Database:
    """The control-plane database as its users hold it: sessions and migrations over one engine
    (one pool per process and URL). `gpucloud.bootstrap` builds it from the settings."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = get_engine(url)

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")

    def session(self) -> contextlib.AbstractContextManager[Session]:
        """A session whose transaction commits on success and rolls back on any error."""
        return session_scope(self.url)

    def migrate(self) -> None:
        migrate(self.url)
