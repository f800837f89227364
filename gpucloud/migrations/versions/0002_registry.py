"""weight registry: models, versions, aliases, evaluation gates and results, signing keys

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Timestamps are timezone-aware everywhere (gpucloud.models.tables.UTCDateTime on the model side).
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "registry_model",
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("description", sa.String(length=1000), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_registry_model_tenant_name"),
    )
    op.create_index("ix_registry_model_id", "registry_model", ["id"], unique=True)
    op.create_index("ix_registry_model_tenant_id", "registry_model", ["tenant_id"])

    op.create_table(
        "registry_version",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("parent", sa.String(length=64), nullable=True),
        sa.Column("base_model", sa.String(), nullable=True),
        sa.Column("training_run", sa.String(), nullable=True),
        sa.Column("dataset_digests", sa.JSON(), nullable=False),
        sa.Column("total_size", sa.BigInteger(), nullable=False),
        sa.Column("chunk_count", sa.Integer(), nullable=False),
        sa.Column("file_count", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("manifest_uri", sa.String(), nullable=False),
        sa.Column("registered_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["registry_model.id"]),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("tenant_id", "digest", name="uq_registry_version_tenant_digest"),
    )
    op.create_index("ix_registry_version_model_id", "registry_version", ["model_id"])
    op.create_index("ix_registry_version_tenant_id", "registry_version", ["tenant_id"])
    op.create_index("ix_registry_version_tenant_parent", "registry_version", ["tenant_id", "parent"])

    op.create_table(
        "registry_alias",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("moved_at", TS, nullable=False),
        sa.Column("moved_by", sa.String(), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["registry_model.id"]),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("model_id", "name", name="uq_registry_alias_model_name"),
    )
    op.create_index("ix_registry_alias_model_id", "registry_alias", ["model_id"])

    op.create_table(
        "registry_gate",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.String(), nullable=False),
        sa.Column("metric", sa.String(length=100), nullable=False),
        sa.Column("min_value", sa.Float(), nullable=True),
        sa.Column("max_value", sa.Float(), nullable=True),
        sa.Column("max_regression", sa.Float(), nullable=True),
        sa.Column("higher_is_better", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["registry_model.id"]),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("model_id", "metric", name="uq_registry_gate_model_metric"),
    )
    op.create_index("ix_registry_gate_model_id", "registry_gate", ["model_id"])

    op.create_table(
        "registry_evaluation",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("evaluator", sa.String(), nullable=False),
        sa.Column("results", sa.JSON(), nullable=False),
        sa.Column("recorded_at", TS, nullable=False),
        sa.Column("record_digest", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("signature", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("tenant_id", "record_digest", name="uq_registry_evaluation_tenant_record"),
    )
    op.create_index("ix_registry_evaluation_tenant_version", "registry_evaluation", ["tenant_id", "version"])

    op.create_table(
        "registry_signing_key",
        sa.Column("public_key", sa.String(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("revoked_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("tenant_id", "key_id", name="uq_registry_signing_key_tenant_key"),
    )
    op.create_index("ix_registry_signing_key_tenant_id", "registry_signing_key", ["tenant_id"])


def downgrade() -> None:
    # Children first: aliases, gates and versions reference registry_model.
    for table in ("registry_signing_key", "registry_evaluation", "registry_gate", "registry_alias",
                  "registry_version", "registry_model"):
        op.drop_table(table)
