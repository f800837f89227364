"""idempotency leases: a claimed key carries a lease its request renews; an allocation records
the key it was created under, so a re-run after a crash returns it instead of making another

Revision ID: 0008
Revises: 0007
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("idempotencyrecord", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.add_column(sa.Column("idempotency_key", sa.String(length=300), nullable=True))
        batch_op.create_index(batch_op.f("ix_allocation_idempotency_key"), ["idempotency_key"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("allocation", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_allocation_idempotency_key"))
        batch_op.drop_column("idempotency_key")
    with op.batch_alter_table("idempotencyrecord", schema=None) as batch_op:
        batch_op.drop_column("lease_until")
