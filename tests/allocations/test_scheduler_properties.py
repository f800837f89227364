"""The scheduling policy's invariants over random fleets, queues and reservations (hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpucloud.scheduler import (
    Allocation,
    CapacityReservation,
    Decision,
    Node,
    PolicySettings,
    Pool,
    QueuedRequest,
    SchedulerState,
    TenantShare,
    decide,
)

pytestmark = pytest.mark.unit

POOL = Pool("h100", "us-east")
NOW = 100_000.0
TENANTS = ("a", "b", "c")
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def fleets(draw) -> tuple[tuple[Node, ...], tuple[Allocation, ...]]:
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    nodes: list[Node] = []
    labels: dict[str, list[str]] = {}
    for d, size in enumerate(sizes):
        for i in range(size):
            node_id = f"d{d}n{i}"
            label = draw(st.sampled_from(["free", "free", "held", "od0", "od1", "spot0", "spot1", "spot2"]))
            if label == "held":
                until = draw(st.one_of(st.none(), st.floats(NOW, NOW + 1_000)))
                nodes.append(Node(node_id, POOL, f"d{d}", held=True, held_until=until))
                continue
            nodes.append(Node(node_id, POOL, f"d{d}"))
            if label != "free":
                labels.setdefault(label, []).append(node_id)
    allocations = tuple(
        Allocation(
            label,
            "x",
            POOL,
            tuple(ids),
            tier="preemptible" if label.startswith("spot") else "on_demand",
            expected_end=draw(st.one_of(st.none(), st.floats(NOW, NOW + 1_000))),
        )
        for label, ids in sorted(labels.items())
    )
    return tuple(nodes), allocations


requests = st.builds(
    QueuedRequest,
    id=st.just(""),
    tenant=st.sampled_from(TENANTS),
    pool=st.just(POOL),
    node_count=st.integers(1, 6),
    submitted_at=st.floats(NOW - 1_000, NOW),
    max_wait_s=st.one_of(st.none(), st.floats(0, 2_000)),
    expected_duration_s=st.one_of(st.none(), st.floats(1, 2_000)),
    tier=st.sampled_from(["on_demand", "on_demand", "on_demand", "preemptible"]),
)


@st.composite
def states(draw) -> SchedulerState:
    nodes, allocations = draw(fleets())
    queue = tuple(
        QueuedRequest(
            f"r{i}", r.tenant, POOL, r.node_count, r.submitted_at, r.max_wait_s, r.expected_duration_s, r.tier
        )
        for i, r in enumerate(draw(st.lists(requests, max_size=8)))
    )
    reservations = []
    for i in range(draw(st.integers(0, 2))):
        start = draw(st.floats(NOW - 200, NOW + 2_000))
        reservations.append(
            CapacityReservation(f"res{i}", "t", POOL, draw(st.integers(1, 4)), start, start + draw(st.floats(1, 3_000)))
        )
    shares = tuple(
        TenantShare(t, POOL, draw(st.floats(0.1, 4)), draw(st.floats(0, 1e6)), NOW - draw(st.floats(0, 1e6)))
        for t in TENANTS
    )
    return SchedulerState(
        now=NOW,
        nodes=nodes,
        allocations=allocations,
        queue=queue,
        reservations=tuple(reservations),
        shares=shares,
        settings=PolicySettings(lead_time_s=1_000.0, preemption_notice_s=100.0),
    )


def check_invariants(state: SchedulerState, d: Decision) -> None:
    nodes = {n.id: n for n in state.nodes}
    alloc_of = {n: a for a in state.allocations for n in a.node_ids}
    allocs = {a.id: a for a in state.allocations}
    requests = {r.id: r for r in state.queue}
    reservations = {r.id: r for r in state.reservations}

    # No node in two placements.
    used = Counter(n for p in d.placements for n in p.node_ids)
    assert all(c == 1 for c in used.values()), used

    for p in d.placements:
        # One fabric domain, exactly the gang's size.
        want = requests[p.id].node_count if p.id in requests else reservations[p.id].node_count
        assert len(p.node_ids) == want
        assert {nodes[n].fabric_domain for n in p.node_ids} == {p.fabric_domain}
        for n in p.node_ids:
            # Never on a held node or a running allocation's, unless that one is preemptible and preempted.
            assert not nodes[n].held
            if n in alloc_of:
                assert alloc_of[n].tier == "preemptible" and alloc_of[n].id in p.preempts
        # Preemption only when needed: the domain's free nodes alone were too few, and every victim gives a node.
        if p.preempts:
            free_used = [n for n in p.node_ids if n not in alloc_of]
            assert len(free_used) < want
            for v in p.preempts:
                assert any(alloc_of.get(n) is allocs[v] for n in p.node_ids)

    # Preemption only takes preemptible allocations, each once, for a placement or a held reservation.
    preempted = [x.allocation_id for x in d.preemptions]
    assert len(preempted) == len(set(preempted))
    held = {s.reservation_id: set(s.node_ids) for s in d.reservations}
    for x in d.preemptions:
        assert allocs[x.allocation_id].tier == "preemptible"
        placement = next((p for p in d.placements if p.id == x.for_id), None)
        if placement is not None:
            assert x.allocation_id in placement.preempts
        else:
            assert x.for_id in reservations and held[x.for_id] & set(allocs[x.allocation_id].node_ids)
    for p in d.placements:
        assert set(p.preempts) <= set(preempted)

    # No backfill delays the head: on the head's nodes only what finishes before its start.
    for head in d.heads:
        for p in d.placements:
            if p.id in requests and p.backfilled and set(p.node_ids) & set(head.node_ids):
                duration = requests[p.id].expected_duration_s
                assert head.start is not None and duration is not None
                assert state.now + duration <= head.start

    # Every request is placed, expired or still queued, exactly once; positions count from 1.
    placed = {p.id for p in d.placements if p.id in requests}
    expired = {e.request_id for e in d.expired}
    queued = [e.request_id for e in d.queue]
    assert sorted([*placed, *expired, *queued]) == sorted(requests)
    assert [e.position for e in d.queue] == list(range(1, len(queued) + 1))
    for rid in expired:
        r = requests[rid]
        assert r.max_wait_s is not None and state.now >= r.submitted_at + r.max_wait_s
    for e in d.queue:
        assert e.estimated_start is None or e.estimated_start >= state.now


@EXAMPLES
@given(states())
def test_invariants_hold_for_any_fleet_and_queue(state):
    check_invariants(state, decide(state))


@EXAMPLES
@given(states(), st.integers(1, 4))
def test_a_reservation_at_its_start_is_placed_whenever_a_domain_can_hold_it(state, count):
    booking = CapacityReservation("booked", "t", POOL, count, start=NOW, end=NOW + 500)
    state = SchedulerState(
        now=NOW, nodes=state.nodes, allocations=state.allocations, queue=state.queue, reservations=(booking,)
    )
    blocked = {n for a in state.allocations if a.tier != "preemptible" for n in a.node_ids}
    takeable = Counter(n.fabric_domain for n in state.nodes if not n.held and n.id not in blocked)
    d = decide(state)
    check_invariants(state, d)
    assert ("booked" in {p.id for p in d.placements}) is (max(takeable.values(), default=0) >= count)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=3),
    st.integers(1, 5),
    st.lists(st.tuples(st.integers(0, 20), st.integers(1, 4), st.one_of(st.none(), st.integers(1, 30))), max_size=25),
    st.sets(st.integers(0, 40), max_size=6),
)
def test_a_feasible_reservation_is_never_missed_whatever_the_queue_does(sizes, count, arrivals, spot_at):
    """From its lead time to its start, requests (some without a duration) and preemptible work come
    and go as the policy decides; at its start the reservation is placed, if it was feasible."""
    step = 60.0
    lead = 40 * step
    start = NOW + lead
    nodes = tuple(Node(f"d{d}n{i}", POOL, f"d{d}") for d, size in enumerate(sizes) for i in range(size))
    booking = CapacityReservation("booked", "t", POOL, count, start=start, end=start + 10_000)
    feasible = max(sizes) >= count  # at its lead time every node is free
    running: dict[str, Allocation] = {}
    queue: dict[str, QueuedRequest] = {}
    for tick in range(41):
        now = NOW + tick * step
        running = {k: a for k, a in running.items() if a.expected_end is None or a.expected_end > now}
        for i, (at, n, minutes) in enumerate(arrivals):
            if at == tick:
                dur = None if minutes is None else minutes * step
                queue[f"q{i}"] = QueuedRequest(f"q{i}", TENANTS[i % 3], POOL, n, now, None, dur)
        if tick in spot_at:
            queue[f"s{tick}"] = QueuedRequest(f"s{tick}", "a", POOL, 1, now, None, None, "preemptible")
        state = SchedulerState(
            now=now,
            nodes=nodes,
            allocations=tuple(running.values()),
            queue=tuple(queue.values()),
            reservations=(booking,),
            settings=PolicySettings(lead_time_s=lead, preemption_notice_s=2 * step),
        )
        d = decide(state)
        check_invariants(state, d)
        for x in d.preemptions:
            running.pop(x.allocation_id, None)
        for p in d.placements:
            r = queue.pop(p.id, None)
            dur = None if r is None else r.expected_duration_s
            end = booking.end if r is None else (None if dur is None else now + dur)
            running[p.id] = Allocation(
                p.id, p.tenant, POOL, p.node_ids, p.tier, end, reservation_id="booked" if r is None else None
            )
        for e in d.expired:
            queue.pop(e.request_id)
    assert ("booked" in running) is feasible


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.one_of(st.none(), st.integers(1, 100))), min_size=1, max_size=15),
    st.lists(st.tuples(st.integers(1, 4), st.one_of(st.none(), st.integers(1, 100))), min_size=1, max_size=5),
)
def test_a_flooding_tenant_does_not_starve_one_with_an_equal_share(flood, few):
    """Tenant `a` floods the queue first; `b`, with the same share and usage, asks later. Ahead of
    each of b's requests, a has been charged no more than b (up to and with that request) plus
    one of a's requests."""
    run = PolicySettings(default_run_s=50.0)
    queue = [QueuedRequest(f"a{i}", "a", POOL, n, float(i), None, d) for i, (n, d) in enumerate(flood)]
    queue += [QueuedRequest(f"b{i}", "b", POOL, n, 1_000.0 + i, None, d) for i, (n, d) in enumerate(few)]
    shares = (TenantShare("a", POOL, 1.0, 500.0, NOW), TenantShare("b", POOL, 1.0, 500.0, NOW))
    d = decide(SchedulerState(now=NOW, queue=tuple(queue), shares=shares, settings=run))  # no nodes: all wait
    by_id = {r.id: r for r in queue}

    def charge(r: QueuedRequest) -> float:
        return r.node_count * (run.default_run_s if r.expected_duration_s is None else r.expected_duration_s)

    biggest = max(charge(r) for r in queue if r.tenant == "a")
    charged = {"a": 0.0, "b": 0.0}
    for entry in d.queue:
        r = by_id[entry.request_id]
        if r.tenant == "b":
            assert charged["a"] <= charged["b"] + charge(r) + biggest
        charged[r.tenant] += charge(r)
