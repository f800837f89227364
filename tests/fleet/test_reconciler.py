"""The fleet reconciler against the real stack: deadlines after downtime, unreachable agents,
drift, operator actions, backoff, and a converged fleet that costs nothing."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

import pytest

from gpucloud.db import read_scope
from gpucloud.models.tables import Node, utcnow
from support.stack import async_wait_until

pytestmark = pytest.mark.integration


async def test_converged_fleet_sweep_starts_nothing(ready_fleet, temporal_env):
    h = await ready_fleet(nodes=4)
    h.push_heartbeats()
    result = await h.sweep(temporal_env.client)
    assert (result.candidates, result.started, result.deadlines_applied) == (0, 0, 0)


async def test_deadlines_passed_while_worker_down_found_by_first_sweep(ready_fleet, in_process_worker, temporal_env):
    # Deadlines x 0.002: provisioning 3.6 s, wiping 7.2 s, burn-in 29 s; provision takes ~2 s.
    h = await ready_fleet(nodes=2, latency_scale=5.0, reconciler__deadline_scale=0.002)
    worker = h.worker
    _, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=2)
    await async_wait_until(lambda: any(n["state"] == "provisioning" for n in h.nodes()), what="provisioning")
    await worker.__aexit__(None, None, None)  # the worker goes down mid-provisioning
    await asyncio.sleep(4.5)  # ... long enough for the provisioning deadline to pass
    assert any(n["state"] == "provisioning" for n in h.nodes())
    # The provisions the restarted worker resumes must not finish before the first sweep runs.
    for node in h.nodes():
        h.sim.set_unreachable(node["id"], True)
    await in_process_worker(h.settings)
    result = await h.sweep(temporal_env.client)
    for node in h.nodes():
        h.sim.set_unreachable(node["id"], False)
    assert result.deadlines_applied >= 1
    events = h.operator.get(f"/v1/nodes/{h.nodes()[0]['id']}/events").json()["items"]
    assert any(e["event"] == "deadline" and e["actor"] == "reconciler" for e in events) or any(
        e["event"] == "deadline"
        for n in h.nodes()
        for e in h.operator.get(f"/v1/nodes/{n['id']}/events").json()["items"]
    )
    # The overdue nodes went to provisioning's failure target (wiping) and back through burn-in.
    await h.wait_states({"available": 2}, timeout_s=90)
    failed = await h.wait_allocation(key, alloc_id, "failed", timeout_s=60)
    assert failed["failure_reason"]


@pytest.mark.one_database  # the database only underneath: on SQLite
async def test_agent_unreachable_then_back(ready_fleet, temporal_env):
    # The others' heartbeats must still be fresh when the sweep reads them: 4 s leaves room for a
    # loaded machine between the push and the sweep's read.
    h = await ready_fleet(nodes=4, agent__heartbeat_timeout_s=4.0)
    lost = h.nodes()[0]["id"]
    h.push_heartbeats()
    h.sim.set_unreachable(lost, True)
    await asyncio.sleep(4.3)
    h.push_heartbeats()  # everyone but the lost agent reports
    result = await h.sweep(temporal_env.client)
    assert result.marked_unreachable == 1
    node = h.node(lost)
    assert node["health"] == "suspect" and not node["agent_reachable"]
    assert [c["name"] for c in node["health_conditions"]] == ["AgentUnreachable"]
    assert h.operator.get("/v1/fleet/summary").json()["agent_unreachable"] == 1

    h.sim.set_unreachable(lost, False)
    h.push_heartbeats()
    result = await h.sweep(temporal_env.client)
    assert result.marked_reachable == 1
    node = h.node(lost)
    assert node["health"] == "ok" and node["agent_reachable"] and node["health_conditions"] == []


@pytest.mark.one_database  # the database only underneath: on SQLite
async def test_drift_active_node_wiped_behind_our_back_is_restored(ready_fleet):
    h = await ready_fleet(nodes=2)
    tenant_id, key = await h.onboard()
    alloc_id = h.allocate(key, node_count=1)
    ready = await h.wait_allocation(key, alloc_id, "ready")
    node_id = ready["node_ids"][0]
    h.sim.drift(node_id, "wipe")
    assert h.sim.node(node_id)["tenant_id"] is None
    assert h.push_heartbeats()["drifted"] == [node_id]  # the API reconciles the node at once
    await async_wait_until(lambda: h.sim.node(node_id)["tenant_id"] == tenant_id, what="workload restored")
    assert h.push_heartbeats()["drifted"] == []
    node = h.node(node_id)
    assert node["state"] == "active" and node["allocation_id"] == alloc_id


@pytest.mark.one_database  # the database only underneath: on SQLite
async def test_cancel_while_provisioning(ready_fleet):
    h = await ready_fleet(nodes=2, latency_scale=3.0)
    _, key = await h.onboard()
    with h.client(key) as c:
        created = c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"}).json()
        alloc_id = created["allocation"]["id"]
        await async_wait_until(lambda: any(n["state"] == "provisioning" for n in h.nodes()), what="provisioning")
        cancel = c.post(f"/v1/allocations/{alloc_id}/cancel")
        assert cancel.status_code == 202 and cancel.json()["allocation"]["status"] == "cancelling"
        await h.wait_allocation(key, alloc_id, "released", timeout_s=60)
        assert c.get(f"/v1/operations/{created['operation']['id']}").json()["status"] == "failed"
    await h.wait_states({"available": 2}, timeout_s=60)


@pytest.mark.one_database  # the database only underneath: on SQLite
async def test_operator_actions_are_recorded_and_drain_is_carried_out(ready_fleet):
    h = await ready_fleet(nodes=2)
    a, b = [n["id"] for n in h.nodes()]
    with h.operator as op:
        r = op.post(f"/v1/nodes/{a}/cordon", json={"reason": "suspicious fan"})
        assert r.status_code == 200 and r.json()["node"]["cordoned"] and r.json()["operation"]["status"] == "succeeded"
        assert op.post(f"/v1/nodes/{a}/maintenance", json={"enabled": True}).json()["node"]["maintenance"]
        # A cordoned node is never placed.
        _, key = await h.onboard()
        with h.client(key) as c:
            assert (
                c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"}).status_code
                == 409
            )
        assert op.post(f"/v1/nodes/{a}/maintenance", json={"enabled": False}).status_code == 200
        assert not op.post(f"/v1/nodes/{a}/uncordon").json()["node"]["cordoned"]

        drain = op.post(f"/v1/nodes/{b}/drain", json={"reason": "operator test"})
        assert drain.status_code == 202 and drain.json()["operation"]["status"] == "running"
        await h.wait_states({"quarantined": 1, "available": 1}, timeout_s=60)
        assert op.get(f"/v1/operations/{drain.json()['operation']['id']}").json()["status"] == "succeeded"
        assert h.node(b)["state"] == "quarantined" and not h.node(b)["drain_requested"]

        events = op.get(f"/v1/nodes/{a}/events").json()["items"]
        assert [e["event"] for e in events][-4:] == ["cordon", "maintenance_on", "maintenance_off", "uncordon"]
        assert events[-4]["actor"] == "operator:bootstrap" and events[-4]["cause"] == "suspicious fan"
        drained = [(e["from_state"], e["to_state"]) for e in op.get(f"/v1/nodes/{b}/events").json()["items"]]
        assert drained[-2:] == [("available", "draining"), ("draining", "quarantined")]
        moves = [e["to_state"] for e in events if e["from_state"] != e["to_state"]]
        assert moves[:4] == ["inspecting", "wiping", "burn_in", "available"]
        summary = op.get("/v1/fleet/summary").json()
        assert summary["by_state"] == {"available": 1, "quarantined": 1} and summary["total"] == 2
        assert op.post("/v1/nodes/nope/cordon").status_code == 404


def _backoff_of(db_url: str, node_id: str) -> tuple[int, datetime | None, datetime]:
    """The node's reconcile attempts so far, the time before which the reconciler leaves it, and
    when its record last changed (a give-back's own time)."""
    with read_scope(db_url) as session:
        node = session.get(Node, node_id)
        assert node is not None
        return node.reconcile_attempts, node.next_reconcile_at, node.updated_at


async def test_backoff_grows_instead_of_looping(db_url, make_harness, in_process_worker, temporal_env):
    # Inspect never answers (transient 503s): the bring-up batch gives the node back after its
    # one try (agent__batch_attempts=1) with a backoff that doubles (2, 4, 8 s, then 10 s, the cap), and the
    # reconciler, sweeping as fast as it can, must leave the node alone until it has passed, not
    # start it again in a loop. Each backoff is read from the node's record (from the give-back to
    # the time before which the node is left alone), not from gaps between starts, which a
    # stalled sweep or a slow batch on a loaded machine stretches.
    h = make_harness(
        db_url, nodes=1, reconciler={"backoff_base_s": 2.0, "backoff_cap_s": 10}, agent={"batch_attempts": 1}
    )
    await in_process_worker(h.settings)
    node_id = h.sim.inventory()[0]["id"]
    h.sim.inject(node_id, "inspect", "transient", count=1000)
    h.enroll_fleet()
    starts: list[tuple[datetime, datetime]] = []  # when each sweep that started the node began, ended
    give_backs: list[tuple[int, float, datetime]] = []  # (attempts, backoff set, left alone until)
    sweeps_between: list[int] = []
    sweeps = 0
    attempts = _backoff_of(h.settings.database_url, node_id)[0]
    started = time.monotonic()
    while len(give_backs) < 4 and time.monotonic() - started < 90:
        began = utcnow()
        result = await h.sweep(temporal_env.client)
        swept_at = utcnow()
        sweeps += 1
        if result.started:
            assert result.bringup_batches == 1
            starts.append((began, swept_at))
            sweeps_between.append(sweeps)
            sweeps = 0
        await asyncio.sleep(0.05)
        now_attempts, until, given_back_at = _backoff_of(h.settings.database_url, node_id)
        if now_attempts != attempts:
            assert until is not None
            give_backs.append((now_attempts, (until - given_back_at).total_seconds(), until))
            attempts = now_attempts
    # Each give-back counted one more attempt and set a backoff twice the one before, up to the
    # cap: the fourth would be 16 s and is 10 s.
    backoffs = [(count, round(backoff, 3)) for count, backoff, _ in give_backs]
    assert backoffs == [(1, 2.0), (2, 4.0), (3, 8.0), (4, 10.0)], (starts, give_backs)
    # No sweep started the node before the backoff that the give-back before it set (the node is
    # held by its batch until given back): a loop would start it again at the first sweep after
    # the give-back. The first batch may come from the enrolment, before any sweep's start. A
    # sweep answers to the give-backs made before it began: the batch it starts may fail and be
    # given back before the sweep's own answer reaches the test.
    checked = 0
    for began, swept_at in starts:
        before = [until for _, backoff, until in give_backs if until - timedelta(seconds=backoff) <= began]
        if before:
            assert swept_at >= before[-1], (starts, give_backs, sweeps_between)
            checked += 1
    assert checked >= 3, (starts, give_backs)
    assert h.node(node_id)["state"] == "inspecting"
