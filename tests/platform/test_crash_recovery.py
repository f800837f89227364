"""A worker killed (SIGKILL) mid-provisioning and restarted: the allocation still completes."""

from __future__ import annotations

import signal

import pytest

from support.stack import async_wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


@pytest.mark.long
async def test_worker_killed_mid_provisioning_allocation_still_completes(db_url, make_harness):
    # Slow actions (provision ~ 0.4 s x 5) so the kill lands while agents are working.
    h = make_harness(db_url, nodes=4, latency_scale=5.0)
    worker = h.start_worker_process()
    h.enroll_fleet()
    await h.wait_states({"available": 4}, timeout_s=90)
    _, key = await h.onboard()
    with h.client(key) as c:
        alloc = c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 3, "region": "us-east-1"}).json()
    alloc_id = alloc["allocation"]["id"]

    await async_wait_until(
        lambda: any(n["state"] == "provisioning" for n in h.nodes()), timeout_s=30, what="a node provisioning"
    )
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    states = {n["state"] for n in h.nodes() if n["allocation_id"] == alloc_id}
    assert "active" not in states or "provisioning" in states or "reserved" in states

    h.start_worker_process()
    ready = await h.wait_allocation(key, alloc_id, "ready", timeout_s=120)
    nodes = {n["id"]: n for n in h.nodes()}
    assert all(nodes[n]["state"] == "active" for n in ready["node_ids"])
    # No node was provisioned twice for the tenant, none is in two allocations.
    assert sum(1 for n in nodes.values() if n["allocation_id"] == alloc_id) == 3


async def test_an_allocation_whose_workflow_never_started_is_adopted_by_the_next_sweep(ready_fleet, temporal_env):
    """The API committed the allocation and died before starting its workflow: the next full
    sweep starts it, and the allocation becomes ready."""
    from datetime import timedelta

    from sqlmodel import col, select

    from gpucloud.api.routers.allocations import AllocationRequest, _create_in_db
    from gpucloud.db import session_scope
    from gpucloud.models.tables import Allocation, Tenant

    h = await ready_fleet(nodes=2)
    tenant_id, key = await h.onboard()
    alloc, _ = _create_in_db(
        h.settings, tenant_id, AllocationRequest(gpu_type="H100", node_count=1, region="us-east-1"), actor="tenant:t"
    )
    with session_scope(h.settings.database_url) as session:  # committed a minute ago, never started
        row = session.exec(select(Allocation).where(col(Allocation.id) == alloc.id)).one()
        row.created_at -= timedelta(minutes=1)
        session.add(row)
        assert session.exec(select(Tenant).where(col(Tenant.id) == tenant_id)).one().status == "active"

    result = await h.sweep(temporal_env.client)
    assert result.adopted == 1
    await h.wait_allocation(key, alloc.id, "ready", timeout_s=60)
    assert (await h.sweep(temporal_env.client)).adopted == 0  # its workflow runs: nothing to adopt
