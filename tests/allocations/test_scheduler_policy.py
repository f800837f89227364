"""The scheduling policy's rules, one small hand-built fleet each (issue 43, `gpucloud.scheduler`)."""

from __future__ import annotations

import pytest

from gpucloud.scheduler import (
    Allocation,
    CapacityReservation,
    Node,
    PolicySettings,
    Pool,
    QueuedRequest,
    SchedulerState,
    TenantShare,
    decayed_usage,
    decide,
    fair_share_factor,
)

pytestmark = pytest.mark.unit

H100 = Pool("h100", "us-east")
NOW = 10_000.0


def fleet(**domains: int) -> tuple[Node, ...]:
    """`fleet(a=4, b=2)`: nodes a0..a3 in domain a, b0..b1 in domain b."""
    return tuple(Node(f"{d}{i}", H100, d) for d, count in domains.items() for i in range(count))


def req(id: str, nodes: int = 1, *, tenant: str = "t1", at: float = 0.0, **kw) -> QueuedRequest:
    return QueuedRequest(id, tenant, H100, nodes, submitted_at=at, **kw)


def running(id: str, *node_ids: str, tier="on_demand", end: float | None = None, **kw) -> Allocation:
    return Allocation(id, "other", H100, tuple(node_ids), tier=tier, expected_end=end, **kw)


def state(**kw) -> SchedulerState:
    return SchedulerState(now=kw.pop("now", NOW), **kw)


def placed(decision) -> dict[str, tuple[str, ...]]:
    return {p.id: p.node_ids for p in decision.placements}


# ---- gangs and fabric domains -----------------------------------------------------------------


def test_a_gang_is_placed_whole_inside_one_domain_best_fit():
    d = decide(state(nodes=fleet(a=4, b=2), queue=(req("r", 2),)))
    assert placed(d) == {"r": ("b0", "b1")}  # the smaller domain that suffices keeps `a` whole
    assert d.placements[0].fabric_domain == "b"


def test_a_gang_is_never_split_across_domains():
    nodes = fleet(a=2, b=2)
    d = decide(state(nodes=nodes, allocations=(running("x", "a0", end=NOW + 50),), queue=(req("r", 3),)))
    assert placed(d) == {}
    assert d.queue[0].request_id == "r" and d.queue[0].position == 1


def test_held_nodes_are_not_placed_on():
    nodes = (Node("a0", H100, "a", held=True, held_until=NOW + 30), Node("a1", H100, "a"))
    d = decide(state(nodes=nodes, queue=(req("r", 2),)))
    assert placed(d) == {}
    assert d.heads[0].start == NOW + 30
    assert d.queue[0].estimated_start == NOW + 30


# ---- fair share -------------------------------------------------------------------------------


def test_usage_halves_every_half_life():
    assert decayed_usage(800.0, 0.0, 200.0, 100.0) == pytest.approx(200.0)
    assert decayed_usage(800.0, 0.0, 0.0, 100.0) == 800.0


def test_slurm_fair_share_factor():
    assert fair_share_factor(0.0, 100.0, 1.0, 2.0) == 1.0
    assert fair_share_factor(50.0, 100.0, 1.0, 2.0) == pytest.approx(0.5)  # used exactly its share
    assert fair_share_factor(100.0, 100.0, 1.0, 2.0) == pytest.approx(0.25)


def test_the_tenant_that_used_less_against_its_share_goes_first():
    shares = (
        TenantShare("heavy", H100, weight=1.0, usage_node_s=1_000.0, usage_as_of=NOW),
        TenantShare("light", H100, weight=1.0, usage_node_s=10.0, usage_as_of=NOW),
    )
    queue = (req("old", tenant="heavy", at=0.0), req("new", tenant="light", at=100.0))
    d = decide(state(nodes=(), queue=queue, shares=shares))
    assert [e.request_id for e in d.queue] == ["new", "old"]
    assert d.queue[0].fair_share_factor > d.queue[1].fair_share_factor


def test_a_bigger_share_goes_first_at_equal_usage():
    shares = (
        TenantShare("small", H100, weight=1.0, usage_node_s=100.0, usage_as_of=NOW),
        TenantShare("big", H100, weight=4.0, usage_node_s=100.0, usage_as_of=NOW),
    )
    queue = (req("s", tenant="small", at=0.0), req("b", tenant="big", at=5.0))
    assert [e.request_id for e in decide(state(queue=queue, shares=shares)).queue] == ["b", "s"]


def test_equal_tenants_go_by_age_and_a_flood_interleaves():
    flood = tuple(req(f"a{i}", tenant="a", at=float(i)) for i in range(5))
    d = decide(state(queue=(*flood, req("b0", tenant="b", at=100.0))))
    order = [e.request_id for e in d.queue]
    assert order[:3] == ["a0", "b0", "a1"]


# ---- EASY backfill ----------------------------------------------------------------------------


def _backfill_fleet():
    # domain a: a0, a1 free; a2, a3 busy until NOW+100. Domain b: b0 free. The head wants 4.
    nodes = fleet(a=4, b=1)
    busy = (running("x", "a2", "a3", end=NOW + 100),)
    return nodes, busy


def test_the_head_reserves_the_nodes_that_free_first():
    nodes, busy = _backfill_fleet()
    d = decide(state(nodes=nodes, allocations=busy, queue=(req("head", 4, at=0.0),)))
    (head,) = d.heads
    assert head.request_id == "head" and head.start == NOW + 100
    assert head.node_ids == ("a0", "a1", "a2", "a3")


@pytest.mark.parametrize(
    ("duration", "backfills"),
    [(50.0, True), (100.0, True), (150.0, False), (None, False)],
)
def test_backfill_onto_the_heads_nodes_only_if_it_finishes_before_the_heads_start(duration, backfills):
    nodes, busy = _backfill_fleet()
    queue = (req("head", 4, at=0.0), req("small", 2, at=1.0, expected_duration_s=duration))
    d = decide(state(nodes=nodes, allocations=busy, queue=queue))
    assert ("small" in placed(d)) is backfills
    if backfills:
        assert d.placements[0].backfilled
    assert d.heads[0].start == NOW + 100


def test_backfill_outside_the_heads_nodes_needs_no_duration():
    nodes, busy = _backfill_fleet()
    queue = (req("head", 4, at=0.0), req("tiny", 1, at=1.0))
    d = decide(state(nodes=nodes, allocations=busy, queue=queue))
    assert placed(d) == {"tiny": ("b0",)}


def test_a_head_with_an_unknown_start_holds_its_nodes_outright():
    nodes = fleet(a=2)
    queue = (req("head", 2, at=0.0), req("short", 1, at=1.0, expected_duration_s=1.0))
    d = decide(state(nodes=nodes, allocations=(running("x", "a1"),), queue=queue))
    assert placed(d) == {}
    assert d.heads[0].start is None
    assert all(e.estimated_start is None for e in d.queue)


def test_estimated_starts_follow_the_running_ends_and_the_queue_ahead():
    nodes = fleet(a=2)
    busy = (running("x", "a0", end=NOW + 100), running("y", "a1", end=NOW + 300))
    queue = (req("first", 1, at=0.0, expected_duration_s=500.0), req("second", 1, at=1.0, expected_duration_s=10.0))
    d = decide(state(nodes=nodes, allocations=busy, queue=queue))
    est = {e.request_id: (e.position, e.estimated_start) for e in d.queue}
    assert est == {"first": (1, NOW + 100), "second": (2, NOW + 300)}


# ---- preemption -------------------------------------------------------------------------------


def test_on_demand_takes_back_preemptible_nodes_only_when_it_must():
    nodes = fleet(a=3)
    spot = (running("s1", "a0", tier="preemptible"), running("s2", "a1", tier="preemptible"))
    d = decide(state(nodes=nodes, allocations=spot, queue=(req("one", 1),)))
    assert placed(d) == {"one": ("a2",)} and d.preemptions == ()
    d = decide(state(nodes=nodes, allocations=spot, queue=(req("two", 2),)))
    assert placed(d) == {"two": ("a0", "a2")} or placed(d) == {"two": ("a1", "a2")}
    assert len(d.preemptions) == 1 and d.placements[0].preempts == (d.preemptions[0].allocation_id,)


def test_preemption_prefers_the_domain_that_takes_back_the_least():
    nodes = fleet(a=2, b=2)
    spot = (running("big", "a0", "a1", tier="preemptible"), running("small", "b0", tier="preemptible"))
    d = decide(state(nodes=nodes, allocations=spot, queue=(req("r", 2),)))
    assert placed(d) == {"r": ("b0", "b1")}
    assert [p.allocation_id for p in d.preemptions] == ["small"]


def test_on_demand_never_preempts_on_demand_and_preemptible_never_preempts():
    nodes = fleet(a=1)
    d = decide(state(nodes=nodes, allocations=(running("od", "a0", end=NOW + 5),), queue=(req("r", 1),)))
    assert d.preemptions == () and placed(d) == {}
    d = decide(
        state(nodes=nodes, allocations=(running("s", "a0", tier="preemptible"),), queue=(req("p", tier="preemptible"),))
    )
    assert d.preemptions == () and placed(d) == {}


def test_preemptible_requests_take_leftovers_after_on_demand():
    nodes = fleet(a=2)
    queue = (req("spot", 1, at=0.0, tier="preemptible"), req("od", 2, at=5.0))
    d = decide(state(nodes=nodes, queue=queue))
    assert placed(d) == {"od": ("a0", "a1")}
    assert [e.request_id for e in d.queue] == ["spot"]


# ---- expiry -----------------------------------------------------------------------------------


def test_a_request_past_its_max_wait_expires_and_one_with_room_is_placed_anyway():
    nodes = fleet(a=1)
    busy = (running("x", "a0", end=NOW + 100),)
    queue = (req("late", 1, at=NOW - 61, max_wait_s=60.0), req("patient", 1, at=NOW - 61, max_wait_s=600.0))
    d = decide(state(nodes=nodes, allocations=busy, queue=queue))
    assert [e.request_id for e in d.expired] == ["late"]
    assert [e.request_id for e in d.queue] == ["patient"]
    d = decide(state(nodes=nodes, queue=(req("fail-mode", 1, at=NOW, max_wait_s=0.0),)))
    assert placed(d) == {"fail-mode": ("a0",)} and d.expired == ()


# ---- capacity reservations --------------------------------------------------------------------

SETTINGS = PolicySettings(lead_time_s=1_000.0, preemption_notice_s=100.0)


def test_a_reservation_within_its_lead_time_holds_its_nodes_back():
    booking = CapacityReservation("res", "t2", H100, 2, start=NOW + 500, end=NOW + 5_000)
    queue = (
        req("forever", 2, at=0.0),
        req("short", 1, at=1.0, expected_duration_s=400.0),
        req("long", 1, at=2.0, expected_duration_s=600.0),
    )
    d = decide(state(nodes=fleet(a=2), queue=queue, reservations=(booking,), settings=SETTINGS))
    assert placed(d) == {"short": ("a0",)}  # finishes before the window; the others would not
    assert d.reservations[0].state == "held" and d.reservations[0].node_ids == ("a0", "a1")


def test_a_reservation_beyond_its_lead_time_holds_nothing():
    booking = CapacityReservation("res", "t2", H100, 2, start=NOW + 5_000, end=NOW + 9_000)
    d = decide(state(nodes=fleet(a=2), queue=(req("r", 2),), reservations=(booking,), settings=SETTINGS))
    assert placed(d) == {"r": ("a0", "a1")} and d.reservations == ()


def test_preemptible_work_gets_notice_before_the_window_and_the_reservation_is_placed_at_its_start():
    booking = CapacityReservation("res", "t2", H100, 2, start=NOW + 50, end=NOW + 5_000)
    spot = (running("s", "a0", tier="preemptible"),)
    d = decide(state(nodes=fleet(a=2), allocations=spot, reservations=(booking,), settings=SETTINGS))
    assert [(p.allocation_id, p.for_id) for p in d.preemptions] == [("s", "res")]
    assert d.placements == () and d.reservations[0].state == "held"
    d = decide(state(now=NOW + 50, nodes=fleet(a=2), allocations=spot, reservations=(booking,), settings=SETTINGS))
    (p,) = d.placements
    assert (p.id, p.tier, p.node_ids, p.preempts) == ("res", "reserved", ("a0", "a1"), ("s",))


def test_a_reservation_at_its_start_goes_before_the_queue():
    booking = CapacityReservation("res", "t2", H100, 2, start=NOW, end=NOW + 100)
    d = decide(state(nodes=fleet(a=2, b=1), queue=(req("early", 2, at=0.0),), reservations=(booking,)))
    assert placed(d) == {"res": ("a0", "a1")}


def test_a_reservation_blocked_by_on_demand_work_is_late_not_dropped_and_one_past_its_end_stops():
    booking = CapacityReservation("res", "t2", H100, 1, start=NOW, end=NOW + 100)
    d = decide(state(nodes=fleet(a=1), allocations=(running("od", "a0"),), reservations=(booking,)))
    assert d.placements == () and d.reservations[0].state == "late"
    mine = running("mine", "a0", reservation_id="res")
    d = decide(state(now=NOW + 100, nodes=fleet(a=1), allocations=(mine,), reservations=(booking,)))
    assert d.ended == ("mine",)


def test_pools_are_decided_apart():
    other = Pool("a100", "eu-west")
    nodes = (*fleet(a=1), Node("z0", other, "z"))
    queue = (req("h", 1), QueuedRequest("o", "t1", other, 1, submitted_at=0.0))
    assert placed(decide(state(nodes=nodes, queue=queue))) == {"h": ("a0",), "o": ("z0",)}


def test_the_worked_example():
    """The policy docstring's worked example, as written there."""
    nodes = fleet(a=4, b=1)
    queue = (
        req("head", 4, at=0.0, expected_duration_s=1000.0),
        req("small", 2, at=1.0, expected_duration_s=50.0),
        req("long", 2, at=2.0, expected_duration_s=150.0),
        req("tiny", 1, at=3.0),
    )
    d = decide(state(now=0.0, nodes=nodes, allocations=(running("x", "a2", "a3", end=100.0),), queue=queue))
    assert placed(d) == {"small": ("a0", "a1"), "tiny": ("b0",)}
    assert [(e.request_id, e.position, e.estimated_start) for e in d.queue] == [("head", 1, 100.0), ("long", 2, 1100.0)]
    spot = (running("x", "a2", "a3", tier="preemptible"),)
    d = decide(state(now=0.0, nodes=nodes, allocations=spot, queue=queue))
    assert placed(d)["head"] == ("a0", "a1", "a2", "a3") and d.placements[0].preempts == ("x",)


def test_a_request_whose_preemptions_are_under_way_waits_instead_of_preempting_more():
    nodes = fleet(a=4)
    spare = (running("p1", "a0", "a1", tier="preemptible"), running("p2", "a2", "a3", tier="preemptible"))
    first = decide(state(nodes=nodes, allocations=spare, queue=(req("r", 2),)))
    assert len(first.preemptions) == 1 and first.placements[0].preempts == (first.preemptions[0].allocation_id,)
    # The next plan, the victim still runs out its notice: the request waits for it.
    again = decide(state(nodes=nodes, allocations=spare, queue=(req("r", 2, may_preempt=False),)))
    assert again.preemptions == () and again.placements == ()
    assert [e.request_id for e in again.queue] == ["r"]


def test_the_head_keeps_its_reservation_while_fair_share_order_moves():
    nodes = fleet(a=4)
    busy = (running("r", "a0", "a1", "a2", "a3", end=NOW + 100),)
    queue = (req("big", 4, tenant="t1", expected_duration_s=50), req("other", 4, tenant="t2", expected_duration_s=50))

    def shares(t1: float, t2: float) -> tuple[TenantShare, ...]:
        return (
            TenantShare("t1", H100, usage_node_s=t1, usage_as_of=NOW),
            TenantShare("t2", H100, usage_node_s=t2, usage_as_of=NOW),
        )

    first = decide(state(nodes=nodes, allocations=busy, queue=queue, shares=shares(10.0, 1_000.0)))
    assert [h.request_id for h in first.heads] == ["big"]
    # t1's usage has since grown past t2's: by fair share alone, `other` would take the reservation.
    flipped = shares(5_000.0, 1_000.0)
    assert [h.request_id for h in decide(state(nodes=nodes, allocations=busy, queue=queue, shares=flipped)).heads] == [
        "other"
    ]
    kept = decide(state(nodes=nodes, allocations=busy, queue=queue, shares=flipped, heads=("big",)))
    assert [h.request_id for h in kept.heads] == ["big"] and kept.queue[0].request_id == "big"
