"""registry versions by content: `content_digest` (the manifest's digest without its creation
time), unique per tenant and signing key, so the same files and lineage pushed again (or twice at
once) under one key end as one version. Versions registered before have none (NULLs never collide).

Revision ID: 0017
Revises: 0016
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("registry_version", schema=None) as batch_op:
        batch_op.add_column(sa.Column("content_digest", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint(
            "uq_registry_version_tenant_content", ["tenant_id", "content_digest", "key_id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("registry_version", schema=None) as batch_op:
        batch_op.drop_constraint("uq_registry_version_tenant_content", type_="unique")
        batch_op.drop_column("content_digest")
