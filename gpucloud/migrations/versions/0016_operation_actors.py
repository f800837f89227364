"""operation and allocation event actors: every operation and allocation event names who asked
(`operator:<name>`, `tenant:<id>/key:<key id>` or `system`); rows written before say `unknown`

Revision ID: 0016
Revises: 0015
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Existing rows get it, then the column has no server default: the application names every actor.
_UNKNOWN = "unknown"


def upgrade() -> None:
    for table in ("operation", "allocationevent"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("actor", sa.String(length=300), nullable=False, server_default=_UNKNOWN))
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.alter_column("actor", server_default=None)


def downgrade() -> None:
    for table in ("operation", "allocationevent"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("actor")
