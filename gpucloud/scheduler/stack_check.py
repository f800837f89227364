"""Does the stack do what the policy decides? (issue 43, `stack_matches_policy`)

A sample of a trace is run through the real stack (API, workflows, simulated fleet; the driver is
`benchmarks/scheduling_stack.py`), which records when each request was submitted and placed and
what each placement then took: provisioning (placed -> ready), the run (ready -> cancel) and each
node's way back to the pool (cancel -> available again, through release, wipe and burn-in). This
module, pure like the policy, answers two questions about such a run:

- `replay_observed`: where would the policy alone have placed the same requests, on a fleet of
  the same nodes and fabric domains, if every placement took exactly what the stack's took? It
  is a discrete-event replay that calls `decide()` after every event (a submission, a cancel, a
  node back) and carries out its placements at once. It sees what the stack's plans see
  (`services/scheduling.pool_state`): a running allocation busy until `placed + expected_duration`
  (clamped to now), a node on its way back held for an unknown time, the tenants' usage as the
  node-seconds their allocations held from placement to cancel. A request the stack never placed
  runs the sample's median service in the replay.
- `compare`: how far the stack's placements are from the replay's. The service times are the
  stack's own, so what is left to differ is the decisions and when they were made: the stack plans
  a pool every `scheduler.poll_s` (and at a create), the replay at every event. `tolerance_s`
  absorbs that: two starts closer than it are a tie.

`stack_matches_policy` is `Agreement.order_matches`: the fraction of the sample's requests placed
in the policy's order. A request matches when both placed it (or neither did) and no other request
is out of order with it beyond the tolerance: none the policy started more than `tolerance_s`
before it that the stack started more than `tolerance_s` after it, nor the other way round. One
request placed out of turn therefore costs every request it overtook or that overtook it.
`kendall_tau` (over the requests both placed) and the absolute start differences come with it;
the absolute differences also carry the drift of a schedule that ran a little late everywhere,
which the order measures do not count against the stack.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpucloud.models.node_states import RETURNING_TO_POOL
from gpucloud.scheduler.policy import (
    Allocation,
    Decision,
    Node,
    PolicySettings,
    Pool,
    QueuedRequest,
    SchedulerState,
    TenantShare,
    decide,
)


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request of the sample, on the run's clock (seconds from its start)."""

    id: str
    tenant: str
    nodes: int
    submit_s: float
    expected_s: float  # the `expected_duration_s` it was created with


@dataclass(frozen=True, slots=True)
class Service:
    """What the stack took for one placed request: placed -> ready, ready -> cancel, and each of
    its nodes' cancel -> available again."""

    provision_s: float
    run_s: float
    return_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Agreement:
    requests: int
    placed_both: int
    placed_stack_only: int
    placed_policy_only: int
    order_matches: float  # `stack_matches_policy` (see the module docstring)
    inversions: int  # pairs out of order beyond the tolerance
    kendall_tau: float | None
    start_diff_p50_s: float | None
    start_diff_p99_s: float | None
    start_diff_max_s: float | None
    tolerance_s: float
    mismatched: tuple[str, ...]  # the first few requests that do not match, for reading


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def kendall_tau(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Kendall's tau-b of (x, y) pairs: 1 when y orders them as x does, -1 reversed; ties count
    as neither. None for fewer than two pairs or when either side is all ties."""
    n = len(pairs)
    if n < 2:
        return None
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        xi, yi = pairs[i]
        for j in range(i + 1, n):
            dx, dy = pairs[j][0] - xi, pairs[j][1] - yi
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return None if denominator == 0 else (concordant - discordant) / denominator


def compare(stack: Mapping[str, float | None], policy: Mapping[str, float | None], *, tolerance_s: float) -> Agreement:
    """The stack's starts against the policy's for the same requests (see the module docstring).
    Both map every request of the sample to its start (None: never placed); a request missing
    from one side is a ValueError."""
    if set(stack) != set(policy):
        missing = sorted(set(stack) ^ set(policy))
        raise ValueError(f"the two runs hold different requests, e.g. {missing[:3]}")
    ids = sorted(stack)
    both = [r for r in ids if stack[r] is not None and policy[r] is not None]
    bad: set[str] = {r for r in ids if (stack[r] is None) != (policy[r] is None)}
    inversions = 0
    starts = [(r, policy[r], stack[r]) for r in both]
    starts.sort(key=lambda x: x[1])  # type: ignore[arg-type, return-value]
    for i, (r, p_r, s_r) in enumerate(starts):
        assert p_r is not None and s_r is not None
        for s, p_s, s_s in starts[i + 1 :]:
            assert p_s is not None and s_s is not None
            # Sorted by the policy's start: p_s >= p_r. Out of order when the policy clearly
            # started r first and the stack clearly started s first.
            if p_s - p_r > tolerance_s and s_r - s_s > tolerance_s:
                inversions += 1
                bad.update((r, s))
    diffs = [abs(float(stack[r]) - float(policy[r])) for r in both]  # type: ignore[arg-type]
    tau = kendall_tau([(float(policy[r]), float(stack[r])) for r in both])  # type: ignore[arg-type]
    return Agreement(
        requests=len(ids),
        placed_both=len(both),
        placed_stack_only=sum(1 for r in ids if stack[r] is not None and policy[r] is None),
        placed_policy_only=sum(1 for r in ids if stack[r] is None and policy[r] is not None),
        order_matches=(len(ids) - len(bad)) / len(ids) if ids else 1.0,
        inversions=inversions,
        kendall_tau=tau,
        start_diff_p50_s=_pct(diffs, 0.5),
        start_diff_p99_s=_pct(diffs, 0.99),
        start_diff_max_s=max(diffs, default=None),
        tolerance_s=tolerance_s,
        mismatched=tuple(sorted(bad)[:10]),
    )


def median_service(services: Mapping[str, Service]) -> Service:
    """The sample's median provisioning, run and return (for a request the stack never placed)."""
    if not services:
        return Service(0.0, 0.0, ())
    prov = _pct([s.provision_s for s in services.values()], 0.5) or 0.0
    run = _pct([s.run_s for s in services.values()], 0.5) or 0.0
    back = _pct([x for s in services.values() for x in s.return_s], 0.5) or 0.0
    return Service(prov, run, (back,))


def replay_observed(
    requests: Sequence[SampleRequest],
    nodes: Sequence[Node],
    services: Mapping[str, Service],
    *,
    settings: PolicySettings | None = None,
    decide_fn: Callable[[SchedulerState], Decision] = decide,
) -> dict[str, float | None]:
    """Each request's start when the policy alone places the sample on `nodes` and every placement
    takes what the stack's took (see the module docstring); None: never placed. `decide_fn`: another
    policy in its place (`replay.fifo_decide`, to show what a different policy looks like)."""
    settings = settings or PolicySettings()
    if not nodes:
        raise ValueError("no nodes")
    pool = nodes[0].pool
    by_id = {r.id: r for r in requests}
    fallback = median_service(services)
    events: list[tuple[float, int, str, str]] = []
    seq = 0

    def push(at: float, kind: str, payload: str) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, payload))

    for r in requests:
        push(r.submit_s, "submit", r.id)
    queue: dict[str, QueuedRequest] = {}
    running: dict[str, Allocation] = {}
    returning: set[str] = set()
    held: list[tuple[str, int, float, float | None]] = []  # (tenant, nodes, placed, cancelled)
    held_index: dict[str, int] = {}
    starts: dict[str, float | None] = dict.fromkeys(by_id)
    node_list = tuple(nodes)
    now = 0.0
    while events:
        now = events[0][0]
        while events and events[0][0] <= now:
            _, _, kind, payload = heapq.heappop(events)
            if kind == "submit":
                r = by_id[payload]
                queue[r.id] = QueuedRequest(r.id, r.tenant, pool, r.nodes, r.submit_s, None, r.expected_s)
            elif kind == "cancel":
                alloc = running.pop(payload)
                tenant, count, placed, _ = held[held_index[payload]]
                held[held_index[payload]] = (tenant, count, placed, now)
                service = services.get(payload, fallback)
                back = sorted(service.return_s) or [0.0]
                for i, node in enumerate(sorted(alloc.node_ids)):
                    returning.add(node)
                    push(now + back[min(i, len(back) - 1)], "back", node)
            elif kind == "back":
                returning.discard(payload)
        usage: dict[str, float] = defaultdict(float)
        for tenant, count, placed, cancelled in held:
            usage[tenant] += count * ((now if cancelled is None else cancelled) - placed)
        state = SchedulerState(
            now=now,
            nodes=tuple(Node(n.id, n.pool, n.fabric_domain, held=True) if n.id in returning else n for n in node_list),
            allocations=tuple(running.values()),
            queue=tuple(queue.values()),
            shares=tuple(TenantShare(t, pool, 1.0, u, now) for t, u in sorted(usage.items())),
            settings=settings,
        )
        decision = decide_fn(state)
        for placement in decision.placements:
            request = queue.pop(placement.id, None)
            if request is None:
                continue
            starts[request.id] = now
            expected = request.expected_duration_s
            running[request.id] = Allocation(
                request.id,
                request.tenant,
                pool,
                placement.node_ids,
                expected_end=None if expected is None else now + expected,
            )
            held_index[request.id] = len(held)
            held.append((request.tenant, request.node_count, now, None))
            service = services.get(request.id, fallback)
            push(now + service.provision_s + service.run_s, "cancel", request.id)
        for expiry in decision.expired:
            queue.pop(expiry.request_id, None)
    return starts


# ---- the decision audit -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    """One allocation as the stack's database recorded it (seconds on the run's clock).
    `ended`: when it became terminal (released, or failed), None while it is not."""

    id: str
    tenant: str
    node_count: int
    expected_s: float | None
    created: float
    placed: float | None
    node_ids: tuple[str, ...]
    cancel_requested: float | None
    ended: float | None


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A node and its state changes, `(at, to_state)` in the order they were written."""

    id: str
    fabric_domain: str
    transitions: tuple[tuple[float, str], ...]
    first_state: str = "enrolled"


@dataclass(frozen=True, slots=True)
class Audit:
    requests: int
    placed: int
    as_decided: int  # placed at an instant whose decision, on the stack's state then, placed it
    matches: float  # `stack_matches_policy`: placed as decided, over the requests
    late: int  # decided without a break for more than the tolerance before the stack placed it
    instants: int  # decisions audited
    tolerance_s: float
    read_slack_s: float
    not_decided: tuple[str, ...]  # the first few placed where the decision did not place them
    late_examples: tuple[str, ...]
    # From the start of a placement's unbroken run of decisions that placed it to the placement
    # (0 when the decision at its own instant was the first), over the placements as decided.
    lag_p50_s: float | None = None
    lag_p99_s: float | None = None
    lag_max_s: float | None = None


def reserved_while_held(transitions: Iterable[tuple[str, str, str | None]]) -> int:
    """How many times a node was reserved for an allocation while another still held it, from the
    nodes' transitions `(node, to_state, op_id)` in the order they were written: a reservation for
    a placement (`op_id` `reserve-<allocation>`) or a replacement (`replace-<allocation>`) holds the
    node until it is next `available`. Clock-free: an allocation's `released` event is written after
    its nodes are released, and a node wiped in no time may be placed again before it."""
    holder: dict[str, str | None] = {}
    overlaps = 0
    for node, to_state, op_id in transitions:
        if to_state == "available":
            holder[node] = None
        elif to_state == "reserved" and op_id is not None and op_id.startswith(("reserve-", "replace-")):
            allocation = op_id.split("-", 1)[1]
            if holder.get(node) not in (None, allocation):
                overlaps += 1
            holder[node] = allocation
    return overlaps


def _decayed(count: int, start: float, end: float, now: float, half_life_s: float) -> float:
    """∫ count · 2^-((now - t)/h) dt over [start, end], as the stack's `_usage` counts it."""
    if end <= start:
        return 0.0
    k = math.log(2) / half_life_s
    return count / k * (math.exp(-k * (now - end)) - math.exp(-k * (now - start)))


def state_at(
    t: float,
    allocations: Sequence[AllocationRecord],
    nodes: Sequence[NodeRecord],
    pool: Pool,
    settings: PolicySettings,
    *,
    nodes_as_of: float | None = None,
    heads: Sequence[str] = (),
) -> SchedulerState:
    """The policy's view of the pool at `t`, rebuilt from the records as the stack's plans read it
    from the rows (`services.scheduling.pool_state`): an allocation placed at `t` is still queued
    (its plan decided at `t`); a running one is busy until `placed + expected_s` (now once its
    cancel was asked for); a node of none is free when available, held while on its way back.
    `nodes_as_of`: the nodes' states as of then instead (a plan reads its rows a moment after its
    `now`, and a node may have come back in that moment). `heads`: the queue's head as the last plan
    left it, which this one keeps first while it is queued."""
    as_of = t if nodes_as_of is None else nodes_as_of
    running: list[Allocation] = []
    queue: list[QueuedRequest] = []
    members: set[str] = set()
    usage: dict[str, float] = defaultdict(float)
    for a in allocations:
        if a.created > t or (a.ended is not None and a.ended <= t):
            if a.placed is not None and a.placed < t and a.ended is not None:
                usage[a.tenant] += _decayed(a.node_count, a.placed, a.ended, t, settings.half_life_s)
            continue
        if a.placed is None or a.placed >= t:
            queue.append(QueuedRequest(a.id, a.tenant, pool, a.node_count, a.created, None, a.expected_s))
            continue
        usage[a.tenant] += _decayed(a.node_count, a.placed, t, t, settings.half_life_s)
        if a.cancel_requested is not None and a.cancel_requested <= t:
            end: float | None = t
        else:
            end = None if a.expected_s is None else a.placed + a.expected_s
        running.append(Allocation(a.id, a.tenant, pool, a.node_ids, expected_end=end))
        members.update(a.node_ids)
    seen: list[Node] = []
    for n in nodes:
        if n.id in members:
            seen.append(Node(n.id, pool, n.fabric_domain))
            continue
        state = n.first_state
        for at, to in n.transitions:  # in the order they were written; times may be a little out of it
            if at > as_of + 5.0:
                break
            # A placement at `t` reserves its nodes at `t`, after its decision: not yet reserved then.
            if at >= as_of or (to == "reserved" and at >= t):
                continue
            state = to
        if state == "available":
            seen.append(Node(n.id, pool, n.fabric_domain))
        elif state in RETURNING_TO_POOL:  # as the stack's plans count them
            seen.append(Node(n.id, pool, n.fabric_domain, held=True))
    tenants = {a.tenant for a in running} | {r.tenant for r in queue} | set(usage)
    return SchedulerState(
        now=t,
        nodes=tuple(seen),
        allocations=tuple(running),
        queue=tuple(queue),
        shares=tuple(TenantShare(x, pool, 1.0, usage.get(x, 0.0), t) for x in sorted(tenants)),
        settings=settings,
        heads=tuple(h for h in heads if h in {r.id for r in queue}),
    )


def audit(
    allocations: Sequence[AllocationRecord],
    nodes: Sequence[NodeRecord],
    *,
    pool: Pool,
    settings: PolicySettings,
    poll_s: float,
    tolerance_s: float,
    read_slack_s: float = 0.0,
    heads_seen: Sequence[tuple[float, tuple[str, ...]]] = (),
    watch_s: float = 0.0,
    decide_fn: Callable[[SchedulerState], Decision] = decide,
) -> Audit:
    """Did each placement the stack made follow the policy's decision on the stack's own state?

    The decision is taken again (`decide_fn`) at every instant the stack placed something (its
    plans', and its creates', `now`) and every `poll_s` between, on the state rebuilt from the
    records (`state_at`). A placement is *as decided* when the decision at its instant places the
    same request too, on the nodes as they were then or, since a plan reads its rows a moment
    after its `now`, as they were at one moment up to `read_slack_s` later (the one under which
    the decision places the most of what the stack placed then). `matches` (`stack_matches_policy`) is
    the fraction of the requests placed as decided (a request never placed counts against it).

    A plan keeps the queue's head as the plan before it left it (`SchedulerState.heads`), which the
    records do not hold: `heads_seen` is the head as a watch of the rows saw it change, `(at, ids)`,
    every `watch_s`. Each decision keeps the head last seen before its instant; a placement is also
    as decided under a head seen from one watch before its instant to the end of the read slack
    (the watch may have seen the rows just before a plan wrote the head the next one read).

    A placement is *late* when every decision for more than `tolerance_s` before it, without a
    break, already placed that request: the stack left a decision that stood unexecuted. A request
    that one decision would have placed and the next would not (a node came back, then a request
    that goes first arrived) is not late: the stack's plans, `poll_s` apart, need not have seen
    that moment."""
    placed_at = {a.id: a.placed for a in allocations if a.placed is not None}
    begin = min((a.created for a in allocations), default=0.0)
    end = max(placed_at.values(), default=begin)
    instants = set(placed_at.values())
    k = 0
    while begin + k * poll_s < end:
        instants.add(begin + k * poll_s)
        k += 1
    decided_since: dict[str, float] = {}  # request -> start of its current unbroken run of decisions
    decided_when_placed: set[str] = set()
    late: set[str] = set()
    lag: dict[str, float] = {}
    seen = sorted(heads_seen)

    def head_before(t: float) -> tuple[str, ...]:
        return next((ids for at, ids in reversed(seen) if at <= t), ())

    for t in sorted(instants):
        head = head_before(t)
        decided = {p.id for p in decide_fn(state_at(t, allocations, nodes, pool, settings, heads=head)).placements}
        placed_now = {r for r, at in placed_at.items() if at == t}
        if (read_slack_s > 0 or seen) and placed_now - decided:
            # The plan read the nodes at one moment of the slack (each state they passed through),
            # and the head as a plan at most a watch before it, or one in the slack, left it.
            moments = {at for n in nodes for at, _ in n.transitions if t < at <= t + read_slack_s}
            maybe_heads = {head} | {ids for at, ids in seen if t - watch_s <= at <= t + read_slack_s}
            best: set[str] = set()
            for as_of in sorted(moments | {t + read_slack_s}):
                for candidate in sorted(maybe_heads):
                    later = state_at(t, allocations, nodes, pool, settings, nodes_as_of=as_of, heads=candidate)
                    if len(found := placed_now & {p.id for p in decide_fn(later).placements}) > len(best):
                        best = found
            decided_when_placed.update(best)
        decided_when_placed.update(placed_now & decided)
        for r in placed_now:
            since = decided_since.get(r)
            lag[r] = 0.0 if since is None else t - since
            if since is not None and t - since > tolerance_s:
                late.add(r)
        decided_since = {r: decided_since.get(r, t) for r in decided}
    not_decided = sorted(set(placed_at) - decided_when_placed)
    lags = [lag[r] for r in decided_when_placed if r in lag]
    return Audit(
        requests=len(allocations),
        placed=len(placed_at),
        as_decided=len(decided_when_placed),
        matches=len(decided_when_placed) / len(allocations) if allocations else 1.0,
        late=len(late),
        instants=len(instants),
        tolerance_s=tolerance_s,
        read_slack_s=read_slack_s,
        not_decided=tuple(not_decided[:10]),
        late_examples=tuple(sorted(late)[:10]),
        lag_p50_s=_pct(lags, 0.5),
        lag_p99_s=_pct(lags, 0.99),
        lag_max_s=max(lags, default=None),
    )
