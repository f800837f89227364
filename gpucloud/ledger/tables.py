"""The ledger database's tables: its own MetaData, apart from the control plane's.

Every table except ``rating_accumulators`` is append-only. Corrections are new rows (a
reversal posting), never an UPDATE or DELETE; migration 0001 installs triggers that make the
database refuse both on those tables, and a unit test checks that no code path issues them.

Money is integer micro-units of currency; time is integer epoch milliseconds; usage is
GPU-milliseconds (duration x GPU count).

The migrations in ``gpucloud/ledger/migrations`` create these tables; ``tests`` compare the
two so they cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

# SQLite only auto-assigns INTEGER PRIMARY KEY (the rowid alias), not BIGINT.
IdType = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

APPEND_ONLY_TABLES = (
    "price_book_versions",
    "price_book_prices",
    "price_book_discounts",
    "allocation_events",
    "postings",
    "entry_lines",
    "usage_samples",
    "usage_conflicts",
    "billing_periods",
    "invoices",
    "price_book_class_prices",
    "reservations",
)

price_book_versions = Table(
    "price_book_versions",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("effective_from_ms", BigInteger, nullable=False, unique=True),
    Column("note", Text, nullable=False, server_default=""),
    Column("created_ms", BigInteger, nullable=False),
)

price_book_prices = Table(
    "price_book_prices",
    metadata,
    Column("version_id", ForeignKey("price_book_versions.id"), primary_key=True),
    Column("gpu_type", String(64), primary_key=True),
    Column("price_per_hour_micro", BigInteger, nullable=False),
    CheckConstraint("price_per_hour_micro >= 0", name="price_non_negative"),
)

price_book_discounts = Table(
    "price_book_discounts",
    metadata,
    Column("version_id", ForeignKey("price_book_versions.id"), primary_key=True),
    Column("tenant_id", String(128), primary_key=True),
    Column("gpu_type", String(64), primary_key=True),
    Column("discount_bp", Integer, nullable=False),
    CheckConstraint("discount_bp >= 0 AND discount_bp <= 10000", name="discount_range"),
)

price_book_class_prices = Table(
    "price_book_class_prices",
    metadata,
    # A version's prices for the classes other than on_demand (those are `price_book_prices`).
    Column("version_id", ForeignKey("price_book_versions.id"), primary_key=True),
    Column("gpu_type", String(64), primary_key=True),
    Column("price_class", String(16), primary_key=True),
    Column("price_per_hour_micro", BigInteger, nullable=False),
    CheckConstraint("price_per_hour_micro >= 0", name="price_non_negative"),
    CheckConstraint("price_class IN ('reserved', 'preemptible')", name="class_known"),
)

allocation_events = Table(
    "allocation_events",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("event_id", String(128), nullable=False, unique=True),
    Column("allocation_id", String(128), nullable=False),
    Column("tenant_id", String(128), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("node_id", String(128)),
    Column("gpu_type", String(64)),
    Column("gpu_count", Integer),
    # What a `start` event says the allocation is billed as; NULL (older events) is on_demand.
    Column("price_class", String(16)),
    Column("at_ms", BigInteger, nullable=False),
    Column("recorded_ms", BigInteger, nullable=False),
    CheckConstraint("kind IN ('start', 'node_added', 'node_removed', 'end')", name="kind_known"),
    Index(None, "tenant_id", "allocation_id"),
    Index(None, "allocation_id"),
)


def _line_columns(*, primary_key: bool = False, nullable: bool = False) -> list[Column]:
    """The columns that name an invoice line: what postings record and rating groups by."""
    types: list[tuple[str, Any]] = [
        ("billing_period", String(7)),
        ("usage_period", String(7)),
        ("tenant_id", String(128)),
        ("allocation_id", String(128)),
        ("gpu_type", String(64)),
        ("price_version_id", ForeignKey("price_book_versions.id")),
    ]
    return [Column(name, type_, primary_key=primary_key, nullable=nullable) for name, type_ in types]


postings = Table(
    "postings",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("kind", String(16), nullable=False),
    # Where a usage posting comes from: the nodes' meters, or the close's true-up to held time
    # (`held.py`), or a capacity reservation (`reserved`, its id in `allocation_id`). A reversal
    # keeps its original's.
    Column("source", String(8), nullable=False, server_default="meter"),
    *_line_columns(nullable=False),
    # The class a close's posting bills at (`held`, `reserved`); NULL on the meters' postings.
    Column("price_class", String(16)),
    Column("gpu_ms", BigInteger, nullable=False),
    Column("amount_micro", BigInteger, nullable=False),
    Column("sample_count", Integer, nullable=False),
    Column("reverses_posting_id", ForeignKey("postings.id"), unique=True),
    Column("reason", Text, nullable=False, server_default=""),
    Column("created_ms", BigInteger, nullable=False),
    CheckConstraint("kind IN ('usage', 'reversal')", name="kind_known"),
    Index(None, "tenant_id", "allocation_id"),
    Index(None, "billing_period", "kind"),
)

entry_lines = Table(
    "entry_lines",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("posting_id", ForeignKey("postings.id"), nullable=False),
    Column("account", String(256), nullable=False),
    Column("side", String(6), nullable=False),
    Column("amount_micro", BigInteger, nullable=False),
    CheckConstraint("side IN ('debit', 'credit')", name="side_known"),
    CheckConstraint("amount_micro >= 0", name="amount_non_negative"),
    Index(None, "posting_id"),
    Index(None, "account"),
)

usage_samples = Table(
    "usage_samples",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("node_id", String(128), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("allocation_id", String(128), nullable=False),
    Column("tenant_id", String(128), nullable=False),
    Column("gpu_type", String(64), nullable=False),
    Column("gpu_count", Integer, nullable=False),
    Column("start_ms", BigInteger, nullable=False),
    Column("end_ms", BigInteger, nullable=False),
    Column("gpu_ms", BigInteger, nullable=False),
    Column("amount_micro", BigInteger, nullable=False),
    Column("price_version_id", ForeignKey("price_book_versions.id"), nullable=False),
    Column("usage_period", String(7), nullable=False),
    Column("billing_period", String(7), nullable=False),
    Column("posting_id", ForeignKey("postings.id"), nullable=False),
    Column("ingested_ms", BigInteger, nullable=False),
    # Exactly once per (node, seq) forever: there is no dedup window to expire.
    UniqueConstraint("node_id", "seq"),
    CheckConstraint("end_ms > start_ms AND start_ms >= 0", name="interval_valid"),
    CheckConstraint("gpu_count > 0", name="gpu_count_positive"),
    Index(None, "node_id", "start_ms"),
    # Serves both the period close (billing_period = ?) and a tenant's usage over time
    # (billing_period IN (...) AND tenant_id = ? AND start_ms range). Every index costs
    # ingest ~10% (a covering one in the close's GROUP BY order would make the close ~5x
    # faster for ~15%); the close of 10M samples is fast enough without.
    Index(None, "billing_period", "tenant_id", "start_ms"),
)


usage_conflicts = Table(
    "usage_conflicts",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("node_id", String(128), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("existing_sample_id", ForeignKey("usage_samples.id")),
    Column("received", Text, nullable=False),
    Column("detected_ms", BigInteger, nullable=False),
    Index(None, "node_id", "seq"),
)

rating_accumulators = Table(
    "rating_accumulators",
    metadata,
    # One row per invoice line being built: its running totals let a new sample be rated
    # as a step on the cumulative amount (see pricing.py). The only mutable table.
    *_line_columns(primary_key=True),
    Column("gpu_ms_total", BigInteger, nullable=False),
    Column("amount_total_micro", BigInteger, nullable=False),
    Column("max_start_ms", BigInteger, nullable=False),
)

billing_periods = Table(
    "billing_periods",
    metadata,
    # A row exists once the period is closed; an absent period is open.
    Column("period_id", String(7), primary_key=True),
    Column("start_ms", BigInteger, nullable=False),
    Column("end_ms", BigInteger, nullable=False),
    Column("closed_ms", BigInteger, nullable=False),
)

reservations = Table(
    "reservations",
    metadata,
    # A capacity reservation: billed for [start_ms, end_ms) x node_count x gpus_per_node at the
    # reserved price, used or not. GPUs per node are the catalog's when it was recorded.
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("reservation_id", String(128), nullable=False, unique=True),
    Column("tenant_id", String(128), nullable=False),
    Column("gpu_type", String(64), nullable=False),
    Column("node_count", Integer, nullable=False),
    Column("gpus_per_node", Integer, nullable=False),
    Column("start_ms", BigInteger, nullable=False),
    Column("end_ms", BigInteger, nullable=False),
    Column("recorded_ms", BigInteger, nullable=False),
    CheckConstraint("end_ms > start_ms AND start_ms >= 0", name="window_valid"),
    CheckConstraint("node_count > 0 AND gpus_per_node > 0", name="size_positive"),
    Index(None, "tenant_id"),
)

invoices = Table(
    "invoices",
    metadata,
    Column("id", IdType, primary_key=True, autoincrement=True),
    Column("period_id", ForeignKey("billing_periods.period_id"), nullable=False),
    Column("tenant_id", String(128), nullable=False),
    Column("total_micro", BigInteger, nullable=False),
    Column("line_count", Integer, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("created_ms", BigInteger, nullable=False),
    UniqueConstraint("period_id", "tenant_id"),
)
