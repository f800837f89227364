"""platform evaluations: who signed a result (platform or reported), why it failed, its details; the evaluator
a gate's metric must come from; a model's evaluation command

Revision ID: 0013
Revises: 0012
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("registry_evaluation", schema=None) as batch_op:
        # Every result recorded before this revision came from a tenant's key.
        batch_op.add_column(sa.Column("source", sa.String(length=16), nullable=False, server_default="reported"))
        batch_op.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("details", sa.JSON(), nullable=True))
    with op.batch_alter_table("registry_gate", schema=None) as batch_op:
        batch_op.add_column(sa.Column("evaluator", sa.String(length=32), nullable=False, server_default="command"))
    # Gates on the sanity evaluator's metrics hold that evaluator's values.
    op.execute(
        "UPDATE registry_gate SET evaluator = 'sanity' WHERE metric IN ("
        "'nan_inf_count', 'nan_count', 'inf_count', 'tensor_count', 'max_rel_norm_change', "
        "'tensors_over_norm_threshold', 'shape_changes', 'dtype_changes', 'tensors_added', "
        "'tensors_removed', 'files_added', 'files_removed')"
    )
    with op.batch_alter_table("registry_model", schema=None) as batch_op:
        batch_op.add_column(sa.Column("evaluation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("registry_model", schema=None) as batch_op:
        batch_op.drop_column("evaluation")
    with op.batch_alter_table("registry_gate", schema=None) as batch_op:
        batch_op.drop_column("evaluator")
    with op.batch_alter_table("registry_evaluation", schema=None) as batch_op:
        for column in ("details", "error", "source"):
            batch_op.drop_column(column)
