"""Initial ledger schema: price book, allocation events, usage, double-entry postings, periods.

Also makes the append-only tables refuse UPDATE and DELETE (and TRUNCATE on Postgres) in the
database itself, so a correction can only ever be a new row.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

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
)


def upgrade() -> None:
    _create_price_book()
    _create_allocation_events()
    _create_postings()
    _create_usage()
    _create_periods()
    _forbid_changes()


def _create_price_book() -> None:
    op.create_table(
        "price_book_versions",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("effective_from_ms", sa.BigInteger(), nullable=False),
        sa.Column("note", sa.Text(), server_default="", nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_price_book_versions"),
        sa.UniqueConstraint("effective_from_ms", name="uq_price_book_versions_effective_from_ms"),
    )
    op.create_table(
        "price_book_prices",
        sa.Column("version_id", _ID, nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("price_per_hour_micro", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("price_per_hour_micro >= 0", name="ck_price_book_prices_price_non_negative"),
        sa.ForeignKeyConstraint(
            ["version_id"], ["price_book_versions.id"],
            name="fk_price_book_prices_version_id_price_book_versions",
        ),
        sa.PrimaryKeyConstraint("version_id", "gpu_type", name="pk_price_book_prices"),
    )
    op.create_table(
        "price_book_discounts",
        sa.Column("version_id", _ID, nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("discount_bp", sa.Integer(), nullable=False),
        sa.CheckConstraint(
            "discount_bp >= 0 AND discount_bp <= 10000", name="ck_price_book_discounts_discount_range"
        ),
        sa.ForeignKeyConstraint(
            ["version_id"], ["price_book_versions.id"],
            name="fk_price_book_discounts_version_id_price_book_versions",
        ),
        sa.PrimaryKeyConstraint("version_id", "tenant_id", "gpu_type", name="pk_price_book_discounts"),
    )


def _create_allocation_events() -> None:
    op.create_table(
        "allocation_events",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("allocation_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("node_id", sa.String(128), nullable=True),
        sa.Column("gpu_type", sa.String(64), nullable=True),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("recorded_ms", sa.BigInteger(), nullable=False),
        sa.CheckConstraint(
            "kind IN ('start', 'node_added', 'node_removed', 'end')",
            name="ck_allocation_events_kind_known",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_allocation_events"),
        sa.UniqueConstraint("event_id", name="uq_allocation_events_event_id"),
    )
    op.create_index(
        "ix_allocation_events_tenant_id_allocation_id", "allocation_events", ["tenant_id", "allocation_id"]
    )
    op.create_index("ix_allocation_events_allocation_id", "allocation_events", ["allocation_id"])


def _create_postings() -> None:
    op.create_table(
        "postings",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("billing_period", sa.String(7), nullable=False),
        sa.Column("usage_period", sa.String(7), nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("allocation_id", sa.String(128), nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("price_version_id", _ID, nullable=False),
        sa.Column("gpu_ms", sa.BigInteger(), nullable=False),
        sa.Column("amount_micro", sa.BigInteger(), nullable=False),
        sa.Column("sample_count", sa.Integer(), nullable=False),
        sa.Column("reverses_posting_id", _ID, nullable=True),
        sa.Column("reason", sa.Text(), server_default="", nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("kind IN ('usage', 'reversal')", name="ck_postings_kind_known"),
        sa.ForeignKeyConstraint(
            ["price_version_id"], ["price_book_versions.id"],
            name="fk_postings_price_version_id_price_book_versions",
        ),
        sa.ForeignKeyConstraint(
            ["reverses_posting_id"], ["postings.id"], name="fk_postings_reverses_posting_id_postings"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_postings"),
        sa.UniqueConstraint("reverses_posting_id", name="uq_postings_reverses_posting_id"),
    )
    op.create_index("ix_postings_tenant_id_allocation_id", "postings", ["tenant_id", "allocation_id"])
    op.create_index("ix_postings_billing_period_kind", "postings", ["billing_period", "kind"])
    op.create_table(
        "entry_lines",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("posting_id", _ID, nullable=False),
        sa.Column("account", sa.String(256), nullable=False),
        sa.Column("side", sa.String(6), nullable=False),
        sa.Column("amount_micro", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("side IN ('debit', 'credit')", name="ck_entry_lines_side_known"),
        sa.CheckConstraint("amount_micro >= 0", name="ck_entry_lines_amount_non_negative"),
        sa.ForeignKeyConstraint(["posting_id"], ["postings.id"], name="fk_entry_lines_posting_id_postings"),
        sa.PrimaryKeyConstraint("id", name="pk_entry_lines"),
    )
    op.create_index("ix_entry_lines_posting_id", "entry_lines", ["posting_id"])
    op.create_index("ix_entry_lines_account", "entry_lines", ["account"])


def _create_usage() -> None:
    op.create_table(
        "usage_samples",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("node_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("allocation_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("end_ms", sa.BigInteger(), nullable=False),
        sa.Column("gpu_ms", sa.BigInteger(), nullable=False),
        sa.Column("amount_micro", sa.BigInteger(), nullable=False),
        sa.Column("price_version_id", _ID, nullable=False),
        sa.Column("usage_period", sa.String(7), nullable=False),
        sa.Column("billing_period", sa.String(7), nullable=False),
        sa.Column("posting_id", _ID, nullable=False),
        sa.Column("ingested_ms", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("end_ms > start_ms AND start_ms >= 0", name="ck_usage_samples_interval_valid"),
        sa.CheckConstraint("gpu_count > 0", name="ck_usage_samples_gpu_count_positive"),
        sa.ForeignKeyConstraint(
            ["price_version_id"], ["price_book_versions.id"],
            name="fk_usage_samples_price_version_id_price_book_versions",
        ),
        sa.ForeignKeyConstraint(["posting_id"], ["postings.id"], name="fk_usage_samples_posting_id_postings"),
        sa.PrimaryKeyConstraint("id", name="pk_usage_samples"),
        sa.UniqueConstraint("node_id", "seq", name="uq_usage_samples_node_id_seq"),
    )
    op.create_index("ix_usage_samples_node_id_start_ms", "usage_samples", ["node_id", "start_ms"])
    op.create_index(
        "ix_usage_samples_billing_period_tenant_id_start_ms",
        "usage_samples",
        ["billing_period", "tenant_id", "start_ms"],
    )
    op.create_table(
        "usage_conflicts",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("node_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("existing_sample_id", _ID, nullable=True),
        sa.Column("received", sa.Text(), nullable=False),
        sa.Column("detected_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["existing_sample_id"], ["usage_samples.id"],
            name="fk_usage_conflicts_existing_sample_id_usage_samples",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_usage_conflicts"),
    )
    op.create_index("ix_usage_conflicts_node_id_seq", "usage_conflicts", ["node_id", "seq"])
    op.create_table(
        "rating_accumulators",
        sa.Column("billing_period", sa.String(7), nullable=False),
        sa.Column("usage_period", sa.String(7), nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("allocation_id", sa.String(128), nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("price_version_id", _ID, nullable=False),
        sa.Column("gpu_ms_total", sa.BigInteger(), nullable=False),
        sa.Column("amount_total_micro", sa.BigInteger(), nullable=False),
        sa.Column("max_start_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["price_version_id"], ["price_book_versions.id"],
            name="fk_rating_accumulators_price_version_id_price_book_versions",
        ),
        sa.PrimaryKeyConstraint(
            "billing_period", "usage_period", "tenant_id", "allocation_id", "gpu_type", "price_version_id",
            name="pk_rating_accumulators",
        ),
    )


def _create_periods() -> None:
    op.create_table(
        "billing_periods",
        sa.Column("period_id", sa.String(7), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("end_ms", sa.BigInteger(), nullable=False),
        sa.Column("closed_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("period_id", name="pk_billing_periods"),
    )
    op.create_table(
        "invoices",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("period_id", sa.String(7), nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("total_micro", sa.BigInteger(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["period_id"], ["billing_periods.period_id"], name="fk_invoices_period_id_billing_periods"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_invoices"),
        sa.UniqueConstraint("period_id", "tenant_id", name="uq_invoices_period_id_tenant_id"),
    )


def _forbid_changes() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            """
            CREATE FUNCTION ledger_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'ledger table % is append-only: correct it with a reversal', TG_TABLE_NAME
                    USING ERRCODE = 'restrict_violation';
            END $$
            """
        )
        for table in APPEND_ONLY_TABLES:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change()"
            )
            op.execute(
                f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                "FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change()"
            )
        return
    for table in APPEND_ONLY_TABLES:
        for action in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {table}_no_{action.lower()} BEFORE {action} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: correct it with a reversal'); END"
            )


def downgrade() -> None:
    for table in reversed(
        ("price_book_versions", "price_book_prices", "price_book_discounts", "allocation_events",
         "postings", "entry_lines", "usage_samples", "usage_conflicts", "rating_accumulators",
         "billing_periods", "invoices")
    ):
        op.drop_table(table)
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION ledger_refuse_change()")
