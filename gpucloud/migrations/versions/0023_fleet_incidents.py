"""fleet incidents: where nodes sit (leaf switch, PDU), incidents that suspect a shared component, the node's open one

Revision ID: 0023
Revises: 0022
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | Sequence[str] | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.add_column(sa.Column("leaf_switch", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("pdu", sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column("fleet_incident_id", sa.String(length=64), nullable=True))
        batch_op.create_index("ix_node_fleet_incident_id", ["fleet_incident_id"], unique=False)
    op.create_index("ix_signal_observation_at", "signal_observation", ["at"])
    op.create_table(
        "fleet_incident",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("component_kind", sa.String(), nullable=False),
        sa.Column("component_id", sa.String(), nullable=False),
        sa.Column("component_size", sa.Integer(), nullable=False),
        sa.Column("node_ids", sa.JSON(), nullable=False),
        sa.Column("cordoned", sa.JSON(), nullable=False),
        sa.Column("signals", sa.JSON(), nullable=False),
        sa.Column("first_at", TS, nullable=False),
        sa.Column("last_at", TS, nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("opened_at", TS, nullable=False),
        sa.Column("resolved_at", TS, nullable=True),
        sa.Column("resolved_by", sa.String(), nullable=True),
        sa.Column("resolution", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_fleet_incident_status", "fleet_incident", ["status"])
    op.create_index("ix_fleet_incident_component", "fleet_incident", ["component_kind", "component_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_fleet_incident_component", table_name="fleet_incident")
    op.drop_index("ix_fleet_incident_status", table_name="fleet_incident")
    op.drop_table("fleet_incident")
    op.drop_index("ix_signal_observation_at", table_name="signal_observation")
    with op.batch_alter_table("node", schema=None) as batch_op:
        batch_op.drop_index("ix_node_fleet_incident_id")
        batch_op.drop_column("fleet_incident_id")
        batch_op.drop_column("pdu")
        batch_op.drop_column("leaf_switch")
