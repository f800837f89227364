"""preemptible allocations: an allocation's tier, and when (and for which request) it was preempted

Revision ID: 0027
Revises: 0026
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gpucloud.models.tables import UTCDateTime

revision: str = "0027"
down_revision: str | Sequence[str] | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tier", sa.String(length=16), nullable=False, server_default="on_demand"))
        batch_op.add_column(sa.Column("preempted_at", UTCDateTime(), nullable=True))
        batch_op.add_column(sa.Column("preempted_for", sa.String(length=64), nullable=True))
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.alter_column("tier", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_column("preempted_for")
        batch_op.drop_column("preempted_at")
        batch_op.drop_column("tier")
