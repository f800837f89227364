"""allocation workload: what provision starts on each node of the allocation

Revision ID: 0011
Revises: 0010
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("workload", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_column("workload")
