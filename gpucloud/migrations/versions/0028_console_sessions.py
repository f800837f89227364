"""console sessions: who is signed in to the web console, by the hash of the cookie's session id

Revision ID: 0028
Revises: 0027
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028"
down_revision: str | Sequence[str] | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "console_session",
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("credential_id", sa.String(length=128), nullable=False),
        sa.Column("credential_hash", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=True),
        sa.Column("csrf_token", sa.String(length=64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id_hash"),
    )
    op.create_index("ix_console_session_expires_at", "console_session", ["expires_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_console_session_expires_at", table_name="console_session")
    op.drop_table("console_session")
