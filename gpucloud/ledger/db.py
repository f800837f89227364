"""The ledger's database: engine set-up, schema migrations, and the single-writer rule.

The ledger keeps its own database (SQLite file by default, Postgres by URL), never the
control plane's. Its schema is created by the Alembic migrations in ``migrations/``, run
programmatically when the service starts.

Every write goes through :meth:`LedgerDatabase.write`, which serialises writers: on SQLite with
``BEGIN IMMEDIATE`` (plus a process lock so threads queue instead of polling on SQLITE_BUSY),
on Postgres with a transaction-level advisory lock. One writer at a time is what makes
ingest's checks (duplicate, overlap, running totals) and a period close exact without relying
on isolation levels; ingesting in batches of thousands keeps that fast.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from alembic.config import Config
from sqlalchemy import Connection, Engine, Table, create_engine, event, text

from gpucloud.db import require_current_schema, schema_revisions, upgrade

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
VERSION_TABLE = "ledger_alembic_version"
# Arbitrary constant naming the ledger's writer lock among Postgres advisory locks.
_PG_WRITER_LOCK = 0x6C65646765
_SQLITE_BEGIN_OPTION = "ledger_sqlite_begin"
_PG_MIGRATION_LOCK = 0x6C65646766  # the ledger's migrations, one process at a time


class LedgerDatabase:
    """The ledger's engine plus the way to read from it and to write to it."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.is_sqlite = database_url.startswith("sqlite")
        self.engine = _sqlite_engine(database_url) if self.is_sqlite else _postgres_engine(database_url)
        self._writer_lock = threading.Lock()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction: one consistent snapshot, no locks held against writers."""
        with self.engine.begin() as connection:
            yield connection

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A transaction that holds the ledger's single-writer lock until it commits."""
        if self.is_sqlite:
            with self._writer_lock, self.engine.connect() as connection:
                immediate = connection.execution_options(**{_SQLITE_BEGIN_OPTION: "IMMEDIATE"})
                with immediate.begin():
                    yield immediate
            return
        with self.engine.begin() as connection:
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_WRITER_LOCK})
            yield connection

    def migrate(self, revision: str = "head") -> None:
        """Bring the schema to `revision`, the newest by default (a no-op when it is already there);
        concurrent migrations wait for each other."""
        upgrade(self.engine, _alembic_config(), _PG_MIGRATION_LOCK, revision)

    def require_current_schema(self) -> None:
        require_current_schema(self.engine, _alembic_config(), what="ledger database")

    def revisions(self) -> tuple[str | None, str]:
        return schema_revisions(self.engine, _alembic_config())

    def dispose(self) -> None:
        self.engine.dispose()


def _alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("version_table", VERSION_TABLE)
    return config


def open_ledger_database(database_url: str, *, migrate_on_start: bool = True) -> LedgerDatabase:
    """Engine plus a current schema (migrated now, or checked): what the service needs before it
    takes traffic."""
    database = LedgerDatabase(database_url)
    if migrate_on_start:
        database.migrate()
    else:
        database.require_current_schema()
    return database


def _postgres_engine(database_url: str) -> Engine:
    return create_engine(database_url, pool_pre_ping=True, pool_size=8, max_overflow=8)


def _sqlite_engine(database_url: str) -> Engine:
    engine = create_engine(
        database_url,
        connect_args={"check_same_thread": False, "timeout": 30},
        pool_size=8,
        max_overflow=8,
    )

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection, _record) -> None:
        # Take transaction control away from sqlite3's legacy mode so BEGIN is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # An acknowledged batch is on disk: the agent may drop its copy after our 2xx.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        # Usage indexes are written in node and tenant order, not in insert order: a cache
        # that holds their hot pages keeps ingest from re-reading them (SQLite's default: 2 MB).
        cursor.execute("PRAGMA cache_size=-262144")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get(_SQLITE_BEGIN_OPTION, "DEFERRED")
        connection.exec_driver_sql(f"BEGIN {mode}")

    return engine


def insert_tuples(connection: Connection, table: Table, columns: Sequence[str], rows: Sequence[tuple]) -> None:
    """Bulk insert of plain tuples straight through the driver, in the current transaction.

    For the hot path only (usage samples): SQLAlchemy's per-row parameter processing costs
    about as much as SQLite's own insert at 8,000 rows per batch. On Postgres the rows go in
    with COPY, which checks constraints and fires triggers like INSERT, several times faster
    than row-by-row statements.
    """
    if connection.dialect.name == "postgresql":
        driver_connection = connection.connection.driver_connection
        assert driver_connection is not None  # an open connection has its driver's
        copy_sql = f"COPY {table.name} ({', '.join(columns)}) FROM STDIN"
        with driver_connection.cursor() as cursor, cursor.copy(copy_sql) as copy:
            for row in rows:
                copy.write_row(row)
        return
    statement = f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES ({', '.join(['?'] * len(columns))})"
    connection.exec_driver_sql(statement, list(rows))
