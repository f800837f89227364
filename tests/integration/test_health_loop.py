"""The health loop against the real stack: XIDs in, the right action out; a bad node pulled from
its allocation and replaced in the same fabric domain; the repair ladder with burn-in as the
gate; the lemon rule; the circuit breaker; a degraded allocation that waits for capacity."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx

from support.stack import async_wait_until

FAST = dict(latency_scale=0.02, health_drain_grace_s=0.5, replacement_recheck_s=0.5)


async def _ready_fleet(make_harness, in_process_worker, db_url, nodes: int, **settings):
    h = make_harness(db_url, nodes=nodes, **{**FAST, **settings})
    await in_process_worker(h.settings)
    h.enroll_fleet()
    await h.wait_states({"available": nodes}, timeout_s=90)
    return h


def _allocate(h, key: str, count: int) -> str:
    with h.client(key) as c:
        resp = c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": count, "region": "us-east-1"},
                      headers={"Idempotency-Key": str(uuid.uuid4())})
        assert resp.status_code == 202, resp.text
        return resp.json()["allocation"]["id"]


def _xid(h, node_id: str, xid: int) -> dict:
    resp = h.operator.post(f"/v1/nodes/{node_id}/xid", json={"xid": xid, "gpu_index": 3})
    assert resp.status_code == 200, resp.text
    return resp.json()["decisions"][0]


def _hardware_fault(h, node_id: str, fault: str | None, fixed_by: str | None = None) -> None:
    httpx.post(f"{h.sim.url}/v1/nodes/{node_id}/hardware_fault",
               json={"fault": fault, "fixed_by": fixed_by}).raise_for_status()


def _events(h, node_id: str) -> list[dict]:
    return h.operator.get(f"/v1/nodes/{node_id}/events", params={"page_size": 500}).json()["items"]


async def _repair_round(h, temporal_env, node_id: str) -> str:
    """One reconciler sweep; wait for the node's repair workflow to finish; the node's state."""
    await h.sweep(temporal_env.client)
    await temporal_env.client.get_workflow_handle(f"node-{node_id}").result()
    return h.node(node_id)["state"]


async def test_each_xid_class_leads_to_its_action_and_application_xids_never_drain(
        db_url, make_harness, in_process_worker):
    h = await _ready_fleet(make_harness, in_process_worker, db_url, nodes=8, breaker_max_pulled_share=1.0)
    ids = [n["id"] for n in h.nodes()]
    expected = {13: ("ok", "none", None), 63: ("suspect", "watch", None), 92: ("ok", "watch", None),
                999: ("suspect", "watch", None), 48: ("failed", "drain", "drain"),
                74: ("failed", "drain", "drain"), 79: ("failed", "drain_now", "drain")}
    for node_id, (xid, (health, action, pull)) in zip(ids, expected.items(), strict=False):
        decision = _xid(h, node_id, xid)
        assert (decision["health"], decision["action"], decision["pull"]) == (health, action, pull), xid
        report = h.operator.get(f"/v1/nodes/{node_id}/health").json()
        assert report["xid_history"][0]["xid"] == xid and report["health"] == health
    # Pulled idle nodes drain into quarantine (and from there into repair).
    pulled = [ids[4], ids[5], ids[6]]
    await async_wait_until(lambda: all(any(e["to_state"] == "quarantined" for e in _events(h, n)) for n in pulled),
                           timeout_s=60, what="pulled nodes quarantined")

    # 1,000 application XIDs from one workload: counted, never a drain.
    now = datetime.now(UTC)
    quiet = ids[7]
    events = [{"node_id": quiet, "gpu_index": i % 8, "xid": (13, 31, 43, 45, 68)[i % 5],
               "timestamp": (now - timedelta(seconds=i)).isoformat()} for i in range(1000)]
    result = h.operator.post("/v1/agents/events", json={"events": events}).json()
    assert result["accepted"] == 1000
    assert [d["pull"] for d in result["decisions"]] == [None]
    node = h.node(quiet)
    assert node["state"] == "available" and node["health"] == "ok" and not node["drain_requested"]
    assert not any(e["event"] == "drain" for e in _events(h, quiet))


async def test_fatal_xid_on_active_node_replaced_in_same_pod_and_kept_out_until_burn_in_passes(
        db_url, make_harness, in_process_worker, temporal_env):
    h = await _ready_fleet(make_harness, in_process_worker, db_url, nodes=6, breaker_max_pulled_share=1.0)
    tenant_id, key = h.new_tenant()
    alloc_id = _allocate(h, key, 2)
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    bad, kept = alloc["node_ids"]
    _hardware_fault(h, bad, "GPU 3 fell off the bus")  # no rung of the ladder fixes it

    decision = _xid(h, bad, 79)
    assert (decision["action"], decision["pull"]) == ("drain_now", "replace")

    def replaced():
        a = h.client(key).get(f"/v1/allocations/{alloc_id}").json()
        return a["status"] == "ready" and bad not in a["node_ids"] and len(a["node_ids"]) == 2 and a

    alloc = await async_wait_until(replaced, timeout_s=60, what="replacement attached")
    (new,) = set(alloc["node_ids"]) - {kept}
    nodes = {n["id"]: n for n in h.nodes()}
    assert nodes[new]["state"] == "active" and nodes[new]["allocation_id"] == alloc_id
    assert nodes[new]["pod"] == nodes[bad]["pod"] == alloc["fabric_domain"]
    assert h.sim.node(new)["tenant_id"] == tenant_id
    assert nodes[bad]["state"] == "quarantined" and nodes[bad]["allocation_id"] is None
    kinds = [e["kind"] for e in h.client(key).get(f"/v1/allocations/{alloc_id}/events").json()["items"]]
    assert kinds[0] == "degraded" and kinds[-2:] == ["replaced", "ready"]  # drain_now: no grace notice

    # The ladder: reset, reboot, reflash each fail burn-in; then the ladder is used up: RMA.
    states = [await _repair_round(h, temporal_env, bad) for _ in range(4)]
    assert states == ["quarantined", "quarantined", "quarantined", "rma"]
    after_xid = _events(h, bad)
    assert not any(e["to_state"] == "available" for e in after_xid[after_xid.index(
        next(e for e in after_xid if e["to_state"] == "draining")):])
    assert "ladder exhausted" in after_xid[-1]["cause"]


async def test_repaired_node_returns_only_through_a_passing_burn_in(
        db_url, make_harness, in_process_worker, temporal_env):
    h = await _ready_fleet(make_harness, in_process_worker, db_url, nodes=4)
    node_id = h.nodes()[0]["id"]
    _hardware_fault(h, node_id, "uncorrectable ECC", fixed_by="reboot")
    assert _xid(h, node_id, 48)["pull"] == "drain"
    await async_wait_until(lambda: h.node(node_id)["state"] == "quarantined", timeout_s=30, what="quarantined")
    assert await _repair_round(h, temporal_env, node_id) == "quarantined"  # reset: burn-in still fails
    assert await _repair_round(h, temporal_env, node_id) == "available"  # reboot fixed it
    node = h.node(node_id)
    assert node["health"] == "ok" and node["health_conditions"] == []
    tail = [(e["from_state"], e["to_state"]) for e in _events(h, node_id)][-3:]
    assert tail == [("quarantined", "repairing"), ("repairing", "burn_in"), ("burn_in", "available")]


async def test_lemon_node_goes_to_rma_without_another_reset(db_url, make_harness, in_process_worker, temporal_env):
    h = await _ready_fleet(make_harness, in_process_worker, db_url, nodes=4)
    node_id = h.nodes()[0]["id"]
    earlier = datetime.now(UTC) - timedelta(days=10)
    h.operator.post("/v1/agents/events", json={"events": [
        {"node_id": node_id, "gpu_index": 1, "xid": 119, "timestamp": earlier.isoformat()}]}).raise_for_status()
    decision = _xid(h, node_id, 79)
    assert (decision["action"], decision["pull"]) == ("rma", "drain")
    await async_wait_until(lambda: h.node(node_id)["state"] == "quarantined", timeout_s=30, what="quarantined")
    assert await _repair_round(h, temporal_env, node_id) == "rma"
    last = _events(h, node_id)[-1]
    assert (last["from_state"], last["to_state"]) == ("repairing", "rma") and "lemon" in last["cause"]


async def test_circuit_breaker_refuses_pulls_beyond_the_pool_share(db_url, make_harness, in_process_worker):
    h = await _ready_fleet(make_harness, in_process_worker, db_url, nodes=8)  # 5 % of 8: one pull an hour
    first, second = [n["id"] for n in h.nodes()[:2]]
    assert _xid(h, first, 79)["pull"] == "drain"
    refused = _xid(h, second, 79)
    assert refused["pull"] is None and "refused" in refused["alert"]
    alerts = h.operator.get("/v1/alerts").json()["items"]
    assert [(a["kind"], a["node_id"], a["pool"]) for a in alerts] == [("circuit_breaker", second, "H100/us-east-1")]
    node = h.node(second)
    assert node["health"] == "failed" and not node["drain_requested"] and node["state"] == "available"
    _, key = h.new_tenant()
    with h.client(key) as c:
        assert c.get("/v1/alerts").status_code == 403


async def test_no_capacity_degraded_until_capacity_frees(db_url, make_harness, in_process_worker):
    h = await _ready_fleet(make_harness, in_process_worker, db_url, nodes=3, breaker_max_pulled_share=1.0)
    _, key = h.new_tenant()
    _, other_key = h.new_tenant()
    alloc_id = _allocate(h, key, 2)
    other_id = _allocate(h, other_key, 1)
    alloc = await h.wait_allocation(key, alloc_id, "ready")
    await h.wait_allocation(other_key, other_id, "ready")
    bad = alloc["node_ids"][0]
    decision = _xid(h, bad, 48)  # double-bit ECC: drain after the grace period
    assert (decision["action"], decision["pull"]) == ("drain", "replace")

    degraded = await async_wait_until(
        lambda: (a := h.client(key).get(f"/v1/allocations/{alloc_id}").json())["status"] == "degraded"
        and "waiting for capacity" in (a["failure_reason"] or "") and a, timeout_s=30, what="degraded")
    assert bad not in degraded["node_ids"] and "xid_48" in degraded["failure_reason"]
    with h.client(other_key) as c:  # another tenant sees nothing of it
        assert c.get(f"/v1/allocations/{alloc_id}/events").status_code == 404

    with h.client(other_key) as c:
        c.post(f"/v1/allocations/{other_id}/cancel").raise_for_status()
    await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    kinds = [e["kind"] for e in h.client(key).get(f"/v1/allocations/{alloc_id}/events").json()["items"]]
    assert kinds == ["fault_notice", "degraded", "waiting_for_capacity", "replacement_started", "replaced", "ready"]
