"""Quotas at allocation create: a clear 409 naming the quota, its limit and the usage; exact under
concurrent creates on SQLite and Postgres, through the API and straight at the admission
transaction; operators change them, tenants read their own."""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gpucloud.api.routers.allocations import AllocationRequest, _create_in_db
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import TERMINAL_ALLOCATION, Allocation, Node, Tenant, TenantQuota, TenantStatus
from gpucloud.web.problems import Problem

ALLOC = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}


@pytest.fixture
async def ready(ready_fleet):
    return await ready_fleet(nodes=8, latency_scale=0.02)


async def test_quota_exceeded_is_a_409_naming_quota_limit_and_usage(ready):
    h = ready
    tenant_id, key = await h.onboard(
        quotas=[
            {"gpu_type": "H100", "region": "us-east-1", "max_gpus": 16},
            {"gpu_type": "*", "region": "*", "max_gpus": 0},
        ]
    )
    with h.client(key) as c:
        assert c.post("/v1/allocations", json={**ALLOC, "node_count": 2}).status_code == 202
        refused = c.post("/v1/allocations", json=ALLOC)
        assert refused.status_code == 409
        assert refused.headers["content-type"].startswith("application/problem+json")
        problem = refused.json()
        assert problem["type"].endswith("/quota-exceeded")
        assert problem["quota"] == {"gpu_type": "H100", "region": "us-east-1", "max_gpus": 16, "source": "tenant"}
        assert (problem["usage_gpus"], problem["requested_gpus"]) == (16, 8)
        assert "16" in problem["detail"] and "H100" in problem["detail"] and "us-east-1" in problem["detail"]
        report = c.get(f"/v1/tenants/{tenant_id}/quotas").json()
        assert report["usage"] == [
            {
                "gpu_type": "H100",
                "region": "us-east-1",
                "usage_gpus": 16,
                "max_gpus": 16,
                "quota": {"gpu_type": "H100", "region": "us-east-1", "max_gpus": 16},
            }
        ]
        # Tenants read quotas, operators change them.
        assert c.put(f"/v1/tenants/{tenant_id}/quotas", json={"quotas": []}).status_code == 403
    with h.operator as op:
        raised = op.put(
            f"/v1/tenants/{tenant_id}/quotas", json={"quotas": [{"gpu_type": "H100", "region": "*", "max_gpus": 24}]}
        )
        assert raised.status_code == 200 and raised.json()["usage"][0]["max_gpus"] == 24
    with h.client(key) as c:
        assert c.post("/v1/allocations", json=ALLOC).status_code == 202
        assert c.post("/v1/allocations", json=ALLOC).json()["usage_gpus"] == 24
        # A released allocation no longer counts.
        first = c.get("/v1/allocations").json()["items"][0]["id"]
        assert c.post(f"/v1/allocations/{first}/cancel").status_code == 202
    await h.wait_allocation(key, first, "released")
    with h.client(key) as c:
        assert c.post("/v1/allocations", json=ALLOC).status_code == 202


async def test_concurrent_creates_through_the_api_never_exceed_the_quota(ready):
    h = ready
    _, key = await h.onboard(quotas=[{"gpu_type": "H100", "region": "*", "max_gpus": 24}])
    async with httpx.AsyncClient(base_url=h.api.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        answers = await asyncio.gather(*(c.post("/v1/allocations", json=ALLOC) for _ in range(8)))
    codes = sorted(a.status_code for a in answers)
    assert codes == [202] * 3 + [409] * 5, [a.text for a in answers]
    assert all(a.json()["type"].endswith("/quota-exceeded") for a in answers if a.status_code == 409)
    assert sum(1 for n in h.nodes() if n["allocation_id"]) == 3


def _seed(db_url: str, *, nodes: int, max_gpus: int) -> str:
    tag = uuid.uuid4().hex[:6]
    with session_scope(db_url) as session:
        tenant = Tenant(name=f"race-{tag}", status=TenantStatus.ACTIVE)
        session.add(tenant)
        session.flush()
        session.add(TenantQuota(tenant_id=tenant.id, gpu_type="H100", region="us-east-1", max_gpus=max_gpus))
        for i in range(nodes):
            session.add(
                Node(
                    id=f"{tag}-{i:03d}",
                    hostname=f"h{i}",
                    region="us-east-1",
                    pod=f"pod{i % 4}",
                    rack=f"rack{i}",
                    gpu_type="H100",
                    gpu_count=8,
                    agent_url="http://unused",
                    state=NodeState.AVAILABLE,
                )
            )
        return tenant.id


def test_admission_is_exact_under_concurrent_transactions(db_url, tmp_path):
    """Many creates of one tenant at once, straight at the admission transaction (no HTTP, no
    Temporal, many connections on Postgres): exactly as many fit as the quota allows."""
    tenant_id = _seed(db_url, nodes=24, max_gpus=5 * 8)
    settings = Settings(data_dir=tmp_path, database={"url": db_url}, api={"operator_token": "x"})
    start = threading.Barrier(16)

    def create(_):
        start.wait()
        try:
            _create_in_db(settings, tenant_id, AllocationRequest(**ALLOC), actor=f"tenant:{tenant_id}")
            return "created"
        except Problem as problem:
            return problem.type

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(create, range(16)))
    assert sorted(outcomes) == ["created"] * 5 + ["quota-exceeded"] * 11
    with session_scope(db_url) as session:
        live = [
            a
            for a in session.query(Allocation).filter(Allocation.tenant_id == tenant_id).all()
            if a.status not in TERMINAL_ALLOCATION
        ]
    assert sum(a.node_count for a in live) == 5
