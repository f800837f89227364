"""health loop: stored node readings for the trend rules, the circuit breaker's CAS word

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "node_reading",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("timestamp", TS, nullable=False),
        sa.Column("fatal", sa.Boolean(), nullable=False),
        sa.Column("reading", sa.JSON(), nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_node_reading_node_time", "node_reading", ["node_id", "timestamp"])

    op.create_table(
        "quarantine_breaker",
        sa.Column("pool", sa.String(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("pool"),
    )


def downgrade() -> None:
    op.drop_table("quarantine_breaker")
    op.drop_table("node_reading")
