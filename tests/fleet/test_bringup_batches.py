"""Bring-up in batches: the same per-node state machine and CAS as a per-node workflow, one
activity per step for many nodes, a hold that keeps the reconciler off, and a silent agent
handed back to the reconciler instead of holding up its batch."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import timedelta

import pytest
from sqlmodel import select

from gpucloud.activities.control_db import ControlDbActivities
from gpucloud.db import Database, migrate, session_scope
from gpucloud.models.messages import NodeTransitionBatch, NodeTransitionInput
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodeEnroll, NodeTransition, utcnow
from gpucloud.services import nodes as node_service
from support.stack import async_wait_until

pytestmark = pytest.mark.integration


def _enroll(db_url: str, n: int) -> list[str]:
    migrate(db_url)
    specs = [
        NodeEnroll(
            id=f"b{i:03d}",
            hostname=f"b{i:03d}",
            agent_url=f"http://127.0.0.1:1/agents/b{i:03d}",
            gpu_type="H100",
            gpu_count=8,
            region="us-east-1",
            pod="pod-a",
            rack="r1",
        )
        for i in range(n)
    ]
    with session_scope(db_url) as session:
        new, _ = node_service.enroll_nodes(session, specs)
    return new


async def test_batches_bring_the_fleet_up_and_leave_failures_where_they_belong(
    db_url, make_harness, in_process_worker, temporal_env
):
    h = make_harness(
        db_url,
        nodes=10,
        reconciler__bringup_batch_size=4,
        agent__batch_attempts=2,
        agent__batch_retry_base_s=0.05,
        reconciler__backoff_base_s=0.2,
    )
    await in_process_worker(h.settings)
    ids = h.node_ids()
    refused, silent = ids[0], ids[5]
    h.sim.inject(refused, "inspect", "permanent")
    h.sim.inject(silent, "burn_in", "transient", count=2)  # gives up after 2 tries, then heals

    resp = h.operator.post("/v1/nodes:enroll", json={"nodes": h.sim.inventory()})
    assert resp.json() == {"enrolled": 10, "already_known": 0, "bringups_started": 10, "batches": 3, "deferred": 0}
    # The refused node fails into its failure target; the silent one is handed back and the
    # reconciler's sweep brings it up on a later try.
    want = {"available": 9, "quarantined": 1}
    deadline = time.monotonic() + 60
    while _states(h) != want:
        assert time.monotonic() < deadline, _states(h)
        await h.sweep(temporal_env.client)
        await asyncio.sleep(0.2)

    assert h.node(refused)["state"] == "quarantined"
    causes = [e["cause"] for e in h.operator.get(f"/v1/nodes/{refused}/events").json()["items"]]
    assert any("inspect failed" in c for c in causes), causes
    silent_events = h.operator.get(f"/v1/nodes/{silent}/events").json()["items"]
    moves = [e["to_state"] for e in silent_events if e["from_state"] != e["to_state"]]  # not the wipe's steps
    assert moves == ["inspecting", "wiping", "burn_in", "available"]
    assert {"gpu_reset", "disk_sanitized", "scratch_removed"} <= {e["event"] for e in silent_events}
    # Its batch handed it back mid burn-in; the reconciler finished it with a per-node recycle.
    results = [
        await temporal_env.client.get_workflow_handle(w.id).result()
        async for w in temporal_env.client.list_workflows(
            f"WorkflowType = 'BringupBatchWorkflow' AND TaskQueue = '{h.settings.temporal.task_queue}'"
        )
    ]
    assert len(results) == 3
    assert sum(silent in r["stopped"] for r in results) == 1 and not any(silent in r["available"] for r in results)
    assert sorted(i for r in results for i in r["available"]) == sorted(set(ids) - {refused, silent})
    recycle = await temporal_env.client.get_workflow_handle(f"node-{silent}").result()
    assert recycle["ok"] and recycle["state"] == "available"

    def no_holds_left() -> bool:  # the last batch's release of its holds may trail its result
        with session_scope(db_url) as session:
            return all(n.next_reconcile_at is None for n in session.exec(select(Node)).all() if n.state == "available")

    # 45 s: with the whole suite on two cores the last release has trailed its result by over 15 s.
    await async_wait_until(no_holds_left, timeout_s=45, interval_s=0.2, what="every hold released")


def _held(h) -> int:
    with session_scope(h.settings.database_url) as session:
        return node_service.held_for_bringup(session)


def _states(h) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in h.nodes():
        counts[n["state"]] = counts.get(n["state"], 0) + 1
    return counts


def test_transition_batch_is_idempotent_and_one_stale_node_stops_only_itself(db_url):
    ids = _enroll(db_url, 3)
    acts = ControlDbActivities(Database(db_url))
    with session_scope(db_url) as session:
        # Someone else moves the second node first.
        node_service.transition(session, ids[1], "inspect", from_state="enrolled", actor="other")
    batch = NodeTransitionBatch(
        lease_to_deadline=True,
        items=[NodeTransitionInput(node_id=i, event="inspect", from_state="enrolled", op_id=f"op/{i}") for i in ids],
    )
    first = acts.transition_nodes(batch)
    assert [(o.node_id, o.state) for o in first.outcomes] == [
        (ids[0], "inspecting"),
        (ids[1], None),
        (ids[2], "inspecting"),
    ]
    assert "expected 'enrolled'" in first.outcomes[1].error
    # A retry of the same activity (its first try committed) changes nothing and succeeds.
    again = acts.transition_nodes(batch)
    assert [o.state for o in again.outcomes] == ["inspecting", None, "inspecting"]
    with session_scope(db_url) as session:
        rows = session.exec(select(NodeTransition).where(NodeTransition.node_id.in_(ids))).all()
        assert len(rows) == 3  # one each, none twice
        held = session.get(Node, ids[0])
        # The batch holds its nodes until the state's deadline.
        assert held.next_reconcile_at == held.deadline_at and held.deadline_at > utcnow()
        assert session.get(Node, ids[1]).next_reconcile_at is None


def test_hold_goes_to_one_of_two_racing_starters_and_release_backs_off(db_url):
    ids = _enroll(db_url, 50)
    barrier = threading.Barrier(2)
    won: list[list[str]] = []

    def race() -> None:
        barrier.wait()
        with session_scope(db_url) as session:
            won.append(node_service.lease_for_bringup(session, list(ids)))

    threads = [threading.Thread(target=race) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(len(w) for w in won) == [0, 50]
    with session_scope(db_url) as session:
        assert node_service.held_for_bringup(session) == 50
        assert node_service.lease_for_bringup(session, ids[:5]) == []  # held: nobody else gets them
        now = utcnow()
        node_service.release_bringup_holds(session, ids[:1], base_s=1.0, cap_s=8.0, now=now)
    delays = []
    for _ in range(5):
        with session_scope(db_url) as session:
            node = session.get(Node, ids[0])
            delays.append(node.next_reconcile_at - now)
            node_service.release_bringup_holds(session, ids[:1], base_s=1.0, cap_s=8.0, now=now)
    assert delays == [timedelta(seconds=s) for s in (1, 2, 4, 8, 8)]
    with session_scope(db_url) as session:
        assert session.get(Node, ids[0]).state == NodeState.ENROLLED
        # Released with a backoff still in the future: still not free for another batch.
        assert node_service.lease_for_bringup(session, ids[:1], now=now) == []


async def test_enrollment_starts_bring_ups_within_the_global_limit_and_the_sweep_starts_the_rest(
    db_url, make_harness, in_process_worker, temporal_env
):
    """Enrolment counts against `max_concurrent_node_ops` as the sweep does: with room for 3,
    enrolling 8 nodes starts 3 bring-ups and defers 5; sweeps start the rest as room frees up, and
    never more than 3 at once are held."""
    h = make_harness(db_url, nodes=8, reconciler__max_concurrent_node_ops=3, reconciler__bringup_batch_size=2)
    resp = h.operator.post("/v1/nodes:enroll", json={"nodes": h.sim.inventory()})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (body["enrolled"], body["bringups_started"], body["deferred"]) == (8, 3, 5)
    with session_scope(h.settings.database_url) as session:
        assert node_service.held_for_bringup(session) == 3
    # A second enrolment while the three are held starts nothing more.
    again = h.operator.post("/v1/nodes:enroll", json={"nodes": h.sim.inventory()}).json()
    assert (again["bringups_started"], again["deferred"]) == (0, 8)

    await in_process_worker(h.settings)
    deadline = time.monotonic() + 90
    most_held = 0
    while _states(h).get("available", 0) < 8:
        assert time.monotonic() < deadline, _states(h)
        result = await h.sweep(temporal_env.client)
        with session_scope(h.settings.database_url) as session:
            most_held = max(most_held, node_service.held_for_bringup(session))
        assert result.started <= 3
        await asyncio.sleep(0.3)
    assert most_held <= 3


async def test_a_finished_batch_hands_its_room_to_waiting_enrollments_without_a_sweep(
    db_url, make_harness, in_process_worker, temporal_env
):
    """With room for 3, an enrolment of 8 defers 5; no sweep runs here, yet all 8 come up: each
    batch, once done, starts bring-ups for waiting nodes in its room, never more than 3 held."""
    h = make_harness(db_url, nodes=8, reconciler__max_concurrent_node_ops=3, reconciler__bringup_batch_size=2)
    body = h.operator.post("/v1/nodes:enroll", json={"nodes": h.sim.inventory()}).json()
    assert (body["bringups_started"], body["deferred"]) == (3, 5)
    most_held = 0
    watching = True

    async def watch() -> None:
        nonlocal most_held
        while watching:
            most_held = max(most_held, await asyncio.to_thread(_held, h))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    await in_process_worker(h.settings)
    try:
        await async_wait_until(lambda: _states(h).get("available", 0) == 8, timeout_s=90, what="all 8 available")
    finally:
        watching = False
        await watcher
    assert most_held <= 3


async def test_another_control_planes_node_operations_do_not_count_against_this_ones_limit(
    db_url, make_harness, temporal_env
):
    """The limit counts this control plane's node operations (its task queue): five running on
    another plane's queue in the same namespace leave all the room here."""
    from gpucloud.adapters.temporal_gateway import RUNNING_NODE_OPS

    client = temporal_env.client
    other = f"other-plane-{uuid.uuid4().hex[:8]}"
    handles = [
        await client.start_workflow("NodeOperationWorkflow", id=f"{other}-{i}", task_queue=other) for i in range(5)
    ]
    try:
        query = f"{RUNNING_NODE_OPS} AND TaskQueue = '{other}'"
        deadline = time.monotonic() + 30
        while (await client.count_workflows(query)).count < 5:
            assert time.monotonic() < deadline, "the other plane's 5 operations never showed as running"
            await asyncio.sleep(0.2)
        h = make_harness(db_url, nodes=8, reconciler__max_concurrent_node_ops=3, reconciler__bringup_batch_size=2)
        body = h.operator.post("/v1/nodes:enroll", json={"nodes": h.sim.inventory()}).json()
        assert (body["bringups_started"], body["deferred"]) == (3, 5)
    finally:
        for handle in handles:
            await handle.terminate("test over")
