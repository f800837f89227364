"""allocation active rollout: the rollout that holds the allocation, one at a time

Revision ID: 0018
Revises: 0017
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("active_rollout_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("active_rollout_claimed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_column("active_rollout_claimed_at")
        batch_op.drop_column("active_rollout_id")
