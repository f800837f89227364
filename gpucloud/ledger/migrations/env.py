"""Alembic environment for the ledger database.

``LedgerDatabase.migrate`` builds the Alembic Config in code and hands over an open
connection, so there is no alembic.ini: the ledger migrates itself when it starts.
"""

from alembic import context
from sqlalchemy import text

from gpucloud.ledger.tables import metadata

# Ledgers starting side by side on one Postgres must not both create the schema.
_PG_MIGRATION_LOCK = 0x6C65646766


def run_migrations_online() -> None:
    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=context.config.get_main_option("version_table"),
        # SQLite supports transactional DDL once BEGIN is ours (see db.py): a ledger
        # killed half-way through a migration then leaves no half-made schema behind.
        transactional_ddl=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("the ledger migrates online only: run it through LedgerDatabase.migrate")
run_migrations_online()
