"""node ssh endpoint: where a tenant reaches the node (its address on the tenants' network, the sshd port)

Revision ID: 0020
Revises: 0019
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | Sequence[str] | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("ssh_host", sa.String(length=253), nullable=True))
        batch_op.add_column(sa.Column("ssh_port", sa.Integer(), nullable=False, server_default="22"))


def downgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_column("ssh_port")
        batch_op.drop_column("ssh_host")
