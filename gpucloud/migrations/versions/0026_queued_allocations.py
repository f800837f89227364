"""queued allocations: a request's expected duration and longest wait, its place and estimated start in its pool's queue, and the tenants' fair-share weights

Revision ID: 0026
Revises: 0025
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gpucloud.models.tables import UTCDateTime

revision: str = "0026"
down_revision: str | Sequence[str] | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expected_duration_s", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_wait_s", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("queue_position", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("estimated_start_at", UTCDateTime(), nullable=True))
        batch_op.add_column(sa.Column("placed_at", UTCDateTime(), nullable=True))
        batch_op.create_index("ix_allocation_pool_status", ["gpu_type", "region", "status"], unique=False)
    op.create_table(
        "tenant_pool_share",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("region", sa.String(length=64), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "gpu_type", "region"),
    )


def downgrade() -> None:
    op.drop_table("tenant_pool_share")
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_index("ix_allocation_pool_status")
        batch_op.drop_column("placed_at")
        batch_op.drop_column("estimated_start_at")
        batch_op.drop_column("queue_position")
        batch_op.drop_column("max_wait_s")
        batch_op.drop_column("expected_duration_s")
