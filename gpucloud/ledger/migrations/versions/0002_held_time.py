"""Held time: node GPU counts on allocation events, and the source of a usage posting.

Billed time comes from the control plane's allocation events (`ledger/held.py`): a node_added
event carries the node's GPU count, and the close posts the difference between held and metered
time as usage postings whose source is ``held`` (the meters' own are ``meter``). Both columns
are added, never rewritten, so the append-only tables stay append-only.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("allocation_events", sa.Column("gpu_count", sa.Integer(), nullable=True))
    op.add_column("postings", sa.Column("source", sa.String(8), nullable=False, server_default="meter"))


def downgrade() -> None:
    op.drop_column("postings", "source")
    op.drop_column("allocation_events", "gpu_count")
