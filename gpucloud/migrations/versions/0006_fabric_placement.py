"""fabric placement: nodes' GPU UIDs (NVLink partition members), NVL72 slices of allocations

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpu_uids", sa.JSON(), nullable=False, server_default="[]"))
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("nvl72_trays", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("nvlink_domain", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_column("nvlink_domain")
        batch_op.drop_column("nvl72_trays")
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_column("gpu_uids")
