"""Database access: engine creation, schema migrations and their check at start-up, and sessions.

Migrations are a step (`gpucloud migrate`, safe to run concurrently); a process that does not
migrate at start (`database.migrate_on_start`; by default only the embedded SQLite does) checks
that the schema is the one it needs and refuses to run otherwise, saying what to do.

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


def _sqlite_engine(url: str, *, connections: int, on_connect, begin: str | None) -> sa.Engine:
    """A pool of `connections` to a SQLite file whose transactions start with `begin`; with
    None, each statement is its own transaction (autocommit)."""
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": 30},
        pool_size=connections,
        max_overflow=0,
        pool_timeout=POOL_TIMEOUT_S,
    )
    sa.event.listen(engine, "connect", on_connect)
    # pysqlite's own transaction handling would defer BEGIN; do it ourselves.
    sa.event.listen(engine, "connect", lambda c, r: setattr(c, "isolation_level", None))
    if begin is not None:
        sa.event.listen(engine, "begin", lambda conn: conn.exec_driver_sql(begin))
    return engine


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
        # Its transactions take the write lock at BEGIN: a read-then-write transaction can then
        # never fail to upgrade its lock halfway (SQLITE_BUSY without waiting), so CAS loops
        # stay simple.
        return _sqlite_engine(url, connections=1, on_connect=_sqlite_pragmas, begin="BEGIN IMMEDIATE")
    return create_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True, pool_timeout=POOL_TIMEOUT_S)


# Connections per process for transactions that only read (SQLite; see `get_read_engine`).
SQLITE_READERS = 4


def _sqlite_reader(dbapi_conn, _record) -> None:
    _sqlite_pragmas(dbapi_conn, _record)
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA query_only=ON")  # a reader never writes, whatever a caller tries
    cur.close()


@lru_cache(maxsize=8)
def get_read_engine(url: str) -> sa.Engine:
    """Connections for transactions that only read (credentials, a heartbeat that changes
    nothing). On both databases each statement is its own transaction (autocommit: a read of
    one statement needs no BEGIN and COMMIT around it, one call instead of three), so a caller
    that reads twice may see a write land between the two. SQLite in WAL mode serves readers
    beside its one writer: they get a few connections of their own, which never wait for the
    write lock, instead of queueing for the writer's one connection, and cannot write
    (`query_only`). Postgres: the one pool; nothing there refuses a write, so callers only
    read."""
    writer = get_engine(url)  # on SQLite it also makes the file's folder
    if not url.startswith("sqlite"):
        return writer.execution_options(isolation_level="AUTOCOMMIT")
    return _sqlite_engine(url, connections=SQLITE_READERS, on_connect=_sqlite_reader, begin=None)


@contextmanager
def read_scope(url: str, *, snapshot: bool = False) -> Iterator[Session]:
    """A session for reads only (see `get_read_engine`: on SQLite it cannot write; each statement
    is its own transaction). With `snapshot`, its statements all see the database as of the
    first (figures that must add up): SQLite begins a deferred transaction, which takes no write
    lock; Postgres reads in REPEATABLE READ, READ ONLY."""
    engine = get_read_engine(url)
    with Session(engine, expire_on_commit=False) as session, session.begin():
        if snapshot and engine.dialect.name == "sqlite":
            session.connection().exec_driver_sql("BEGIN")
        elif snapshot:
            session.connection(execution_options={"isolation_level": "REPEATABLE READ", "postgresql_readonly": True})
        yield session


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(url: str) -> None:
    """Bring the schema to the newest migration (idempotent)."""
    upgrade(get_engine(url), alembic_config(url), MIGRATION_LOCK)


class SchemaNotCurrent(RuntimeError):
    """The database's schema is not the one this release needs; the message says what to run."""


def upgrade(engine: sa.Engine, cfg: Config, lock: int, revision: str = "head") -> None:
    """Run the migrations up to `revision` in one transaction, one process at a time: on Postgres
    under an advisory lock (processes migrating at once wait, then find the schema current);
    SQLite's BEGIN IMMEDIATE serialises them already."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({lock})")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def schema_revisions(engine: sa.Engine, cfg: Config) -> tuple[str | None, str]:
    """The database's schema revision (None: no schema) and the newest this release knows."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None  # the release ships its migrations
    version_table = cfg.get_main_option("version_table") or "alembic_version"
    with engine.connect() as conn:
        current = MigrationContext.configure(conn, opts={"version_table": version_table}).get_current_revision()
    return current, head


def require_current_schema(engine: sa.Engine, cfg: Config, *, what: str) -> None:
    """Refuse to run on a schema this release does not know: SchemaNotCurrent saying what to do."""
    current, head = schema_revisions(engine, cfg)
    if current == head:
        return
    if current is None:
        raise SchemaNotCurrent(f"the {what} has no schema yet: run `gpucloud migrate` first")
    known = {script.revision for script in _scripts(cfg)}
    if current not in known:
        raise SchemaNotCurrent(
            f"the {what} is at revision {current}, newer than this release knows ({head}): "
            "run the release that migrated it, or a newer one"
        )
    raise SchemaNotCurrent(f"the {what} is at revision {current}; this release needs {head}: run `gpucloud migrate`")


def _scripts(cfg: Config) -> list[Any]:
    from alembic.script import ScriptDirectory

    return list(ScriptDirectory.from_config(cfg).walk_revisions())


def prepare_schema(url: str, *, migrate_on_start: bool) -> None:
    """At a process's start: migrate (the embedded default), or check the schema is current."""
    if migrate_on_start:
        migrate(url)
    else:
        require_current_schema(get_engine(url), alembic_config(url), what="control-plane database")


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

    def reads(self, *, snapshot: bool = False) -> contextlib.AbstractContextManager[Session]:
        """A session for reads only (`read_scope`)."""
        return read_scope(self.url, snapshot=snapshot)

    def read_connection(self) -> sa.Connection:
        """A reader's connection (`get_read_engine`: each statement its own transaction)."""
        return get_read_engine(self.url).connect()

    def migrate(self) -> None:
        migrate(self.url)

    def prepare(self, *, migrate_on_start: bool) -> None:
        prepare_schema(self.url, migrate_on_start=migrate_on_start)

    def revisions(self) -> tuple[str | None, str]:
        return schema_revisions(self.engine, alembic_config(self.url))


@contextmanager
def scratch_postgres(base_url: str, prefix: str = "gpucloud_test") -> Iterator[str]:
    """A fresh, uniquely named database on the Postgres server of `base_url` (for tests and
    benchmarks, which may reset the schema they are given); yields its URL, and drops it (with
    the connections left open to it) on exit."""
    import uuid

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        url = sa.engine.make_url(base_url).set(database=name).render_as_string(hide_password=False)
        try:
            yield url
        finally:
            get_engine(url).dispose()  # the pooled connections the code that used it left open
            with admin.connect() as connection:
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()
