"""The ledger's schema: migrations match the tables, and the books are append-only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import exc, insert, text

from gpucloud.ledger.db import VERSION_TABLE, open_ledger_database
from gpucloud.ledger.tables import APPEND_ONLY_TABLES, metadata, postings, price_book_versions

pytestmark = pytest.mark.unit

LEDGER_PACKAGE = Path(__file__).resolve().parents[2] / "gpucloud" / "ledger"


@pytest.fixture
def database(tmp_path: Path):
    database = open_ledger_database(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield database
    database.dispose()


def test_migrations_create_exactly_the_declared_schema(database) -> None:
    with database.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        assert compare_metadata(context, metadata) == []


def test_migrating_twice_is_a_no_op(database) -> None:
    database.migrate()
    with database.read() as connection:
        assert connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all() == ["0003"]


def test_a_ledger_from_before_held_time_upgrades_and_keeps_its_rows(tmp_path: Path) -> None:
    """0001 -> 0002 on a ledger with books: old postings are the meters', old events name no GPU
    count, and the tables stay append-only."""
    from gpucloud.ledger.db import LedgerDatabase

    database = LedgerDatabase(f"sqlite:///{tmp_path / 'old.db'}")
    database.migrate("0001")
    with database.engine.begin() as connection:
        connection.execute(
            text("INSERT INTO price_book_versions (effective_from_ms, note, created_ms) VALUES (0, '', 0)")
        )
        connection.execute(
            text(
                "INSERT INTO postings (kind, billing_period, usage_period, tenant_id, allocation_id, gpu_type,"
                " price_version_id, gpu_ms, amount_micro, sample_count, reason, created_ms)"
                " VALUES ('usage', '2024-01', '2024-01', 't', 'a', 'h100', 1, 5, 5, 1, '', 0)"
            )
        )
        connection.execute(
            text(
                "INSERT INTO allocation_events (event_id, allocation_id, tenant_id, kind, at_ms, recorded_ms)"
                " VALUES ('e1', 'a', 't', 'start', 0, 0)"
            )
        )
    database.migrate()
    with database.read() as connection:
        assert connection.execute(text("SELECT source, gpu_ms FROM postings")).all() == [("meter", 5)]
        assert connection.execute(text("SELECT gpu_count FROM allocation_events")).scalars().all() == [None]
        # 0003: old events name no price class (on_demand), old postings bill at none.
        assert connection.execute(text("SELECT price_class FROM allocation_events")).scalars().all() == [None]
        assert connection.execute(text("SELECT price_class FROM postings")).scalars().all() == [None]
    with pytest.raises(exc.DatabaseError, match="append-only"), database.write() as connection:
        connection.execute(text("UPDATE postings SET source = 'held'"))
    with database.write() as connection:
        connection.execute(
            text(
                "INSERT INTO reservations (reservation_id, tenant_id, gpu_type, node_count, gpus_per_node,"
                " start_ms, end_ms, recorded_ms) VALUES ('r', 't', 'h100', 1, 8, 0, 10, 0)"
            )
        )
    with pytest.raises(exc.DatabaseError, match="append-only"), database.write() as connection:
        connection.execute(text("DELETE FROM reservations"))
    database.dispose()


def test_the_database_refuses_updates_and_deletes_on_the_books(database) -> None:
    with database.write() as connection:
        version = connection.execute(
            insert(price_book_versions).returning(price_book_versions.c.id),
            {"effective_from_ms": 0, "created_ms": 0},
        ).scalar_one()
        connection.execute(
            insert(postings),
            {
                "kind": "usage",
                "billing_period": "2024-01",
                "usage_period": "2024-01",
                "tenant_id": "t",
                "allocation_id": "a",
                "gpu_type": "h100",
                "price_version_id": version,
                "gpu_ms": 1,
                "amount_micro": 1,
                "sample_count": 1,
                "created_ms": 0,
            },
        )
    for statement in (
        "UPDATE postings SET amount_micro = 0",
        "DELETE FROM postings",
        "UPDATE price_book_versions SET effective_from_ms = 5",
    ):
        with pytest.raises(exc.DatabaseError, match="append-only"), database.write() as connection:
            connection.execute(text(statement))


def test_append_only_tables_are_all_guarded() -> None:
    versions = LEDGER_PACKAGE / "migrations" / "versions"
    initial = (versions / "0001_initial.py").read_text()
    guarded = re.findall(r'"(\w+)"', re.search(r"APPEND_ONLY_TABLES = \(([^)]*)\)", initial).group(1))
    classes = (versions / "0003_price_classes.py").read_text()
    guarded += re.findall(r'"(\w+)"', re.search(r"NEW_APPEND_ONLY = \(([^)]*)\)", classes).group(1))
    assert sorted(guarded) == sorted(APPEND_ONLY_TABLES)
    assert set(metadata.tables) - set(APPEND_ONLY_TABLES) == {"rating_accumulators"}


def test_no_code_path_updates_or_deletes_the_books() -> None:
    """Corrections are reversal postings; only the running totals are ever rewritten."""
    mutation = re.compile(
        r"\b(?:update|delete)\(\s*(\w+)"  # SQLAlchemy update(table) / delete(table)
        r"|(\w+)\.(?:update|delete)\(\)"  # table.update() / table.delete()
        r"|\bUPDATE\s+(\w+)\s+SET\b|\bDELETE\s+FROM\s+(\w+)"  # SQL text
        r"|\bon_conflict_do_update\b"  # upserts: allowed only where the statement is the totals'
    )
    offenders = []
    for path in LEDGER_PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        source = path.read_text()
        for match in mutation.finditer(source):
            table = next((group for group in match.groups() if group), None)
            if table is None:
                table = "rating_accumulators" if "dialect_insert(rating_accumulators)" in source else "unknown"
            if table != "rating_accumulators":
                offenders.append(f"{path.relative_to(LEDGER_PACKAGE)}: {match.group(0)}")
    assert offenders == []
