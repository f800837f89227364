"""health loop: XID events, quarantine pulls, operator alerts, allocation events

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "xid_event",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=True),
        sa.Column("gpu_uuid", sa.String(), nullable=True),
        sa.Column("xid", sa.Integer(), nullable=False),
        sa.Column("timestamp", TS, nullable=False),
        sa.Column("message", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=True),
        sa.Column("allocation_id", sa.String(), nullable=True),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_xid_event_node_id", "xid_event", ["node_id"])
    op.create_index("ix_xid_event_timestamp", "xid_event", ["timestamp"])

    op.create_table(
        "quarantine_pull",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("pool", sa.String(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_quarantine_pull_pool", "quarantine_pull", ["pool"])
    op.create_index("ix_quarantine_pull_at", "quarantine_pull", ["at"])

    op.create_table(
        "operator_alert",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("pool", sa.String(), nullable=True),
        sa.Column("node_id", sa.String(), nullable=True),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )

    op.create_table(
        "allocationevent",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("allocation_id", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=True),
        sa.Column("replacement_node_id", sa.String(), nullable=True),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_allocationevent_allocation_id", "allocationevent", ["allocation_id"])
    op.create_index("ix_allocationevent_tenant_id", "allocationevent", ["tenant_id"])


def downgrade() -> None:
    op.drop_table("allocationevent")
    op.drop_table("operator_alert")
    op.drop_table("quarantine_pull")
    op.drop_table("xid_event")
