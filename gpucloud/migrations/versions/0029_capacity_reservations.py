"""capacity reservations: N nodes of a pool booked for a future window, and the allocation that runs it

Revision ID: 0029
Revises: 0028
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gpucloud.models.tables import UTCDateTime

revision: str = "0029"
down_revision: str | Sequence[str] | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "capacity_reservation",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("region", sa.String(length=64), nullable=False),
        sa.Column("node_count", sa.Integer(), nullable=False),
        sa.Column("start_at", UTCDateTime(), nullable=False),
        sa.Column("end_at", UTCDateTime(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("allocation_id", sa.String(length=64), nullable=True),
        sa.Column("ready_at", UTCDateTime(), nullable=True),
        sa.Column("billed_at", UTCDateTime(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=300), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("idempotency_key"),
    )
    op.create_index("ix_capacity_reservation_id", "capacity_reservation", ["id"], unique=True)
    op.create_index("ix_capacity_reservation_tenant_id", "capacity_reservation", ["tenant_id"], unique=False)
    op.create_index("ix_capacity_reservation_status", "capacity_reservation", ["status"], unique=False)
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reservation_id", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_column("reservation_id")
    op.drop_index("ix_capacity_reservation_status", table_name="capacity_reservation")
    op.drop_index("ix_capacity_reservation_tenant_id", table_name="capacity_reservation")
    op.drop_index("ix_capacity_reservation_id", table_name="capacity_reservation")
    op.drop_table("capacity_reservation")
