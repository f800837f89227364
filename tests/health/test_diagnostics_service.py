"""Issue 42, active signals: the scheduled diagnostics' side of the control plane
(`services/diagnostics.py`), on SQLite and Postgres: which idle nodes are due, the fleet-wide
budget (a share of the idle nodes, and a cap) held under concurrent sweeps, the lease's
compare-and-swap against a reservation both ways, a lease that lapses on its own, never a node a
tenant holds, and a diagnostic's end (findings judged as signals, the lease released)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlmodel import col, select

from gpucloud.db import session_scope
from gpucloud.models.tables import Node, NodeTransition
from gpucloud.protocol.actions import Diagnosis, DiagnosticCheck
from gpucloud.protocol.reports import Signal, SignalObservation
from gpucloud.services import allocations, diagnostics
from gpucloud.services.diagnostics import DiagnosticPolicy
from support.nodes import enroll

pytestmark = pytest.mark.unit

# The real clock's now: a reservation asks whether a lease has lapsed at the time it is made.
NOW = datetime.now(UTC).replace(microsecond=0)
DAY = timedelta(days=1)
POLICY = DiagnosticPolicy(interval=DAY, budget_share=1.0, max_concurrent=100, lease=timedelta(hours=1))


def _idle(db_url: str, prefix: str, count: int, *, since: timedelta = 2 * DAY, **fields) -> list[str]:
    ids = enroll(db_url, [f"{prefix}-{i:03d}" for i in range(count)])
    with session_scope(db_url) as session:
        for node in session.exec(select(Node).where(col(Node.id).in_(ids))).all():
            node.state, node.state_entered_at = "available", NOW - since
            for name, value in fields.items():
                setattr(node, name, value)
            session.add(node)
    return ids


def _node(db_url: str, node_id: str) -> Node:
    with session_scope(db_url) as session:
        node = session.get(Node, node_id)
        assert node is not None
        return node


def _lease_due(db_url: str, policy: DiagnosticPolicy = POLICY, *, now: datetime = NOW, limit: int | None = None):
    with session_scope(db_url) as session:
        return diagnostics.lease_due(session, policy, now=now, limit=limit)


def test_the_budget_is_a_share_of_the_idle_nodes_at_least_one_at_most_the_cap():
    policy = DiagnosticPolicy(budget_share=0.05, max_concurrent=16)
    assert [policy.budget(n) for n in (0, 1, 10, 39, 40, 100, 1000)] == [0, 1, 1, 1, 2, 5, 16]
    assert DiagnosticPolicy(budget_share=0.0).budget(1000) == 0
    assert DiagnosticPolicy(max_concurrent=0).budget(1000) == 0


def test_only_idle_nodes_untested_for_the_interval_are_due(db_url):
    due = _idle(db_url, "due", 2)
    _idle(db_url, "fresh", 1, since=timedelta(hours=1))  # back from burn-in an hour ago: tested
    _idle(db_url, "tested", 1, last_diag_at=NOW - timedelta(hours=2))
    _idle(db_url, "cordoned", 1, cordoned=True)
    _idle(db_url, "maint", 1, maintenance=True)
    _idle(db_url, "draining", 1, drain_requested=True)
    _idle(db_url, "suspect", 1, health="suspect")
    _idle(db_url, "silent", 1, agent_reachable=False)
    _idle(db_url, "data", 1, tenant_id="t-other")  # a tenant's data still on it: not idle
    _idle(db_url, "held", 1, state="active", allocation_id="a-1", tenant_id="t-1")
    _idle(db_url, "reserved", 1, state="reserved", allocation_id="a-2")
    _idle(db_url, "old", 1, last_diag_at=NOW - 3 * DAY)
    leased = _lease_due(db_url)
    # Longest untested first: the one tested three days ago, then those back for two days.
    assert [lease.node_id for lease in leased] == ["old-000", *due]
    for lease in leased:
        node = _node(db_url, lease.node_id)
        assert node.diag_lease == lease.lease and node.diag_lease_until == NOW + POLICY.lease


def test_never_more_than_the_budget_at_once_fleet_wide(db_url):
    _idle(db_url, "n", 40)
    policy = DiagnosticPolicy(interval=DAY, budget_share=0.05, max_concurrent=16, lease=timedelta(hours=1))
    first = _lease_due(db_url, policy)
    assert len(first) == 2  # 5 % of 40
    assert _lease_due(db_url, policy, now=NOW + timedelta(minutes=5)) == []  # both still held
    with session_scope(db_url) as session:  # one diagnostic ends: its room is free again
        diagnostics.record(session, first[0].node_id, first[0].lease, Diagnosis(), now=NOW + timedelta(minutes=5))
    again = _lease_due(db_url, policy, now=NOW + timedelta(minutes=6))
    assert len(again) == 1 and again[0].node_id not in {lease.node_id for lease in first}
    # The cap, below the share; and a limit (the node operations' room) below both.
    capped = DiagnosticPolicy(interval=DAY, budget_share=1.0, max_concurrent=3, lease=timedelta(hours=1))
    assert len(_lease_due(db_url, capped, now=NOW + timedelta(minutes=7))) == 1  # 3 less the 2 held
    assert _lease_due(db_url, POLICY, now=NOW + timedelta(minutes=8), limit=0) == []


def test_concurrent_sweeps_never_lease_past_the_budget(db_url):
    _idle(db_url, "n", 60)
    policy = DiagnosticPolicy(interval=DAY, budget_share=0.05, max_concurrent=16, lease=timedelta(hours=1))
    taken: list = []
    lock = threading.Lock()
    barrier = threading.Barrier(6)

    def sweep() -> None:
        barrier.wait()
        leased = _lease_due(db_url, policy)
        with lock:
            taken.extend(leased)

    threads = [threading.Thread(target=sweep) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 3  # 5 % of 60, whichever sweeps got them
    assert len({lease.node_id for lease in taken}) == 3
    with session_scope(db_url) as session:
        held = session.exec(select(Node).where(col(Node.diag_lease_until) > NOW)).all()
    assert len(held) == 3


def test_the_lease_is_a_compare_and_swap_and_never_takes_a_tenants_node(db_url):
    (node_id,) = _idle(db_url, "n", 1)
    with session_scope(db_url) as session:
        assert diagnostics.due(session, POLICY, now=NOW, limit=10) == [node_id]
        # Reserved for an allocation between the pick and the lease: the lease does not hold.
        node = session.get(Node, node_id)
        assert node is not None
        node.state, node.allocation_id = "reserved", "a-1"
        session.add(node)
    with session_scope(db_url) as session:
        assert diagnostics.lease(session, node_id, POLICY, now=NOW) is None
        node = session.get(Node, node_id)
        assert node is not None
        node.state, node.allocation_id = "available", None
        session.add(node)
    with session_scope(db_url) as session:
        first = diagnostics.lease(session, node_id, POLICY, now=NOW)
        assert first is not None
        assert diagnostics.lease(session, node_id, POLICY, now=NOW + timedelta(minutes=1)) is None  # held
        assert not diagnostics.release(session, node_id, "someone-elses")
    assert _node(db_url, node_id).diag_lease == first.lease


def test_a_reservation_never_takes_a_leased_node_until_its_lease_lapses(db_url):
    (node_id,) = _idle(db_url, "n", 1)
    with session_scope(db_url) as session:
        picked = allocations.available_candidates(session, gpu_type="H100", region="r1")
    assert [n.id for n in picked] == [node_id]
    (taken,) = _lease_due(db_url)  # leased after the allocation picked it
    alloc_id = "alloc-1"
    with session_scope(db_url) as session, pytest.raises(allocations.ReservationConflict):
        allocations.reserve_node(
            session, picked[0], alloc_id, now=NOW + timedelta(minutes=1), deadline_scale=1.0, op_id="r", actor="t"
        )
    with session_scope(db_url) as session:
        # Not a candidate while leased (`allocatable` at the time asked).
        candidates = allocations.available_candidates(session, gpu_type="H100", region="r1")
        assert node_id not in {n.id for n in candidates}
    # The worker died: the lease lapses on its own and the node is the pool's again.
    after = taken.until + timedelta(seconds=1)
    with session_scope(db_url) as session:
        allocations.reserve_node(
            session, _node(db_url, node_id), alloc_id, now=after, deadline_scale=1.0, op_id="r", actor="t"
        )
    assert _node(db_url, node_id).state == "reserved"


def test_a_lapsed_lease_is_taken_anew_and_the_old_holder_cannot_release_it(db_url):
    (node_id,) = _idle(db_url, "n", 1)
    (old,) = _lease_due(db_url)
    (new,) = _lease_due(db_url, now=old.until + timedelta(seconds=1))
    assert new.node_id == node_id and new.lease != old.lease
    with session_scope(db_url) as session:
        assert not diagnostics.release(session, node_id, old.lease)
        diagnostics.record(session, node_id, old.lease, Diagnosis(), now=old.until + timedelta(minutes=2))
    assert _node(db_url, node_id).diag_lease == new.lease  # the late diagnostic did not free it


def test_a_failed_diag_pulls_the_idle_node_and_releases_the_lease(db_url):
    bad, good, absent = _idle(db_url, "n", 3)
    leases = {lease.node_id: lease for lease in _lease_due(db_url)}
    at = NOW + timedelta(minutes=3)
    failed = Diagnosis(
        checks=[DiagnosticCheck(tool="dcgmi", status="fail", detail="Memory on GPU 3")],
        observations=[SignalObservation(signal=Signal.DIAG_FAILURE, at=at, source="dcgmi", detail="Memory on GPU 3")],
    )
    passed = Diagnosis(checks=[DiagnosticCheck(tool="dcgmi", status="pass")])
    not_run = Diagnosis(checks=[DiagnosticCheck(tool="dcgmi", status="not_run", detail="dcgmi is not installed")])
    with session_scope(db_url) as session:
        (outcome,) = diagnostics.record(session, bad, leases[bad].lease, failed, now=at)
        assert diagnostics.record(session, good, leases[good].lease, passed, now=at) == []
        assert diagnostics.record(session, absent, leases[absent].lease, not_run, now=at) == []
    assert outcome.pull.value == "drain" and outcome.verdict.action.value == "drain"
    node = _node(db_url, bad)
    assert node.health == "failed" and node.cordoned and node.drain_requested
    for node_id in (bad, good, absent):
        node = _node(db_url, node_id)
        assert node.last_diag_at == at and node.diag_lease is None and node.diag_lease_until is None
    with session_scope(db_url) as session:
        notes = {
            t.node_id: t.cause
            for t in session.exec(select(NodeTransition).where(col(NodeTransition.event) == "diagnose")).all()
        }
    assert notes[good] == "dcgmi: pass"
    assert notes[absent] == "dcgmi: not_run (dcgmi is not installed)"  # not a pass
    assert "dcgmi: fail" in notes[bad]
    assert _node(db_url, good).health == "ok"
    # A diagnostic whose agent gave no answer is noted as not run, and counts for the interval.
    with session_scope(db_url) as session:
        diagnostics.record(session, good, "gone", None, failure="diagnose failed: 409 Node held by a tenant", now=at)
    assert _lease_due(db_url, now=at + timedelta(hours=1)) == []


def test_a_sweep_with_nothing_due_leases_nothing_and_says_so_first(db_url):
    _idle(db_url, "fresh", 3, since=timedelta(hours=1))
    (old,) = _idle(db_url, "old", 1)
    with session_scope(db_url) as session:
        assert diagnostics.wanted(session, POLICY, now=NOW) == 1
    (taken,) = _lease_due(db_url)
    assert taken.node_id == old
    with session_scope(db_url) as session:
        assert diagnostics.wanted(session, POLICY, now=NOW) == 0
