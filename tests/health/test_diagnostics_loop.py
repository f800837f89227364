"""Issue 42, active signals, against the real stack: the reconciler's full sweep leases idle nodes
due for a scheduled diagnostic within the fleet-wide budget and starts each one's diagnose; an
allocation created meanwhile gets only a node no diagnostic holds; the simulated node with a
latent hardware fault fails `dcgmi diag` and is drained into quarantine before any tenant gets
it; the healthy one goes back to the pool, tested."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest
from sqlmodel import col, select

from gpucloud.db import session_scope
from gpucloud.models.tables import Node, utcnow

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

DIAG = {
    "latency_scale": 0.02,
    "health__breaker_max_pulled_share": 1.0,
    # Every node is due half a second after it came back to the pool; two at once at most.
    "health__diag_interval_s": 0.5,
    "health__diag_check_interval_s": 0.01,
    "health__diag_budget_share": 1.0,
    "health__diag_max_concurrent": 2,
    # Each diagnose takes 5 s on the simulated node: long enough to allocate meanwhile, even on a
    # loaded machine.
    "sim_args": ("--diagnose-s", "5"),
}


def _events(h, node_id: str) -> list[dict]:
    return h.operator.get(f"/v1/nodes/{node_id}/events", params={"page_size": 500}).json()["items"]


def _leased(db_url: str) -> dict[str, str]:
    with session_scope(db_url) as session:
        rows = session.exec(select(Node).where(col(Node.diag_lease_until) > utcnow())).all()
        return {n.id: n.diag_lease or "" for n in rows}


async def test_an_idle_node_with_a_latent_fault_is_diagnosed_and_pulled_before_any_tenant_gets_it(
    ready_fleet, temporal_env, db_url
):
    h = await ready_fleet(nodes=3, **DIAG)
    ids = h.node_ids()
    bad = ids[1]
    # A fault nothing has noticed: the node passed burn-in and waits in the pool.
    h.sim.client.hardware_fault(bad, "GPU 3: uncorrectable memory errors in the field diagnostic")
    with session_scope(db_url) as session:  # last tested two days ago: the first due
        node = session.get(Node, bad)
        assert node is not None
        node.last_diag_at = utcnow() - timedelta(days=2)
        session.add(node)
    _, key = await h.onboard()
    await asyncio.sleep(0.6)  # the others are due too now

    result = await h.sweep(temporal_env.client)
    assert result.diagnostics_started == 2, result  # the cap, though all three are due
    leased = _leased(db_url)
    assert bad in leased and len(leased) == 2
    (free,) = set(ids) - set(leased)
    (tested,) = set(leased) - {bad}

    # An allocation made while both diagnostics run gets the one node no diagnostic holds, and
    # the next is refused: the leased nodes are not capacity meanwhile. (Both are asked for at
    # once, while the diagnostics surely still run; the first is waited for after.)
    alloc_id = h.allocate(key, node_count=1)
    with h.client(key) as c:
        refused = c.post(
            "/v1/allocations",
            json={"gpu_type": "H100", "region": "us-east-1", "node_count": 1},
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
    assert refused.status_code == 409, refused.text
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    assert alloc["node_ids"] == [free]

    for node_id in leased:
        await temporal_env.client.get_workflow_handle(f"node-{node_id}").result()
    # The faulty node: its failed diag drained it into quarantine, no tenant ever held it.
    events = _events(h, bad)
    assert not any(e["event"] == "reserve" for e in events)
    diagnosed = [e for e in events if e["event"] == "diagnose"]
    assert diagnosed and "dcgmi: fail" in diagnosed[0]["cause"], diagnosed
    assert any(e["to_state"] == "quarantined" for e in events), [e["event"] for e in events]
    report = h.operator.get(f"/v1/nodes/{bad}/health").json()
    assert report["health"] == "failed"
    assert any(c["name"] == "diag_failure" for c in report["conditions"]), report["conditions"]

    # The healthy one: tested, its lease released, back in the pool for the next tenant.
    assert h.node(tested)["state"] == "available" and h.node(tested)["health"] == "ok"
    assert [e["cause"] for e in _events(h, tested) if e["event"] == "diagnose"] == [
        "dcgmi: pass; all_reduce_perf: pass; nvbandwidth: pass"
    ]
    assert _leased(db_url) == {}
    with session_scope(db_url) as session:
        node = session.get(Node, tested)
        assert node is not None and node.last_diag_at is not None and node.diag_lease is None
    second = await h.wait_allocation(key, h.allocate(key, node_count=1), "ready")
    assert second["node_ids"] == [tested]
