"""tracker swarms: each rollout's swarm spec, kept so the tracker survives its restart

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tracker_swarm",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=True),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("tracker_swarm")
