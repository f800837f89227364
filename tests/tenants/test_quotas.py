"""Quotas at allocation create: a clear 409 naming the quota, its limit and the usage; exact under
concurrent creates on SQLite and Postgres, through the API and straight at the admission
transaction; operators change them, tenants read their own."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from typer.testing import CliRunner

from gpucloud.api.routers.allocations import AllocationRequest, _create_in_db
from gpucloud.cli.main import app
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import TERMINAL_ALLOCATION, Allocation, Node, Tenant, TenantQuota, TenantStatus
from gpucloud.web.problems import Problem

pytestmark = pytest.mark.integration

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
        assert problem["quota"] == {"gpu_type": "H100", "region": "us-east-1", "max_gpus": 16}
        assert (problem["usage_gpus"], problem["requested_gpus"], problem["left_gpus"]) == (16, 8, 0)
        # In nodes and GPUs both: the tenant asked in nodes, the quota counts GPUs.
        assert problem["detail"].startswith(
            "1 node (8 GPUs) of H100 requested in us-east-1; the quota (H100/us-east-1) is 16 GPUs, "
            "2 nodes (16 GPUs) in use, 0 nodes (0 GPUs) left"
        )
        report = c.get(f"/v1/tenants/{tenant_id}/quotas").json()
        assert report["usage"] == [
            {
                "gpu_type": "H100",
                "region": "us-east-1",
                "usage_gpus": 16,
                "usage_nodes": 2,
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


async def test_a_tenant_allocates_only_what_an_operator_granted(ready):
    """Before: a tenant was given `*/*` = 8192 GPUs beside what the operator granted, so a cap on
    one type or region left every other open; `h100` was an unknown type; and B200, which the
    fleet has none of, was refused as "try fewer nodes or later"."""
    h = ready
    tenant_id, key = await h.onboard(quotas=[])
    with h.client(key) as c:
        assert c.get(f"/v1/tenants/{tenant_id}/quotas").json()["quotas"] == []  # nothing implicit
        refused = c.post("/v1/allocations", json=ALLOC)
        assert refused.status_code == 409, refused.text
        problem = refused.json()
        assert problem["type"].endswith("/quota-not-granted") and problem["granted"] == []
        assert "no quota is granted for H100 in us-east-1" in problem["detail"]
        assert f"gpucloud tenants quota {tenant_id} H100:us-east-1=GPUS" in problem["detail"]

    # The operator grants one from the CLI, in any case; the tenant allocates in any case.
    runner = CliRunner()
    env = {
        "GPUCLOUD_API__PORT": str(h.settings.api.port),
        "GPUCLOUD_API__OPERATOR_TOKEN": h.settings.operator_token,
        "GPUCLOUD_DATA_DIR": str(h.settings.data_dir),
    }
    granted = await asyncio.to_thread(
        runner.invoke, app, ["tenants", "quota", tenant_id, "h100:us-east-1=8", "-o", "json"], env=env
    )
    assert granted.exit_code == 0, granted.output
    assert json.loads(granted.output)["quotas"] == [{"gpu_type": "H100", "region": "us-east-1", "max_gpus": 8}]
    with h.client(key) as c:
        created = c.post("/v1/allocations", json={**ALLOC, "gpu_type": "h100"})
        assert created.status_code == 202, created.text
        assert created.json()["allocation"]["gpu_type"] == "H100"
        # A type the fleet has none of says so and lists what it has, whatever the quota.
        absent = c.post("/v1/allocations", json={**ALLOC, "gpu_type": "B200"})
        assert absent.status_code == 422, absent.text
        assert absent.json()["type"].endswith("/not-offered")
        assert absent.json()["detail"].startswith("gpu_type: the fleet has no B200 nodes; on offer: H100 in us-east-1")
        assert "later" not in absent.json()["detail"]
        nowhere = c.post("/v1/allocations", json={**ALLOC, "region": "eu-west-1"})
        assert nowhere.status_code == 422 and "regions on offer: us-east-1" in nowhere.json()["detail"]
    # A grant merges into what the tenant holds; `--remove` takes one away.
    more = await asyncio.to_thread(
        runner.invoke, app, ["tenants", "quota", tenant_id, "A100:*=16", "--remove", "H100:us-east-1"], env=env
    )
    assert more.exit_code == 0, more.output
    with h.operator as op:
        quotas = op.get(f"/v1/tenants/{tenant_id}/quotas").json()
    assert quotas["quotas"] == [{"gpu_type": "A100", "region": "*", "max_gpus": 16}]
    # What it still holds shows against no grant.
    assert quotas["usage"][0]["quota"] is None and quotas["usage"][0]["usage_nodes"] == 1


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
