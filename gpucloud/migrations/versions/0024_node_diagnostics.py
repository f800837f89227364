"""node diagnostics: when an idle node's scheduled diagnostics last ran, and the lease a running one holds

Revision ID: 0024
Revises: 0023
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | Sequence[str] | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_diag_at", TS, nullable=True))
        batch_op.add_column(sa.Column("diag_lease", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("diag_lease_until", TS, nullable=True))
        batch_op.create_index("ix_node_diag_lease_until", ["diag_lease_until"])


def downgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_index("ix_node_diag_lease_until")
        batch_op.drop_column("diag_lease_until")
        batch_op.drop_column("diag_lease")
        batch_op.drop_column("last_diag_at")
