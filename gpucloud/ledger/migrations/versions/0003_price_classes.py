"""Price classes and capacity reservations.

- ``allocation_events.price_class``: the class a ``start`` event names (on_demand, reserved,
  preemptible); NULL on older events and on other kinds, read as on_demand.
- ``postings.price_class``: the class a close's posting bills at (``held`` true-ups and
  ``reserved`` postings); NULL on the meters' own postings, which are rated at the on-demand
  price while the period is open.
- ``price_book_class_prices``: a version's prices for the classes other than on_demand (its
  on-demand prices stay in ``price_book_prices``).
- ``reservations``: capacity reservations, billed for their whole window.

Columns and tables are added, never rewritten; the new tables are append-only like the rest.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# As 0001: SQLite only auto-assigns INTEGER PRIMARY KEY (the rowid alias).
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
NEW_APPEND_ONLY = ("price_book_class_prices", "reservations")


def upgrade() -> None:
    op.add_column("allocation_events", sa.Column("price_class", sa.String(16), nullable=True))
    op.add_column("postings", sa.Column("price_class", sa.String(16), nullable=True))
    op.create_table(
        "price_book_class_prices",
        sa.Column("version_id", _ID, nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("price_class", sa.String(16), nullable=False),
        sa.Column("price_per_hour_micro", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("price_per_hour_micro >= 0", name="ck_price_book_class_prices_price_non_negative"),
        sa.CheckConstraint(
            "price_class IN ('reserved', 'preemptible')", name="ck_price_book_class_prices_class_known"
        ),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["price_book_versions.id"],
            name="fk_price_book_class_prices_version_id_price_book_versions",
        ),
        sa.PrimaryKeyConstraint("version_id", "gpu_type", "price_class", name="pk_price_book_class_prices"),
    )
    op.create_table(
        "reservations",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("reservation_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("node_count", sa.Integer(), nullable=False),
        sa.Column("gpus_per_node", sa.Integer(), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("end_ms", sa.BigInteger(), nullable=False),
        sa.Column("recorded_ms", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("end_ms > start_ms AND start_ms >= 0", name="ck_reservations_window_valid"),
        sa.CheckConstraint("node_count > 0 AND gpus_per_node > 0", name="ck_reservations_size_positive"),
        sa.PrimaryKeyConstraint("id", name="pk_reservations"),
        sa.UniqueConstraint("reservation_id", name="uq_reservations_reservation_id"),
    )
    op.create_index("ix_reservations_tenant_id", "reservations", ["tenant_id"])
    _forbid_changes()


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def _forbid_changes() -> None:
    """The same triggers as 0001's on the new tables (its function on Postgres)."""
    if not _sqlite():
        for table in NEW_APPEND_ONLY:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change()"
            )
            op.execute(
                f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                "FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change()"
            )
        return
    for table in NEW_APPEND_ONLY:
        for action in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {table}_no_{action.lower()} BEFORE {action} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: correct it with a reversal'); END"
            )


def downgrade() -> None:
    op.drop_index("ix_reservations_tenant_id", "reservations")
    op.drop_table("reservations")
    op.drop_table("price_book_class_prices")
    op.drop_column("postings", "price_class")
    op.drop_column("allocation_events", "price_class")
