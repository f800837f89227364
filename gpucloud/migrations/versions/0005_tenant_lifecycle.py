"""tenants: lifecycle status, VNI and storage prefix, quotas, API key rotation

Tenants that exist before this revision were created whole by the old synchronous API: they
become `active`.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.add_column(sa.Column("status", sa.String(), nullable=False, server_default="active"))
        batch_op.add_column(sa.Column("vni", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("storage_prefix", sa.String(), nullable=True))
        batch_op.add_column(sa.Column("failure_reason", sa.String(), nullable=True))
        batch_op.add_column(sa.Column("updated_at", TS, nullable=True))
        batch_op.create_index(batch_op.f("ix_tenant_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_tenant_vni"), ["vni"], unique=True)
    op.execute("UPDATE tenant SET updated_at = created_at")
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.alter_column("updated_at", existing_type=TS, nullable=False)

    op.create_table(
        "tenantquota",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=False),
        sa.Column("gpu_type", sa.String(), nullable=False),
        sa.Column("region", sa.String(), nullable=False),
        sa.Column("max_gpus", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("tenant_id", "gpu_type", "region", name="uq_tenant_quota"),
    )
    with op.batch_alter_table("tenantquota", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tenantquota_tenant_id"), ["tenant_id"], unique=False)

    with op.batch_alter_table("apikey", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", TS, nullable=True))
        batch_op.add_column(sa.Column("replaced_by", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("apikey", schema=None) as batch_op:
        batch_op.drop_column("replaced_by")
        batch_op.drop_column("expires_at")
    op.drop_table("tenantquota")
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tenant_vni"))
        batch_op.drop_index(batch_op.f("ix_tenant_status"))
        batch_op.drop_column("updated_at")
        batch_op.drop_column("failure_reason")
        batch_op.drop_column("storage_prefix")
        batch_op.drop_column("vni")
        batch_op.drop_column("status")
