"""The Alembic migrations produce exactly the schema the SQLModel metadata describes."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import SQLModel

import gpucloud.models.health_tables
import gpucloud.models.registry_tables
import gpucloud.models.tables  # noqa: F401
from gpucloud.db import get_engine, migrate


def test_migrations_match_models(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    migrate(url)
    migrate(url)  # idempotent at every start-up
    with get_engine(url).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    assert diff == []
