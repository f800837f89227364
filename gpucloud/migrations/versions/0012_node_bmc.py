"""node BMC: the Redfish service, system id and credential reference; power state, last answer, hardware

Revision ID: 0012
Revises: 0011
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("bmc_url", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("bmc_system_id", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("bmc_credential_ref", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("power_state", sa.String(), nullable=True))
        batch_op.add_column(sa.Column("bmc_last", sa.JSON(), nullable=False, server_default="{}"))
        batch_op.add_column(sa.Column("hardware", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        for column in ("hardware", "bmc_last", "power_state", "bmc_credential_ref", "bmc_system_id", "bmc_url"):
            batch_op.drop_column(column)
