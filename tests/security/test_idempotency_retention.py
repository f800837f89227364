"""Issue 37, item 10: Idempotency-Key records are kept for their retention (24 h) and no longer:
the reconciler's periodic sweep deletes the expired ones (their stored responses with them),
in bounded batches, on every database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import col, select

from gpucloud.activities.reconciler import ReconcilerActivities
from gpucloud.config import Settings
from gpucloud.db import Database, session_scope
from gpucloud.models.messages import SweepInput
from gpucloud.models.tables import IdempotencyRecord, utcnow
from gpucloud.services.idempotency_records import delete_expired

pytestmark = pytest.mark.integration


def _record(key: str, *, expires_in: timedelta) -> IdempotencyRecord:
    now = utcnow()
    return IdempotencyRecord(
        caller="tenant-a",
        key=key,
        method="POST",
        path="/v1/allocations",
        body_hash="0" * 64,
        status_code=202,
        response_body='{"secret": "shown once"}',
        created_at=now - timedelta(hours=25),
        expires_at=now + expires_in,
    )


def _keys(db_url: str) -> set[str]:
    with session_scope(db_url) as session:
        return set(session.exec(select(col(IdempotencyRecord.key))).all())


async def test_the_reconciler_sweep_deletes_expired_idempotency_records(db_url, tmp_path):
    with session_scope(db_url) as session:
        session.add(_record("expired", expires_in=-timedelta(minutes=1)))
        session.add(_record("kept", expires_in=timedelta(hours=1)))
    # The sweep's other steps find nothing to do in a database without nodes or allocations,
    # so no Temporal client is called.
    activities = ReconcilerActivities(None, Database(db_url), Settings(data_dir=tmp_path))  # type: ignore[arg-type]
    result = await activities._sweep(SweepInput())
    assert result.idempotency_expired == 1
    assert _keys(db_url) == {"kept"}


def test_expired_records_go_in_bounded_batches(db_url):
    with session_scope(db_url) as session:
        for i in range(5):
            session.add(_record(f"old-{i}", expires_in=-timedelta(seconds=1)))
    now, db = utcnow(), Database(db_url)
    assert delete_expired(db, now=now, limit=3) == 3
    assert delete_expired(db, now=now, limit=3) == 2
    assert delete_expired(db, now=now) == 0 and _keys(db_url) == set()
