"""Issue 43: the pools' queues in the database (SQLite, and Postgres when reachable).

A create that finds no room either fails at once (`capacity.wait = fail`, the default) or waits
in its pool's queue (`queue`); a plan of the pool (`services/scheduling.plan_pool`) places queued
requests as whole gangs in one fabric domain when one has room, in fair-share order, expires
those past their `max_wait_s`, and ranks the rest. A create can neither jump the queue nor take
the nodes its head is waiting for."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlmodel import col, select

from gpucloud.config import SchedulerSettings
from gpucloud.db import Database, session_scope
from gpucloud.models.api_schemas import AllocationRequest
from gpucloud.models.health_tables import AllocationEvent
from gpucloud.models.scheduling_tables import TenantPoolShare
from gpucloud.models.tables import (
    Allocation,
    AllocationStatus,
    Node,
    Operation,
    utcnow,
)
from gpucloud.services import allocations as alloc_service
from gpucloud.services import scheduling
from gpucloud.services.allocation_requests import reserve_and_record
from gpucloud.services.errors import Conflict, DomainError
from support.pools import seed_pool

pytestmark = pytest.mark.integration

SETTINGS = SchedulerSettings()


def _fleet(db_url: str, *, pods: int = 2, per_pod: int = 4, tenants: int = 2) -> None:
    seed_pool(db_url, pods=pods, per_pod=per_pod, tenants=tenants, max_gpus=8192)


def _create(db: Database, tenant: str, nodes: int, **fields) -> Allocation:
    req = AllocationRequest(gpu_type="H100", region="r1", node_count=nodes, **fields)
    alloc, _ = reserve_and_record(db, tenant, req, actor=f"tenant:{tenant}", deadline_scale=1.0, scheduler=SETTINGS)
    return alloc


def _queue(db: Database, tenant: str, nodes: int, **fields) -> Allocation:
    return _create(db, tenant, nodes, capacity={"wait": "queue", **fields.pop("capacity", {})}, **fields)


def _release(db_url: str, alloc_id: str) -> None:
    """The allocation ended and its nodes are back in the pool (what release, wipe and burn-in do)."""
    with session_scope(db_url) as session:
        alloc = session.exec(select(Allocation).where(col(Allocation.id) == alloc_id)).one()
        alloc.status = AllocationStatus.RELEASED
        session.add(alloc)
        for node in session.exec(select(Node).where(col(Node.allocation_id) == alloc_id)).all():
            node.state, node.allocation_id = "available", None
            session.add(node)


def _row(db_url: str, alloc_id: str) -> Allocation:
    with session_scope(db_url) as session:
        return session.exec(select(Allocation).where(col(Allocation.id) == alloc_id)).one()


def _kinds(session, alloc_id: str) -> list[str]:
    return [e.kind for e in session.exec(select(AllocationEvent).where(col(AllocationEvent.allocation_id) == alloc_id))]


def _plan(db: Database, **kw) -> scheduling.PoolPlan:
    return scheduling.plan_pool(db, "H100", "r1", settings=SETTINGS, deadline_scale=1.0, **kw)


def test_no_room_fails_by_default_and_queues_when_asked(db_url):
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    first = _create(db, "ten_0", 3)
    with pytest.raises(DomainError) as refused:
        _create(db, "ten_1", 2)
    assert isinstance(refused.value, Conflict) and "capacity.wait = 'queue'" in refused.value.detail

    queued = _queue(db, "ten_1", 2, capacity={"max_wait_s": 3600})
    row = _row(db_url, queued.id)
    assert (row.status, row.node_ids, row.queue_position, row.max_wait_s) == ("queued", [], 1, 3600)
    with session_scope(db_url) as session:
        kinds = _kinds(session, row.id)
        op = session.exec(select(Operation).where(col(Operation.resource_id) == row.id)).one()
        held = session.exec(select(Node).where(col(Node.allocation_id) == row.id)).all()
    assert kinds == ["requested", "queued"] and op.status == "running" and held == []

    assert _plan(db).placed == []  # still no room: it stays queued
    _release(db_url, first.id)
    plan = _plan(db)
    assert plan.placed == [queued.id] and plan.queued == 0
    row = _row(db_url, queued.id)
    assert row.status == "provisioning" and len(row.node_ids) == 2 and row.placed_at is not None
    assert row.queue_position is None
    with session_scope(db_url) as session:
        nodes = session.exec(select(Node).where(col(Node.id).in_(row.node_ids))).all()
        kinds = _kinds(session, row.id)
    assert {(n.state, n.allocation_id) for n in nodes} == {("reserved", queued.id)}
    assert kinds[-1] == "placed"


def test_a_queued_gang_is_placed_whole_in_one_fabric_domain(db_url):
    _fleet(db_url, pods=2, per_pod=4)
    db = Database(db_url)
    left = _create(db, "ten_0", 2)  # two nodes of pod0 (the tightest fit)
    right = _create(db, "ten_0", 3)  # three of pod1: pod0 has only two left
    assert (_row(db_url, left.id).fabric_domain, _row(db_url, right.id).fabric_domain) == ("pod0", "pod1")
    gang = _queue(db, "ten_1", 3)  # three nodes are free, but no pod has three
    assert _row(db_url, gang.id).status == "queued"
    assert _plan(db).placed == []
    _release(db_url, left.id)
    assert _plan(db).placed == [gang.id]
    row = _row(db_url, gang.id)
    with session_scope(db_url) as session:
        pods_of = {n.pod for n in session.exec(select(Node).where(col(Node.id).in_(row.node_ids)))}
    assert len(row.node_ids) == 3 and pods_of == {row.fabric_domain} == {"pod0"}


def test_a_request_waits_no_longer_than_its_max_wait(db_url):
    _fleet(db_url, pods=1, per_pod=2)
    db = Database(db_url)
    _create(db, "ten_0", 2)
    patient = _queue(db, "ten_1", 1)
    hasty = _queue(db, "ten_1", 1, capacity={"max_wait_s": 60})
    assert _plan(db).expired == []  # not yet
    plan = _plan(db, now=utcnow() + timedelta(seconds=61))
    assert plan.expired == [hasty.id] and plan.queued == 1
    row = _row(db_url, hasty.id)
    assert row.status == "failed" and "max_wait_s=60" in (row.failure_reason or "")
    with session_scope(db_url) as session:
        op = session.exec(select(Operation).where(col(Operation.resource_id) == hasty.id)).one()
    assert op.status == "failed"
    assert _row(db_url, patient.id).status == "queued"


def test_an_expiry_loses_to_a_cancel_made_while_the_plan_decided(db_url, monkeypatch):
    """The plan read the request queued and found it past its max_wait_s; the tenant cancelled
    it before the plan wrote: it stays `cancelling` (the tenant's intent), never `failed`."""
    if db_url.startswith("sqlite"):
        pytest.skip("SQLite's transactions take the write lock at BEGIN: no cancel can write in between")
    _fleet(db_url, pods=1, per_pod=2)
    db = Database(db_url)
    _create(db, "ten_0", 2)
    hasty = _queue(db, "ten_1", 1, capacity={"max_wait_s": 60})
    decide = scheduling.policy.decide

    def decide_then_cancelled(state):
        decision = decide(state)
        with session_scope(db_url) as other:  # the tenant's cancel, in a transaction of its own
            row = other.exec(select(Allocation).where(col(Allocation.id) == hasty.id)).one()
            alloc_service.record_cancel_intent(other, row, tenant_id="ten_1", actor="tenant:ten_1")
        return decision

    monkeypatch.setattr(scheduling.policy, "decide", decide_then_cancelled)
    plan = _plan(db, now=utcnow() + timedelta(seconds=61))
    assert plan.expired == []
    row = _row(db_url, hasty.id)
    assert (row.status, row.failure_reason) == ("cancelling", None)


def test_a_tenant_that_floods_the_queue_does_not_stand_in_front_of_another(db_url):
    _fleet(db_url, pods=2, per_pod=4)
    db = Database(db_url)
    blockers = [_create(db, "ten_0", 4), _create(db, "ten_0", 4)]
    flood = [_queue(db, "ten_0", 4) for _ in range(4)]
    assert [_row(db_url, a.id).queue_position for a in flood] == [1, 2, 3, 4]
    late = _queue(db, "ten_1", 4)  # queued last, but ten_0 already holds the whole pool
    assert _row(db_url, late.id).queue_position == 1
    assert _plan(db).placed == []
    assert [_row(db_url, a.id).queue_position for a in [late, *flood]] == [1, 2, 3, 4, 5]
    # The queue as listed is in that order, and a short page is its head, not the first created.
    with session_scope(db_url) as session:
        assert [a.id for a in scheduling.queue_of(session, "H100", "r1")] == [a.id for a in [late, *flood]]
        assert [a.id for a in scheduling.queue_of(session, limit=2)] == [late.id, flood[0].id]
    for blocker in blockers:
        _release(db_url, blocker.id)
    plan = _plan(db)
    # Two pods free: the other tenant's request is placed with the flood's first, not after it all.
    assert late.id in plan.placed and len(plan.placed) == 2


def test_a_tenants_share_weighs_its_usage(db_url):
    _fleet(db_url, pods=1, per_pod=4, tenants=2)
    db = Database(db_url)
    with session_scope(db_url) as session:
        session.add(TenantPoolShare(tenant_id="ten_0", gpu_type="H100", region="r1", weight=9.0))
    held = _create(db, "ten_0", 4)
    _release(db_url, held.id)
    blocker = _create(db, "ten_1", 4)
    with session_scope(db_url) as session:  # each tenant has held the whole pool for an hour
        for alloc_id in (held.id, blocker.id):
            row = session.exec(select(Allocation).where(col(Allocation.id) == alloc_id)).one()
            row.placed_at = utcnow() - timedelta(hours=1)
            session.add(row)
    first = _queue(db, "ten_1", 4)
    second = _queue(db, "ten_0", 4)
    _plan(db)
    # Equal usage, but ten_0's weight is nine times ten_1's: ten_0 goes first, though queued later.
    assert _row(db_url, second.id).queue_position == 1 and _row(db_url, first.id).queue_position == 2
    _release(db_url, blocker.id)
    assert _plan(db).placed == [second.id]


def test_a_create_cannot_take_the_nodes_the_head_of_the_queue_waits_for(db_url):
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    _create(db, "ten_0", 1)  # runs with no known end
    head = _queue(db, "ten_1", 4)
    assert _row(db_url, head.id).queue_position == 1
    # Three nodes are free; without the queue this create would have taken them.
    with pytest.raises(DomainError) as refused:
        _create(db, "ten_0", 3)
    assert isinstance(refused.value, Conflict) and "1 request(s) are queued" in refused.value.detail
    behind = _queue(db, "ten_0", 3)
    assert _row(db_url, behind.id).status == "queued" and _row(db_url, behind.id).queue_position == 2


def test_the_head_the_last_plan_promised_a_start_keeps_its_place_in_the_next(db_url):
    """The next plan reads the last one's head from the rows (position 1, a start promised), so
    fair-share order moving with usage cannot hand its reservation to another request."""
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    _create(db, "ten_0", 1, expected_duration_s=3600)
    head = _queue(db, "ten_1", 4)
    spare = _queue(db, "ten_1", 4, tier="preemptible")
    with session_scope(db_url) as session:
        state, _ = scheduling.pool_state(session, "H100", "r1", now=utcnow(), settings=SETTINGS)
    assert _row(db_url, head.id).estimated_start_at is not None and state.heads == (head.id,)
    assert spare.id not in state.heads


def test_a_short_request_backfills_ahead_of_the_head_when_it_ends_in_time(db_url):
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    _create(db, "ten_0", 1, expected_duration_s=3600)  # frees in an hour
    head = _queue(db, "ten_1", 4)
    assert _row(db_url, head.id).estimated_start_at is not None
    short = _create(db, "ten_0", 3, expected_duration_s=600)  # ends before the head can start
    assert _row(db_url, short.id).status == "provisioning"
    with pytest.raises(DomainError):
        _create(db, "ten_0", 1, expected_duration_s=7200)  # would delay the head


def test_concurrent_plans_and_creates_never_put_one_node_in_two_allocations(db_url):
    _fleet(db_url, pods=2, per_pod=4, tenants=2)
    db = Database(db_url)
    blockers = [_create(db, "ten_0", 4), _create(db, "ten_0", 4)]
    queued = [_queue(db, f"ten_{i % 2}", 1 + i % 3) for i in range(8)]
    for blocker in blockers:
        _release(db_url, blocker.id)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            if i % 2:
                _plan(db)
            else:
                _queue(db, "ten_1", 2)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    _plan(db)
    with session_scope(db_url) as session:
        allocs = session.exec(select(Allocation).where(col(Allocation.status) == "provisioning")).all()
        nodes = session.exec(select(Node)).all()
    members = [n for a in allocs for n in a.node_ids]
    assert len(members) == len(set(members)) and len(members) > 0
    by_node = {n.id: n for n in nodes}
    for a in allocs:
        assert {by_node[n].allocation_id for n in a.node_ids} == {a.id}
        assert len({by_node[n].pod for n in a.node_ids}) == 1
    assert any(_row(db_url, q.id).status == "provisioning" for q in queued)


def test_an_on_demand_request_takes_preemptible_capacity_back_with_notice_and_waits_for_it(db_url):
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    spare = _create(db, "ten_0", 3, tier="preemptible")
    assert _row(db_url, spare.id).status == "provisioning" and _row(db_url, spare.id).tier == "preemptible"
    with session_scope(db_url) as session:  # it runs
        row = session.exec(select(Allocation).where(col(Allocation.id) == spare.id)).one()
        row.status = AllocationStatus.READY
        session.add(row)

    # A preemptible request never takes back anything: with no room it fails (or queues).
    with pytest.raises(DomainError):
        _create(db, "ten_1", 2, tier="preemptible")
    # An on-demand one (the default `fail`) is accepted: it waits for the nodes it takes back.
    urgent = _create(db, "ten_1", 4)
    row = _row(db_url, urgent.id)
    assert row.status == "queued" and row.node_ids == []
    victim = _row(db_url, spare.id)
    assert victim.preempted_at is not None and victim.preempted_for == urgent.id
    with session_scope(db_url) as session:
        notices = _kinds(session, spare.id)
        reasons = [e.reason for e in session.exec(select(AllocationEvent).where(col(AllocationEvent.kind) == "queued"))]
    assert notices[-1] == "preemption_notice" and "taking back 1 preemptible" in reasons[-1]

    plan = _plan(db)
    # Told again until its workflow begins the release; nothing else is preempted meanwhile.
    assert [n.allocation_id for n in plan.notices] == [spare.id] and plan.placed == [] and plan.queued == 1
    _release(db_url, spare.id)
    with session_scope(db_url) as session:  # its nodes are being wiped: still not the request's
        for node in session.exec(select(Node).where(col(Node.id).in_(victim.node_ids))).all():
            node.state = "wiping"
            session.add(node)
    plan = _plan(db)
    assert plan.placed == [] and plan.notices == [] and _row(db_url, urgent.id).status == "queued"
    with session_scope(db_url) as session:
        for node in session.exec(select(Node).where(col(Node.id).in_(victim.node_ids))).all():
            node.state = "available"
            session.add(node)
    assert _plan(db).placed == [urgent.id]
    assert len(_row(db_url, urgent.id).node_ids) == 4


def test_a_preemptible_request_waits_behind_on_demand_ones_and_is_never_the_head(db_url):
    _fleet(db_url, pods=1, per_pod=4)
    db = Database(db_url)
    blocker = _create(db, "ten_0", 4)
    spare = _queue(db, "ten_1", 1, tier="preemptible")
    urgent = _queue(db, "ten_0", 2)
    _plan(db)
    assert _row(db_url, urgent.id).queue_position == 1 and _row(db_url, spare.id).queue_position == 2
    _release(db_url, blocker.id)
    placed = _plan(db).placed
    assert set(placed) == {urgent.id, spare.id}
