"""incidents: a health pull followed from detection to the node's return, with its write-up

Revision ID: 0022
Revises: 0021
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | Sequence[str] | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "incident",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("workflow_id", sa.String(length=300), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("phase", sa.String(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=True),
        sa.Column("node_ids", sa.JSON(), nullable=False),
        sa.Column("suspected_component", sa.String(), nullable=True),
        sa.Column("category", sa.String(), nullable=False),
        sa.Column("summary", sa.String(), nullable=False),
        sa.Column("detected_at", TS, nullable=False),
        sa.Column("pulled_at", TS, nullable=True),
        sa.Column("stabilized_at", TS, nullable=True),
        sa.Column("diagnosed_at", TS, nullable=True),
        sa.Column("repaired_at", TS, nullable=True),
        sa.Column("repaired_by", sa.String(), nullable=True),
        sa.Column("gated_at", TS, nullable=True),
        sa.Column("closed_at", TS, nullable=True),
        sa.Column("tenant_id", sa.String(), nullable=True),
        sa.Column("tenant_ids", sa.JSON(), nullable=False),
        sa.Column("allocation_ids", sa.JSON(), nullable=False),
        sa.Column("replacement_node_ids", sa.JSON(), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("gpu_hours_lost", sa.Float(), nullable=False),
        sa.Column("signals", sa.JSON(), nullable=False),
        sa.Column("actions", sa.JSON(), nullable=False),
        sa.Column("root_cause", sa.String(), nullable=True),
        sa.Column("follow_ups", sa.JSON(), nullable=True),
        sa.Column("root_cause_by", sa.String(), nullable=True),
        sa.Column("root_cause_at", TS, nullable=True),
        sa.Column("write_up", sa.Text(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("workflow_id"),
    )
    op.create_index("ix_incident_id", "incident", ["id"], unique=True)
    op.create_index("ix_incident_status", "incident", ["status"])
    op.create_index("ix_incident_node_id", "incident", ["node_id"])
    op.create_index("ix_incident_tenant_id", "incident", ["tenant_id"])


def downgrade() -> None:
    op.drop_table("incident")
