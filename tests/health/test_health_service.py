"""The health service against a real database (SQLite, and Postgres when reachable): readings
judged for trends and pruned, nodes still being provisioned for an allocation pulled, the
circuit breaker holding under concurrent judgements, and the signals beyond XIDs stored, judged
and acted on as XIDs are."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlmodel import func, select

from gpucloud.db import session_scope
from gpucloud.health.breaker import CircuitBreaker
from gpucloud.health.correlation import CorrelationPolicy
from gpucloud.health.pulls import PullKind
from gpucloud.models.health_tables import (
    AllocationEvent,
    NodeReadingRecord,
    OperatorAlertRecord,
    QuarantineBreaker,
    QuarantinePull,
    SignalObservationRecord,
)
from gpucloud.models.tables import Node, NodeEnroll
from gpucloud.protocol.reports import (
    FatalKind,
    NodeReading,
    ProbeFatal,
    Signal,
    SignalObservation,
    SignalReport,
    XidEvent,
)
from gpucloud.services import health as health_service
from gpucloud.services import nodes as node_service
from support.nodes import enroll
from support.readings import node_reading

pytestmark = pytest.mark.integration

POOL = "H100/r1"
ALLOW_ALL = health_service.BreakerSettings(max_pulled_share=1.0)
# Every node here sits in one rack: where the breaker itself is tested, faults on several of them
# are not to be one fleet incident (`tests/health/test_fleet_incidents.py` tests that).
UNCORRELATED = CorrelationPolicy(min_nodes=1_000_000)


def _fleet(db_url: str, count: int, *, state: str = "available", allocation_id: str | None = None) -> list[str]:
    ids = enroll(db_url, [f"n-{i:02d}" for i in range(count)])
    with session_scope(db_url) as session:
        for node in session.exec(select(Node)).all():
            node.state, node.allocation_id = state, allocation_id
            session.add(node)
    return ids


def _ingest(db_url: str, readings: list[NodeReading], now: datetime):
    with session_scope(db_url) as session:
        return health_service.ingest_readings(session, readings, now=now, breaker=ALLOW_ALL)


def test_readings_raise_trend_conditions_and_a_pull(db_url):
    rising, flapping = _fleet(db_url, 2)
    now = datetime.now(UTC)
    # Corrected ECC errors on GPU 2 at 500 an hour: a warning, the node stays.
    outcomes, unknown = _ingest(
        db_url,
        [
            node_reading(rising, now - timedelta(hours=2)),
            node_reading(rising, now - timedelta(hours=1), corrected=500),
            node_reading(rising, now, corrected=1000),
        ],
        now,
    )
    (outcome,) = outcomes
    assert unknown == [] and outcome.pull == PullKind.NONE
    assert (outcome.verdict.health, outcome.verdict.action) == ("suspect", "watch")
    assert [c.name for c in outcome.verdict.conditions] == ["ecc_corrected_rate"]

    # An NVLink that was up and is down: drain. Judged over what is stored, not just this batch.
    _ingest(db_url, [node_reading(flapping, now - timedelta(minutes=1))], now)
    (outcome,), _ = _ingest(db_url, [node_reading(flapping, now, link0_active=False)], now)
    assert outcome.verdict.action == "drain" and outcome.pull == "drain"
    assert outcome.verdict.conditions[0].name == "nvlink_down"
    with session_scope(db_url) as session:
        node = session.get(Node, flapping)
        assert node.health == "suspect" and node.drain_requested
        assert node.health_conditions[0]["name"] == "nvlink_down"


def test_a_lost_gpu_reading_on_an_active_node_replaces_it_at_once(db_url):
    (node_id,) = _fleet(db_url, 1, state="active", allocation_id="alloc-1")
    now = datetime.now(UTC)
    lost = ProbeFatal(kind=FatalKind.GPU_LOST, gpu_index=5, detail="GPU has fallen off the bus")
    (outcome,), _ = _ingest(db_url, [node_reading(node_id, now, fatal=lost)], now)
    assert (outcome.pull, outcome.allocation_id, outcome.immediate) == ("replace", "alloc-1", True)
    assert outcome.verdict.conditions[0].name == "probe_fatal"


def test_readings_of_an_unknown_node_store_nothing(db_url):
    (known,) = _fleet(db_url, 1)
    now = datetime.now(UTC)
    outcomes, unknown = _ingest(db_url, [node_reading(known, now), node_reading("ghost", now)], now)
    assert (outcomes, unknown) == ([], ["ghost"])
    with session_scope(db_url) as session:
        assert session.exec(select(func.count()).select_from(NodeReadingRecord)).one() == 0


def test_readings_past_the_trend_window_are_pruned_but_fatal_ones_kept_for_the_lemon_rule(db_url):
    (node_id,) = _fleet(db_url, 1)
    now = datetime.now(UTC)
    old = now - timedelta(hours=25)
    driver_gone = ProbeFatal(kind=FatalKind.DRIVER_NOT_LOADED)
    _ingest(
        db_url, [node_reading(node_id, old), node_reading(node_id, old + timedelta(seconds=30), fatal=driver_gone)], now
    )
    (outcome,), _ = _ingest(db_url, [node_reading(node_id, now)], now)
    # A driver that is loaded again is no condition; the old fatal reading is kept all the same.
    assert outcome.verdict.health == "ok" and outcome.pull == PullKind.NONE
    with session_scope(db_url) as session:
        kept = session.exec(select(NodeReadingRecord).order_by(NodeReadingRecord.timestamp)).all()
    assert [(r.timestamp, r.fatal) for r in kept] == [(old + timedelta(seconds=30), True), (now, False)]


@pytest.mark.parametrize("state", ["reserved", "provisioning"])
def test_a_fatal_xid_on_a_node_not_yet_active_pulls_it_from_its_allocation(db_url, state):
    (node_id,) = _fleet(db_url, 1, state=state, allocation_id="alloc-1")
    event = XidEvent(node_id=node_id, gpu_index=1, xid=48, timestamp=datetime.now(UTC))  # drain, not drain_now
    with session_scope(db_url) as session:
        (outcome,), _ = health_service.ingest_xids(session, [event], source="test", breaker=ALLOW_ALL)
    # No job runs there yet: nothing to checkpoint, so no grace period either.
    assert (outcome.pull, outcome.allocation_id, outcome.immediate) == ("replace", "alloc-1", True)
    with session_scope(db_url) as session:
        assert not session.get(Node, node_id).drain_requested  # the allocation's workflow pulls it


def test_a_contained_ecc_error_drains_an_idle_node_for_its_reset_and_leaves_a_tenants_node_running(db_url):
    """XID 94 (the reset settles it): a node idle in the pool is drained, reset and burned in
    before anyone gets it; a tenant's node keeps running (the wipe after release resets)."""
    idle, held = _fleet(db_url, 2)
    with session_scope(db_url) as session:
        session.get(Node, held).state, session.get(Node, held).allocation_id = "active", "alloc-1"
    now = datetime.now(UTC)
    events = [XidEvent(node_id=n, gpu_index=2, xid=94, timestamp=now) for n in (idle, held)]
    with session_scope(db_url) as session:
        outcomes, _ = health_service.ingest_xids(session, events, source="test", breaker=ALLOW_ALL)
    by_node = {o.node_id: o for o in outcomes}
    assert by_node[idle].pull == PullKind.DRAIN and "reset before the next tenant" in by_node[idle].reason
    assert by_node[held].pull == PullKind.NONE
    with session_scope(db_url) as session:
        drained, running = session.get(Node, idle), session.get(Node, held)
        assert (drained.drain_requested, drained.cordoned, drained.health) == (True, True, "suspect")
        assert (running.drain_requested, running.cordoned) == (False, False)


def test_concurrent_judgements_never_pull_past_the_breaker(db_url, monkeypatch):
    nodes = _fleet(db_url, 8)
    settings = health_service.BreakerSettings(max_pulled_share=0.25, correlation=UNCORRELATED)  # 2 of 8 an hour
    postgres = db_url.startswith("postgresql")
    with session_scope(db_url) as session:
        # The pool's breaker row exists already. On first use it is created, and concurrent first
        # users queue on its insert; the barrier below would turn that queue into a deadlock.
        session.add(QuarantineBreaker(pool=POOL))
    start = threading.Barrier(len(nodes), timeout=30)
    counted = threading.Barrier(len(nodes), timeout=30)
    if postgres:
        # The worst interleaving: every judgement has counted the window before any records a
        # pull. (SQLite serializes write transactions whole, so there they cannot interleave.)
        original, seen = CircuitBreaker.request_quarantine, threading.local()

        def after_everyone_counted(self, **kw):
            if not getattr(seen, "waited", False):
                seen.waited = True
                counted.wait()
            return original(self, **kw)

        monkeypatch.setattr(CircuitBreaker, "request_quarantine", after_everyone_counted)
    pulls: list[PullKind] = []
    errors: list[BaseException] = []

    def judge(node_id: str) -> None:
        start.wait()
        try:
            with session_scope(db_url) as session:
                (outcome,), _ = health_service.ingest_xids(
                    session,
                    [XidEvent(node_id=node_id, gpu_index=0, xid=79, timestamp=datetime.now(UTC))],
                    source="test",
                    breaker=settings,
                )
            pulls.append(outcome.pull)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=judge, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert Counter(pulls) == {PullKind.DRAIN: 2, PullKind.NONE: 6}
    with session_scope(db_url) as session:
        assert session.exec(select(func.count()).select_from(QuarantinePull)).one() == 2
        assert session.exec(select(func.count()).select_from(OperatorAlertRecord)).one() == 6
        assert session.exec(select(func.count()).select_from(Node).where(Node.drain_requested)).one() == 2
        assert session.get(QuarantineBreaker, POOL).generation == 2


@pytest.mark.parametrize(("actor", "lifted"), [("health", True), ("operator", False)])
def test_a_passed_burn_in_lifts_the_health_loops_cordon_only(db_url, actor, lifted):
    from gpucloud.models.tables import NodeTransition

    with session_scope(db_url) as session:
        node_service.enroll_nodes(
            session,
            [
                NodeEnroll(
                    id="c1",
                    hostname="c1",
                    agent_url="http://unused",
                    gpu_type="H100",
                    gpu_count=8,
                    region="r",
                    pod="p",
                    rack="r1",
                )
            ],
        )
        for event in ("inspect", "ok", "ok"):
            node = node_service.transition(session, "c1", event, from_state=session.get(Node, "c1").state)
        session.execute(sa.update(Node).where(Node.id == "c1").values(cordoned=True))
        session.add(
            NodeTransition(
                node_id="c1",
                from_state="burn_in",
                to_state="burn_in",
                event="cordon",
                actor=actor,
                cause="test",
                generation=node.generation,
            )
        )
    with session_scope(db_url) as session:
        node_service.transition(session, "c1", "ok", from_state="burn_in")
    with session_scope(db_url) as session:
        node = session.get(Node, "c1")
        assert node.state == "available" and node.cordoned is (not lifted)


def test_detaching_reported_nodes_answers_the_same_on_a_retry(db_url):
    """A pull takes its reported members out in one transaction and names them; a retry (the
    first answer lost) names the same nodes, while a node already draining or never a member
    is not pulled."""
    from gpucloud.models.tables import Allocation
    from gpucloud.services import replacement

    ids = _fleet(db_url, 4, state="active")
    with session_scope(db_url) as session:
        alloc = Allocation(tenant_id="t1", gpu_type="H100", node_count=3, region="r1", status="ready")
        alloc.node_ids = ids[:3]
        session.add(alloc)
        session.flush()
        alloc_id = alloc.id
        for node in session.exec(select(Node)).all():
            node.allocation_id = alloc_id if node.id in ids[:3] else None
            session.add(node)
    with session_scope(db_url) as session:
        session.get(Node, ids[2]).state = "draining"  # pulled before, its drain under way
        session.get(Node, ids[2]).allocation_id = alloc_id
    with session_scope(db_url) as session:
        alloc_row = session.exec(select(Allocation).where(Allocation.id == alloc_id)).one()
        alloc_row.node_ids = ids[:2]
        session.add(alloc_row)

    reported = [(ids[0], "xid 79"), (ids[2], "xid 79"), (ids[3], "xid 79")]
    for _ in range(2):  # the first try, then its retry
        with session_scope(db_url) as session:
            allocation, pulled = replacement.detach_nodes(session, alloc_id, reported)
            assert pulled == [ids[0]]
            assert allocation.node_ids == [ids[1]]
            assert allocation.status == "degraded"
    with session_scope(db_url) as session:
        events = session.exec(
            select(func.count()).select_from(AllocationEvent).where(AllocationEvent.kind == "degraded")
        ).one()
    assert events == 1  # the retry recorded nothing again


def test_a_tenants_own_fatal_xids_never_open_the_breaker_for_another_tenants_node(db_url):
    """Issue 37, item 7: tenant A (root on its nodes, so it writes their reports) spends only its
    own budget; tenant B's faulty node is still pulled, and so is an idle one of the platform's."""
    nodes = enroll(db_url, [f"n-{i:02d}" for i in range(40)])
    a_nodes, b_node, idle = nodes[:20], nodes[20], nodes[39]
    with session_scope(db_url) as session:
        for node in session.exec(select(Node)).all():
            if node.id in a_nodes or node.id == b_node:
                tenant = "tenant-a" if node.id in a_nodes else "tenant-b"
                node.state, node.allocation_id, node.tenant_id = "active", f"alloc-{tenant}", tenant
            else:
                node.state = "available"
            session.add(node)
    # A 40-node pool: 2 pulls an hour.
    settings = health_service.BreakerSettings(max_pulled_share=0.05, correlation=UNCORRELATED)

    def fatal(node_id: str) -> health_service.HealthOutcome:
        with session_scope(db_url) as session:
            (outcome,), _ = health_service.ingest_xids(
                session,
                [XidEvent(node_id=node_id, gpu_index=0, xid=79, timestamp=datetime.now(UTC))],
                source="test",
                breaker=settings,
            )
        return outcome

    a_outcomes = [fatal(n) for n in a_nodes[:4]]  # 20 % of the pool reports fatal XIDs
    assert [o.pull for o in a_outcomes] == [
        PullKind.REPLACE,
        PullKind.NONE,
        PullKind.NONE,
        PullKind.NONE,
    ]  # 5 % of A's 20 nodes: one
    assert "tenant tenant-a" in (a_outcomes[1].alert or "")
    assert fatal(b_node).pull == "replace"  # B's own budget is untouched
    assert fatal(idle).pull == "drain"  # and so is the platform's
    with session_scope(db_url) as session:
        alerts = session.exec(select(OperatorAlertRecord)).all()
    assert {a.node_id for a in alerts} == set(a_nodes[1:4])


# Signals beyond XIDs (issue 42): stored, judged with the XIDs, acted on through the same path.


def _signals(db_url: str, reports: list[SignalReport], now: datetime, *, source: str = "agent"):
    with session_scope(db_url) as session:
        return health_service.ingest_signals(session, reports, source=source, now=now, breaker=ALLOW_ALL)


def _report(node_id: str, at: datetime, *signals: Signal, source: str = "", count: int = 1) -> SignalReport:
    return SignalReport(
        node_id=node_id,
        at=at,
        observations=[SignalObservation(signal=s, at=at, source=source, count=count) for s in signals],
    )


@pytest.mark.parametrize(
    ("signal", "action"),
    [
        (Signal.IB_LINK_DOWN, "drain"),
        (Signal.NIC_ERROR, "drain"),
        (Signal.SDC_SUSPECT, "drain"),
        (Signal.HOST_MAINTENANCE, "drain"),
        (Signal.PCIE_AER_UNCORRECTABLE, "drain"),
    ],
)
def test_a_drain_level_signal_pulls_an_active_node_from_its_allocation_as_a_fatal_xid_does(db_url, signal, action):
    (node_id,) = _fleet(db_url, 1, state="active", allocation_id="alloc-1")
    with session_scope(db_url) as session:
        session.execute(sa.update(Node).where(Node.id == node_id).values(tenant_id="ten-a"))
    now = datetime.now(UTC)
    (outcome,), unknown = _signals(db_url, [_report(node_id, now, signal, source="mlx5_0/1")], now)
    assert unknown == [] and outcome.verdict.action == action
    assert (outcome.pull, outcome.allocation_id, outcome.immediate) == ("replace", "alloc-1", False)
    assert outcome.reason.startswith(f"{signal.value}: ")
    with session_scope(db_url) as session:
        node = session.get(Node, node_id)
        assert node.cordoned and node.health_conditions[0]["name"] == signal.value
        (stored,) = session.exec(select(SignalObservationRecord)).all()
        # Who held the node comes from the control plane's record, as for XIDs.
        assert (stored.signal, stored.source, stored.tenant_id, stored.allocation_id, stored.reported_by) == (
            signal.value,
            "mlx5_0/1",
            "ten-a",
            "alloc-1",
            "agent",
        )
        assert session.exec(select(func.count()).select_from(QuarantinePull)).one() == 1


def test_application_signals_are_counted_but_never_pull(db_url):
    active, idle = _fleet(db_url, 2)
    with session_scope(db_url) as session:
        session.execute(sa.update(Node).where(Node.id == active).values(state="active", allocation_id="alloc-1"))
    now = datetime.now(UTC)
    reports = [
        _report(n, now - timedelta(minutes=i), Signal.NCCL_TIMEOUT, Signal.WORKLOAD_HANG, count=50)
        for n in (active, idle)
        for i in range(20)
    ]
    outcomes, _ = _signals(db_url, reports, now)
    assert [(o.pull, o.verdict.action, o.verdict.health) for o in outcomes] == [("none", "none", "ok")] * 2
    assert {c.name for c in outcomes[0].verdict.conditions} == {"nccl_timeout", "workload_hang"}
    assert "not acted on" in outcomes[0].verdict.conditions[0].reason
    with session_scope(db_url) as session:
        for node in session.exec(select(Node)).all():
            assert not node.cordoned and not node.drain_requested and node.health == "ok"
        assert session.exec(select(func.count()).select_from(QuarantinePull)).one() == 0


def test_a_signal_on_an_idle_node_drains_it_and_below_the_bar_only_watches(db_url):
    flapping, noisy = _fleet(db_url, 2)
    now = datetime.now(UTC)
    # Symbol errors: 100 an hour is the bar, per port; 60 on each of two ports is two healthy ports.
    (outcome,), _ = _signals(
        db_url,
        [
            _report(noisy, now, Signal.IB_SYMBOL_ERRORS, source="mlx5_0/1", count=60),
            _report(noisy, now, Signal.IB_SYMBOL_ERRORS, source="mlx5_1/1", count=60),
        ],
        now,
    )
    assert (outcome.pull, outcome.verdict.health, outcome.verdict.action) == ("none", "ok", "watch")
    # The judgement reads what is stored, not just this batch: 60 more on one port breaks the bar.
    (outcome,), _ = _signals(db_url, [_report(noisy, now, Signal.IB_SYMBOL_ERRORS, source="mlx5_0/1", count=60)], now)
    assert (outcome.pull, outcome.verdict.action) == ("drain", "drain")
    (outcome,), _ = _signals(db_url, [_report(flapping, now, Signal.IB_LINK_DOWN, source="mlx5_3/1")], now)
    assert outcome.pull == "drain"
    with session_scope(db_url) as session:
        assert session.get(Node, flapping).drain_requested


def test_signals_of_an_unknown_node_are_not_stored_and_the_rest_are(db_url):
    (known,) = _fleet(db_url, 1)
    now = datetime.now(UTC)
    outcomes, unknown = _signals(
        db_url, [_report("ghost", now, Signal.NIC_ERROR), _report(known, now, Signal.THERMAL)], now
    )
    assert unknown == ["ghost"] and [o.node_id for o in outcomes] == [known]
    with session_scope(db_url) as session:
        assert [r.node_id for r in session.exec(select(SignalObservationRecord)).all()] == [known]


def test_signals_before_a_passed_burn_in_are_dealt_with_and_old_ones_pruned(db_url):
    from gpucloud.models.tables import NodeTransition

    (node_id,) = _fleet(db_url, 1)
    now = datetime.now(UTC)
    _signals(db_url, [_report(node_id, now - timedelta(hours=2), Signal.IB_LINK_DOWN)], now)
    with session_scope(db_url) as session:
        session.execute(sa.update(Node).where(Node.id == node_id).values(drain_requested=False, cordoned=False))
        session.add(
            NodeTransition(
                node_id=node_id,
                from_state="burn_in",
                to_state="available",
                event="ok",
                actor="test",
                cause="burn-in passed",
                generation=1,
                at=now - timedelta(hours=1),
            )
        )
    # A watch-level signal after the burn-in; the port that was down before it no longer counts.
    (outcome,), _ = _signals(db_url, [_report(node_id, now, Signal.NVRM_ERROR)], now)
    assert (outcome.pull, outcome.verdict.action) == ("none", "watch")
    assert [c.name for c in outcome.verdict.conditions] == ["nvrm_error"]

    # Pruned on ingest: watch-level signals past the trend window, any past the lemon window.
    later = now + timedelta(hours=25)
    _signals(db_url, [_report(node_id, later, Signal.WORKLOAD_HANG)], later)
    with session_scope(db_url) as session:
        kept = sorted(r.signal for r in session.exec(select(SignalObservationRecord)).all())
    assert kept == ["ib_link_down", "workload_hang"]
    much_later = now + timedelta(days=31)
    _signals(db_url, [_report(node_id, much_later, Signal.WORKLOAD_HANG)], much_later)
    with session_scope(db_url) as session:
        kept = sorted(r.signal for r in session.exec(select(SignalObservationRecord)).all())
    assert kept == ["workload_hang"]
