"""Idempotency records past their retention, forgotten in bounded batches (the reconciler's full
sweep calls this, so stored responses do not outlive the promise of `api/idempotency.py`, whose
records these are; an expired key reads as unused either way)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import col, select

from gpucloud.db import Database, rowcount
from gpucloud.models.tables import IdempotencyRecord


def delete_expired(db: Database, *, now: datetime, limit: int = 1000) -> int:
    """Forget up to `limit` records whose retention ended by `now`; how many were forgotten."""
    with db.session() as session:
        expired = (
            select(IdempotencyRecord.seq).where(col(IdempotencyRecord.expires_at) <= now).limit(limit).scalar_subquery()
        )
        return rowcount(session.execute(sa.delete(IdempotencyRecord).where(col(IdempotencyRecord.seq).in_(expired))))
