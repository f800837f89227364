"""Alembic environment: migrations run programmatically from gpucloud.db.migrate()."""

from alembic import context
from sqlmodel import SQLModel

import gpucloud.models.health_tables
import gpucloud.models.registry_tables
import gpucloud.models.scheduling_tables
import gpucloud.models.tables  # noqa: F401  (registers the tables on SQLModel.metadata)

config = context.config
target_metadata = SQLModel.metadata


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        from gpucloud.db import get_engine

        with get_engine(config.get_main_option("sqlalchemy.url")).begin() as conn:
            _run_with(conn)
    else:
        _run_with(connection)


def _run_with(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


run()
