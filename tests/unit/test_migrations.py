"""The Alembic migrations produce exactly the schema the SQLModel metadata describes."""

import contextlib
import multiprocessing
import os

import pytest
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


def _migrate_in_child(url: str) -> None:
    migrate(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_processes_starting_together_migrate_one_fresh_database(tmp_path, backend):
    """API replicas and workers start at once: one migrates, the others wait and find it done."""
    postgres = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL")
    if backend == "postgres" and not postgres:
        pytest.skip("GPUCLOUD_TEST_POSTGRES_URL not set")
    context = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        if backend == "sqlite":
            url = f"sqlite:///{tmp_path / 'm.db'}"
        else:
            from support.databases import scratch_postgres

            url = stack.enter_context(scratch_postgres(postgres))
        children = [context.Process(target=_migrate_in_child, args=(url,)) for _ in range(4)]
        for child in children:
            child.start()
        for child in children:
            child.join(120)
        assert [child.exitcode for child in children] == [0, 0, 0, 0]
        with get_engine(url).connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), SQLModel.metadata) == []
        get_engine(url).dispose()
