"""fleet-kind incidents: a correlated burst's or a breaker trip's incident, and the tenants an incident touched

Revision ID: 0025
Revises: 0024

(0024 may be another branch's; whoever merges both chains them.)
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025"
down_revision: str | Sequence[str] | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("incident", schema=None) as batch_op:
        batch_op.add_column(sa.Column("trigger", sa.String(), nullable=False, server_default="pull"))
        batch_op.add_column(sa.Column("fleet_incident_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("pool", sa.String(), nullable=True))
        batch_op.add_column(sa.Column("detail", sa.JSON(), nullable=False, server_default="{}"))
        batch_op.create_index("ix_incident_fleet_incident_id", ["fleet_incident_id"], unique=False)
    with op.batch_alter_table("incident", schema=None) as batch_op:
        batch_op.alter_column("trigger", server_default=None)
        batch_op.alter_column("detail", server_default=None)
    op.create_table(
        "incident_tenant",
        sa.Column("incident_id", sa.String(), nullable=False),
        sa.Column("allocation_id", sa.String(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("incident_id", "allocation_id", "node_id"),
    )
    op.create_index("ix_incident_tenant_tenant_id", "incident_tenant", ["tenant_id"])
    # The node incidents already written: their one tenant, allocation and node.
    incident = sa.table(
        "incident",
        sa.column("id", sa.String()),
        sa.column("node_id", sa.String()),
        sa.column("tenant_id", sa.String()),
        sa.column("allocation_ids", sa.JSON()),
    )
    link = sa.table(
        "incident_tenant",
        sa.column("incident_id", sa.String()),
        sa.column("allocation_id", sa.String()),
        sa.column("node_id", sa.String()),
        sa.column("tenant_id", sa.String()),
    )
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(incident.c.id, incident.c.node_id, incident.c.tenant_id, incident.c.allocation_ids).where(
            incident.c.tenant_id.is_not(None)
        )
    ).all()
    links = [
        {"incident_id": i, "allocation_id": a, "node_id": n or "", "tenant_id": t}
        for i, n, t, allocations in rows
        for a in allocations or []
    ]
    if links:
        op.bulk_insert(link, links)


def downgrade() -> None:
    op.drop_index("ix_incident_tenant_tenant_id", table_name="incident_tenant")
    op.drop_table("incident_tenant")
    with op.batch_alter_table("incident", schema=None) as batch_op:
        batch_op.drop_index("ix_incident_fleet_incident_id")
        batch_op.drop_column("detail")
        batch_op.drop_column("pool")
        batch_op.drop_column("fleet_incident_id")
        batch_op.drop_column("trigger")
