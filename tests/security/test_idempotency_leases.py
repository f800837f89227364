"""Issue 13, row 9: a create whose request died holding its Idempotency-Key (the API process
killed mid-request): the claim's lease lapses, a retry with the key takes it over and runs the
create again, and an allocation the dead try already committed is returned, not made twice
(SQLite and Postgres)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import col, select

from gpucloud.db import session_scope
from gpucloud.models.tables import Allocation, IdempotencyRecord, utcnow

pytestmark = pytest.mark.integration

BODY = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}


def _as_if_the_request_died(db_url: str, key: str) -> None:
    """The claim without an answer, its lease run out: what a killed request leaves behind."""
    with session_scope(db_url) as session:
        record = session.exec(select(IdempotencyRecord).where(col(IdempotencyRecord.key) == key)).one()
        record.status_code, record.response_body = None, None
        record.lease_until = utcnow() - timedelta(seconds=1)
        session.add(record)


async def test_a_retry_after_a_dead_request_returns_what_it_committed_and_makes_nothing_twice(ready_fleet):
    h = await ready_fleet(nodes=2)
    tenant_id, key = await h.onboard()
    with h.client(key) as tenant:
        first = tenant.post("/v1/allocations", json=BODY, headers={"Idempotency-Key": "k-committed"})
        assert first.status_code == 202, first.text
        _as_if_the_request_died(h.settings.database_url, "k-committed")
        retried = tenant.post("/v1/allocations", json=BODY, headers={"Idempotency-Key": "k-committed"})
        assert retried.status_code == 202, retried.text
        assert retried.headers.get("idempotent-replayed") is None  # run again, not replayed
        assert retried.json()["allocation"]["id"] == first.json()["allocation"]["id"]
        replayed = tenant.post("/v1/allocations", json=BODY, headers={"Idempotency-Key": "k-committed"})
        assert replayed.headers.get("idempotent-replayed") == "true"
        assert replayed.json()["allocation"]["id"] == first.json()["allocation"]["id"]
        await h.wait_allocation(key, first.json()["allocation"]["id"], "ready", timeout_s=60)

        # A claim whose request died before committing anything: the retry creates it, once.
        with session_scope(h.settings.database_url) as session:
            now = utcnow()
            session.add(
                IdempotencyRecord(
                    caller=_caller_of(h.settings.database_url, first.json()["allocation"]["id"]),
                    key="k-lost",
                    method="POST",
                    path="/v1/allocations",
                    body_hash=_hash(BODY),
                    created_at=now - timedelta(minutes=1),
                    expires_at=now + timedelta(hours=24),
                    lease_until=now - timedelta(seconds=30),
                )
            )
        created = tenant.post("/v1/allocations", json=BODY, headers={"Idempotency-Key": "k-lost"})
        assert created.status_code == 202, created.text
    with session_scope(h.settings.database_url) as session:
        allocations = session.exec(select(Allocation).where(col(Allocation.tenant_id) == tenant_id)).all()
    assert len(allocations) == 2 and len({a.id for a in allocations}) == 2


def _caller_of(db_url: str, allocation_id: str) -> str:
    """The caller id the API keyed the first create's claim under."""
    with session_scope(db_url) as session:
        tag = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).one().idempotency_key
    assert tag is not None
    return tag.rsplit(":", 1)[0]


def _hash(body: dict) -> str:
    import json

    from gpucloud.api.idempotency import body_hash

    return body_hash(json.dumps(body).encode())
