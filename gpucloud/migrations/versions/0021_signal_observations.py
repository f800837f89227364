"""signal observations: the signals beyond XIDs (kernel log, InfiniBand sysfs) nodes report, judged with their XIDs

Revision ID: 0021
Revises: 0020
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | Sequence[str] | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "signal_observation",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("signal", sa.String(), nullable=False),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("span_s", sa.Float(), nullable=True),
        sa.Column("at", TS, nullable=False),
        sa.Column("detail", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=True),
        sa.Column("allocation_id", sa.String(), nullable=True),
        sa.Column("reported_by", sa.String(), nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_signal_observation_node_time", "signal_observation", ["node_id", "at"])


def downgrade() -> None:
    op.drop_index("ix_signal_observation_node_time", table_name="signal_observation")
    op.drop_table("signal_observation")
