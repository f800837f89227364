"""The Alembic migrations produce exactly the schema the SQLModel metadata describes."""

import contextlib
import json
import multiprocessing
import os

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import SQLModel

import gpucloud.models.health_tables
import gpucloud.models.registry_tables
import gpucloud.models.scheduling_tables
import gpucloud.models.tables  # noqa: F401
from gpucloud.db import get_engine, migrate

pytestmark = pytest.mark.unit


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


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db(request, tmp_path):
    postgres = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL")
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'control.db'}", f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    if not postgres:
        pytest.skip("GPUCLOUD_TEST_POSTGRES_URL not set")
    from support.databases import scratch_postgres

    with scratch_postgres(postgres) as control, scratch_postgres(postgres) as ledger:
        yield control, ledger
        get_engine(control).dispose()


@pytest.fixture
def restore_logging():
    """`gpucloud migrate` sets up logging for its process (here, this one): undo it afterwards."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def test_gpucloud_migrate_is_the_step_and_the_processes_refuse_an_old_schema(empty_db, tmp_path, restore_logging):
    """With migrations as a deployment step, the API, the worker and the ledger check the schema at
    start and refuse an old or missing one, naming what to run; `gpucloud migrate` brings both
    databases current (`--check` changes nothing and says whether they are)."""
    import asyncio

    from typer.testing import CliRunner

    from gpucloud.api.app import create_app
    from gpucloud.cli.main import app as cli
    from gpucloud.config import Settings
    from gpucloud.db import SchemaNotCurrent, alembic_config, upgrade
    from gpucloud.ledger.db import LedgerDatabase, open_ledger_database
    from gpucloud.workers.main import run_worker

    control, ledger = empty_db
    settings = Settings(
        data_dir=tmp_path,
        database={"url": control, "migrate_on_start": False},
        ledger={"database_url": ledger, "migrate_on_start": False},
    )
    env = settings.env()

    async def start_api() -> None:
        app = create_app(settings, temporal=object())  # the schema is checked before Temporal is used
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(SchemaNotCurrent, match=r"has no schema yet: run `gpucloud migrate` first"):
        asyncio.run(start_api())
    with pytest.raises(SchemaNotCurrent, match="the ledger database has no schema yet"):
        open_ledger_database(ledger, migrate_on_start=False)

    upgrade(get_engine(control), alembic_config(control), 1, "0012")  # an older release's schema
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config(control)).get_current_head()
    assert head is not None and head > "0012"
    with pytest.raises(SchemaNotCurrent, match=rf"at revision 0012; this release needs {head}: run `gpucloud migrate`"):
        asyncio.run(start_api())
    with pytest.raises(SchemaNotCurrent, match="at revision 0012"):
        asyncio.run(run_worker(settings))

    runner = CliRunner()
    checked = runner.invoke(cli, ["migrate", "--check", "--output", "json"], env=env)
    assert checked.exit_code == 1, checked.output
    assert [(r["database"], r["before"], r["current"]) for r in json.loads(checked.stdout)] == [
        ("control plane", "0012", False),
        ("ledger", None, False),
    ]
    done = runner.invoke(cli, ["migrate"], env=env)
    assert done.exit_code == 0, done.output
    assert "0012" in done.output and "0018" in done.output
    again = runner.invoke(cli, ["migrate", "--check", "--output", "json"], env=env)
    assert again.exit_code == 0 and all(r["current"] for r in json.loads(again.stdout))
    asyncio.run(start_api())
    open_ledger_database(ledger, migrate_on_start=False).dispose()
    LedgerDatabase(ledger).dispose()
