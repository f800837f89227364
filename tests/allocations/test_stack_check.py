"""The stack against the policy (`gpucloud.scheduler.stack_check`): the comparison finds a request
placed out of the policy's order and one placed by only one side, and ties within the tolerance
are not counted against the stack; the replay with the stack's service times places as the
policy does, holding nodes through provisioning, the run and their way back."""

from __future__ import annotations

import pytest

from gpucloud.scheduler.policy import Node, PolicySettings, Pool
from gpucloud.scheduler.replay import fifo_decide
from gpucloud.scheduler.stack_check import (
    AllocationRecord,
    NodeRecord,
    SampleRequest,
    Service,
    audit,
    compare,
    kendall_tau,
    replay_observed,
    reserved_while_held,
    state_at,
)

pytestmark = pytest.mark.unit

POOL = Pool("H100", "r1")


def test_the_same_order_matches_and_ties_within_the_tolerance_are_not_inversions():
    policy = {"a": 0.0, "b": 5.0, "c": 10.0, "d": 10.2}
    stack = {"a": 0.4, "b": 5.3, "c": 10.9, "d": 10.5}  # c and d 0.2 s apart in the policy: a tie
    agreement = compare(stack, policy, tolerance_s=1.0)
    assert agreement.order_matches == 1.0 and agreement.inversions == 0 and agreement.mismatched == ()
    assert agreement.placed_both == 4 and agreement.start_diff_max_s == pytest.approx(0.9)


def test_a_request_started_out_of_the_policys_order_is_a_mismatch_for_both_of_the_pair():
    policy = {"a": 0.0, "b": 5.0, "c": 10.0, "d": 20.0}
    stack = {"a": 0.0, "b": 12.0, "c": 10.0, "d": 20.0}  # the stack started c 2 s before b
    agreement = compare(stack, policy, tolerance_s=1.0)
    assert agreement.inversions == 1 and agreement.mismatched == ("b", "c")
    assert agreement.order_matches == 0.5
    # Beyond what the tolerance absorbs only: with 3 s of it the pair is a tie.
    assert compare(stack, policy, tolerance_s=3.0).order_matches == 1.0


def test_a_request_placed_by_one_side_only_is_a_mismatch():
    agreement = compare({"a": 0.0, "b": None, "c": 3.0}, {"a": 0.0, "b": 1.0, "c": None}, tolerance_s=1.0)
    assert (agreement.placed_both, agreement.placed_stack_only, agreement.placed_policy_only) == (1, 1, 1)
    assert agreement.mismatched == ("b", "c") and agreement.order_matches == pytest.approx(1 / 3)
    assert compare({"a": None}, {"a": None}, tolerance_s=1.0).order_matches == 1.0  # neither placed it
    with pytest.raises(ValueError, match="different requests"):
        compare({"a": 0.0}, {"b": 0.0}, tolerance_s=1.0)


def test_kendall_tau():
    assert kendall_tau([(0, 0), (1, 1), (2, 2)]) == 1.0
    assert kendall_tau([(0, 2), (1, 1), (2, 0)]) == -1.0
    assert kendall_tau([(0, 0)]) is None
    assert kendall_tau([(0, 0), (0, 1)]) is None  # x all ties


def _nodes(count: int, per_domain: int) -> list[Node]:
    return [Node(f"n{i}", POOL, f"d{i // per_domain}") for i in range(count)]


def test_a_placement_holds_its_nodes_through_provisioning_the_run_and_their_way_back():
    requests = [SampleRequest("a", "t", 2, 0.0, 5.0), SampleRequest("b", "t", 1, 1.0, 5.0)]
    services = {"a": Service(1.0, 5.0, (2.0, 3.0))}  # ready at 1, cancelled at 6, nodes back at 8 and 9
    starts = replay_observed(requests, _nodes(2, 2), services)
    assert starts == {"a": 0.0, "b": 8.0}  # b never placed by the stack: it gets the median service


def test_the_replay_backfills_as_the_policy_does_and_fifo_does_not():
    # 8 nodes in one domain: `a` holds 6 until t=6 (expected and actual); `head` wants all 8;
    # `small` (2 nodes, 2 s) fits before the head's start, `long` (2 nodes, 30 s) does not.
    requests = [
        SampleRequest("a", "t1", 6, 0.0, 6.0),
        SampleRequest("head", "t2", 8, 0.5, 3.0),
        SampleRequest("small", "t1", 2, 1.0, 2.0),
        SampleRequest("long", "t2", 2, 1.5, 30.0),
    ]
    services = {r.id: Service(0.0, r.expected_s, (0.0,) * r.nodes) for r in requests}
    policy = replay_observed(requests, _nodes(8, 8), services)
    assert policy == {"a": 0.0, "head": 6.0, "small": 1.0, "long": 9.0}
    fifo = replay_observed(requests, _nodes(8, 8), services, decide_fn=fifo_decide)
    assert fifo == {"a": 0.0, "head": 6.0, "small": 9.0, "long": 9.0}
    assert compare(fifo, policy, tolerance_s=1.0).mismatched == ("head", "small")


def test_the_returning_states_are_the_stacks():
    """The audit counts a node as held in exactly the states the stack's plans do
    (`models.node_states.RETURNING_TO_POOL`, read by `services.scheduling.pool_state`), and as
    free only when available."""
    from gpucloud.models.node_states import RETURNING_TO_POOL, NodeState

    nodes = [NodeRecord(f"n-{s}", "d0", ((0.0, str(s)),)) for s in NodeState]
    seen = state_at(1.0, [], nodes, POOL, PolicySettings()).nodes
    assert {n.id.removeprefix("n-") for n in seen if n.held} == {str(s) for s in RETURNING_TO_POOL}
    assert [n.id for n in seen if not n.held] == ["n-available"]


def _records(placed: dict[str, float]) -> list[AllocationRecord]:
    """The backfill case on 8 nodes n0..n7: `a` on n0-n5, cancelled at 6, its nodes back at 7; `head`
    wants 8; `small` (2 s) fits on n6, n7 before the head's start at 6, `long` (30 s) does not. A
    placed request runs its expected time, is released half a second later, its nodes back after
    another half second."""
    a = AllocationRecord("a", "t1", 6, 6.0, 0.0, 0.0, tuple(f"n{i}" for i in range(6)), 6.0, 6.5)
    queued = [
        ("head", "t2", 8, 3.0, 0.5, tuple(f"n{i}" for i in range(8))),
        ("small", "t1", 2, 2.0, 1.0, ("n6", "n7")),
        ("long", "t2", 2, 30.0, 1.5, ("n6", "n7")),
    ]
    records = [a]
    for rid, tenant, count, expected, created, nodes in queued:
        at = placed.get(rid)
        cancel = None if at is None else at + expected
        records.append(
            AllocationRecord(
                rid, tenant, count, expected, created, at, nodes, cancel, None if cancel is None else cancel + 0.5
            )
        )
    return records


def _node_records(placed: dict[str, float]) -> list[NodeRecord]:
    nodes = [NodeRecord(f"n{i}", "d0", ((-1.0, "available"), (0.0, "reserved"), (7.0, "available"))) for i in range(6)]
    moves: list[tuple[float, str]] = [(-1.0, "available")]
    for rid, expected in (("small", 2.0), ("long", 30.0)):
        if rid in placed:
            moves += [(placed[rid], "reserved"), (placed[rid] + expected + 1.0, "available")]
    return nodes + [NodeRecord(f"n{i}", "d0", tuple(moves)) for i in (6, 7)]


def _audit(placed: dict[str, float]):
    return audit(
        _records(placed), _node_records(placed), pool=POOL, settings=PolicySettings(), poll_s=0.5, tolerance_s=1.0
    )


def test_the_audit_passes_placements_made_as_the_policy_decides():
    checked = _audit({"small": 1.0, "head": 7.5})
    assert (checked.placed, checked.as_decided, checked.late, checked.not_decided) == (3, 3, 0, ())
    assert checked.matches == 0.75  # `long` never placed: it counts against the stack


def test_the_audit_finds_a_placement_the_policy_did_not_make_and_one_made_late():
    # `long` placed at 1 onto the nodes `small` should have had (it would delay the head).
    wrong = _audit({"long": 1.0})
    assert wrong.not_decided == ("long",) and wrong.as_decided == 1
    # `small` placed at 3.5 though every decision from 1.0 on placed it.
    late = _audit({"small": 3.5, "head": 7.5})
    assert late.late_examples == ("small",) and late.as_decided == 3 and late.late == 1
    assert late.lag_max_s == 2.5 and _audit({"small": 1.0, "head": 7.5}).lag_max_s == 0.0


def test_a_plan_that_read_its_rows_a_moment_late_is_checked_on_the_state_it_read():
    # The plan at 6.9 placed `head`: it read its rows once a's nodes were back (7.0), and its own
    # reservations followed (7.1); one node was then pulled (7.2). On the state at 6.9 the head
    # did not fit, nor at the slack's end: it is checked on the moment the nodes were all free.
    placed = {"small": 1.0, "head": 6.9}
    back_then_taken = ((-1.0, "available"), (0.0, "reserved"), (7.0, "available"), (7.1, "reserved"))
    nodes = [NodeRecord(f"n{i}", "d0", back_then_taken) for i in range(1, 6)]
    nodes.append(NodeRecord("n0", "d0", (*back_then_taken[:3], (7.2, "draining"))))
    small = ((-1.0, "available"), (1.0, "reserved"), (4.0, "available"), (7.1, "reserved"))
    nodes += [NodeRecord(f"n{i}", "d0", small) for i in (6, 7)]

    def checked(slack: float):
        return audit(
            _records(placed),
            nodes,
            pool=POOL,
            settings=PolicySettings(),
            poll_s=0.5,
            tolerance_s=1.0,
            read_slack_s=slack,
        )

    assert checked(0.0).not_decided == ("head",)
    assert checked(0.5).not_decided == () and checked(0.5).as_decided == 3
    assert checked(0.05).not_decided == ("head",)  # a slack that ends before the nodes came back


def test_the_sample_is_on_demand_requests_time_compressed_with_the_load_kept():
    import sys
    from pathlib import Path

    from gpucloud.scheduler.replay import TraceJob

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from scheduling_stack import compress

    jobs = [
        TraceJob("j1", 0.0, 1, 60.0, "a"),
        TraceJob("j2", 100.0, 2, 600.0, "b"),
        TraceJob("j3", 150.0, 1, 60.0, "spot", tier="preemptible"),
        TraceJob("j4", 200.0, 4, 86_400.0, "a"),
        TraceJob("j5", 300.0, 8, 7200.0, "r", reserve_at_s=9000.0),
        TraceJob("j6", 400.0, 1, 30.0, "b"),
    ]
    sample = compress(jobs, 3, since_s=50.0, span_s=10.0, fleet_ratio=2.0, max_runtime_s=100.0)
    # j2, j4, j6 (not the preemptible one, not the reservation), 300 trace seconds over 10 s of
    # submissions at half the fleet: runtimes divided by 300 * 2 / 10 = 60, gaps by 30.
    assert sample.factor == 60.0
    assert [(r.id, r.submit_s, r.nodes, r.expected_s) for r in sample.requests] == [
        ("j2", 0.0, 2, 10.0),
        ("j4", 3.333, 4, 100.0),  # 1,440 s cut at the limit
        ("j6", 10.0, 1, 1.0),  # 0.5 s rounds up to the least whole second
    ]
    with pytest.raises(ValueError, match="2 on-demand requests"):
        compress(jobs, 5, since_s=150.0, span_s=10.0, fleet_ratio=1.0)


def test_a_node_reserved_again_before_it_came_back_is_an_overlap_whatever_the_clocks_say():
    back_and_again = [
        ("n0", "reserved", "reserve-a"),
        ("n0", "provisioning", None),
        ("n0", "wiping", None),
        ("n0", "available", None),
        ("n0", "reserved", "reserve-b"),
        ("n1", "reserved", "replace-a"),  # a replacement holds its node for the same allocation
        ("n1", "reserved", "reserve-a"),
    ]
    assert reserved_while_held(back_and_again) == 0
    taken_while_held = [*back_and_again, ("n0", "reserved", "reserve-c"), ("n1", "reserved", "replace-d")]
    assert reserved_while_held(taken_while_held) == 2


def test_a_plan_keeps_the_head_the_last_plan_left_and_the_audit_reads_it_from_the_watch():
    # `big` (t1) holds n0-n3 until 10, back at 10.5. `x` (t2, no usage) goes first by fair share,
    # but the stack's plans had promised `y` (t1) the next start: the plan at 11 keeps `y` first.
    four = tuple(f"n{i}" for i in range(4))
    allocations = [
        AllocationRecord("big", "t1", 4, 10.0, 0.0, 0.0, four, 10.0, 10.2),
        AllocationRecord("x", "t2", 4, 5.0, 1.0, 22.0, four, 27.0, 27.2),
        AllocationRecord("y", "t1", 4, 10.0, 2.0, 11.0, four, 21.0, 21.2),
    ]
    moves = ((-1.0, "available"), (0.0, "reserved"), (10.5, "available"), (11.0, "reserved"))
    moves += ((21.5, "available"), (22.0, "reserved"), (27.5, "available"))
    nodes = [NodeRecord(n, "d0", moves) for n in four]

    def checked(**watch):
        return audit(allocations, nodes, pool=POOL, settings=PolicySettings(), poll_s=0.5, tolerance_s=1.0, **watch)

    assert checked().not_decided == ("y",)  # without the head, fair share places `x` at 11
    kept = checked(heads_seen=[(0.0, ()), (2.5, ("y",)), (11.2, ("x",))], watch_s=0.2)
    assert kept.not_decided == () and kept.as_decided == 3
    # A head seen only well after the plan is not the one it read.
    assert checked(heads_seen=[(0.0, ()), (11.2, ("y",))], watch_s=0.2).not_decided == ("y",)
