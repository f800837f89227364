"""The scheduling policy: who gets which nodes when a pool is full (issue 43, first slice).

One pure function, `decide(state) -> Decision`, of the pools' nodes, the running allocations, the
queue, the capacity reservations, the tenants' shares and usage, and `now`. Times are seconds on
one clock (the workflows pass `datetime.timestamp()`). Pools (gpu_type, region) are decided
independently. Each call is stateless: the next one re-plans from the new facts, so a decision
that was not carried out (a crash) is simply decided again.

Per pool, in this order:

1. **Capacity reservations** (`CapacityReservation`: N nodes, one fabric domain, [start, end)).
   Every reservation not yet running whose start is within `lead_time_s` (or already past, and
   not ended) is planned, earliest start first: the domain whose best N nodes are ready soonest
   (free and preemptible nodes are ready now; a running on-demand allocation's nodes at its
   expected end; a held node at `held_until`), preferring domains that need no preemption. Those
   nodes are *held back*: a queued request may use one only if it finishes (by
   `expected_duration_s`) before the reservation's start. From `start - preemption_notice_s`
   the preemptible allocations on them are preempted (with notice), and at `start` the
   reservation is placed (tier `reserved`), preempting any preemptible work still there. A
   reservation at its start therefore takes precedence over everything queued. One whose nodes
   are still held by on-demand work at its start is reported `late` (never silently dropped);
   a running reservation past its `end` is reported in `Decision.ended` (stop with the usual
   grace period).
2. **Ordering** (Slurm's multifactor fair share). A tenant's usage U (node-seconds, halving every
   `half_life_s`: `decayed_usage`) is compared with its share S (weight, default 1). The factor
   is Slurm's classic `F = 2^(-(U/ΣU) / (S/ΣS))` over the pool's tenants; a higher F goes first,
   which is the same order as lower `U/S` first. Ties go to the older request, then the id.
   While the queue is ordered, each request placed in the order charges its tenant
   `node_count × (expected_duration_s or default_run_s)` of usage, so a tenant that floods the
   queue interleaves with the others instead of standing in front of them: with equal shares
   and usage, the usage charged to a tenant ahead of another's request never exceeds that
   request's own charge (and what stood ahead of it of its tenant) plus one request's charge.
   On-demand requests are ordered first, then preemptible ones (they use only leftovers). The
   last decision's head (`SchedulerState.heads`) stays first until it is placed: its reservation
   holds from one decision to the next.
3. **Placement with EASY backfill.** Walking the order, a request is placed now if one fabric
   domain has `node_count` usable nodes (best fit: the domain with the fewest usable free nodes
   that suffices, so large gangs keep whole domains). Failing that, an on-demand request
   preempts preemptible allocations in the domain where that takes the fewest nodes (whole
   allocations, and none that is not needed). The first request that cannot be placed even so
   is the **head**: it reserves the N nodes of the domain that become available soonest
   (`HeadReservation.start`, the shadow time). Later requests backfill only on nodes outside
   that set, or on nodes in it if they finish before the shadow time; a request with no
   `expected_duration_s` is never backfilled onto the head's nodes. When the head's start is
   unknown (a needed node has no expected end), its nodes are held outright. Preemptible
   requests never preempt and never become the head.
4. **Expiry.** A request not placed whose `submitted_at + max_wait_s` has passed expires
   (`max_wait_s = 0` is the "fail" mode: one try, then refused). No `max_wait_s`: it waits.
5. **Positions and estimates.** Every request still queued gets its position in its pool's order
   and an estimated start: the queue is laid, in order, on a profile of when each node becomes
   available (running allocations' expected ends, this decision's placements, held nodes,
   reservations' ends); unknown ends make the estimate `None`. The head's estimate is its
   reserved start.

Worked example (one pool; domain `a` = a0..a3, domain `b` = b0; a2 and a3 run an on-demand
allocation expected to end at t=100; now t=0). The queue, in fair-share order: `head` wants 4
nodes for 1000 s, `small` 2 for 50 s, `long` 2 for 150 s, `tiny` 1 with no duration. `head`
fits nowhere now, even by preemption, so it reserves a0..a3 from t=100 (position 1, estimated
start 100). `small` backfills onto a0, a1: it ends at t=50, before t=100. `long` would end at
t=150 and delay the head, so it waits: position 2, estimated start 1100, after `head`. `tiny`
goes to b0, which the head does not need, duration or not. Had a2 and a3 run preemptible work
instead, `head` would have been placed at once on a0..a3, preempting it (the test
`test_the_worked_example` in tests/allocations/test_scheduler_policy.py runs this).

A placement onto preempted nodes starts once those allocations have released them (notice, then
the grace period); the workflows wait for that. Preemptions are idempotent by allocation id.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Tier = Literal["on_demand", "reserved", "preemptible"]
INF = math.inf


@dataclass(frozen=True, order=True, slots=True)
class Pool:
    gpu_type: str
    region: str


@dataclass(frozen=True, slots=True)
class Node:
    """A node of a pool. `held`: out of use though in no allocation (wipe, repair) until `held_until`
    (None: unknown). A node in a running allocation is busy whatever `held` says."""

    id: str
    pool: Pool
    fabric_domain: str
    held: bool = False
    held_until: float | None = None


@dataclass(frozen=True, slots=True)
class Allocation:
    """A running allocation. `expected_end` None: unknown. `reservation_id`: it is that reservation's."""

    id: str
    tenant: str
    pool: Pool
    node_ids: tuple[str, ...]
    tier: Tier = "on_demand"
    expected_end: float | None = None
    reservation_id: str | None = None


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    id: str
    tenant: str
    pool: Pool
    node_count: int
    submitted_at: float
    max_wait_s: float | None = None
    expected_duration_s: float | None = None
    tier: Literal["on_demand", "preemptible"] = "on_demand"
    # False while preemptions made for it are still under way (notice, release, wipe): it waits
    # for those nodes instead of preempting more.
    may_preempt: bool = True


@dataclass(frozen=True, slots=True)
class CapacityReservation:
    id: str
    tenant: str
    pool: Pool
    node_count: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class TenantShare:
    """A tenant's weight in a pool and its usage (node-seconds) as of `usage_as_of`."""

    tenant: str
    pool: Pool
    weight: float = 1.0
    usage_node_s: float = 0.0
    usage_as_of: float = 0.0


@dataclass(frozen=True, slots=True)
class PolicySettings:
    half_life_s: float = 7 * 86_400.0  # Slurm's PriorityDecayHalfLife default
    lead_time_s: float = 43_200.0  # hold a reservation's nodes this long before its start (12 h)
    preemption_notice_s: float = 120.0  # preempt for a reservation this long before its start
    default_run_s: float = 3_600.0  # fair-share charge for a request that gives no duration


@dataclass(frozen=True, slots=True)
class SchedulerState:
    now: float
    nodes: tuple[Node, ...] = ()
    allocations: tuple[Allocation, ...] = ()
    queue: tuple[QueuedRequest, ...] = ()
    reservations: tuple[CapacityReservation, ...] = ()
    shares: tuple[TenantShare, ...] = ()
    settings: PolicySettings = field(default_factory=PolicySettings)
    # The heads of the last decision that were promised a start (`Decision.heads`' request ids
    # whose `start` is known): such a head keeps its place, and so its reservation, until it is
    # placed, as EASY backfill's does; without it fair-share order moving with usage would hand the
    # reservation to another request at every decision and a large gang could wait without bound.
    heads: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Placement:
    """Place `id` (a queued request, or a reservation when `tier` is reserved) on `node_ids`, after the
    allocations in `preempts` have released them."""

    id: str
    tenant: str
    pool: Pool
    node_ids: tuple[str, ...]
    fabric_domain: str
    tier: Tier
    preempts: tuple[str, ...] = ()
    backfilled: bool = False


@dataclass(frozen=True, slots=True)
class Preemption:
    allocation_id: str
    for_id: str  # the request or reservation that needs the nodes
    reason: str


@dataclass(frozen=True, slots=True)
class Expiry:
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class QueueEntry:
    request_id: str
    pool: Pool
    position: int  # 1-based, in the pool's order
    estimated_start: float | None
    fair_share_factor: float


@dataclass(frozen=True, slots=True)
class HeadReservation:
    pool: Pool
    request_id: str
    start: float | None  # None: unknown (a needed node has no expected end)
    fabric_domain: str
    node_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReservationStatus:
    reservation_id: str
    state: Literal["held", "placed", "late", "infeasible"]
    node_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    placements: tuple[Placement, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    expired: tuple[Expiry, ...] = ()
    queue: tuple[QueueEntry, ...] = ()
    heads: tuple[HeadReservation, ...] = ()
    reservations: tuple[ReservationStatus, ...] = ()
    ended: tuple[str, ...] = ()  # running reservation allocations past their reservation's end


def decayed_usage(usage_node_s: float, as_of: float, now: float, half_life_s: float) -> float:
    """Usage halves every `half_life_s` (Slurm's PriorityDecayHalfLife)."""
    if half_life_s <= 0:
        return 0.0
    return usage_node_s * 0.5 ** (max(0.0, now - as_of) / half_life_s)


def fair_share_factor(usage: float, total_usage: float, share: float, total_share: float) -> float:
    """Slurm's classic factor 2^(-(U/ΣU)/(S/ΣS)) in (0, 1]; 1 for a tenant with no usage."""
    if total_usage <= 0 or usage <= 0:
        return 1.0
    if share <= 0 or total_share <= 0:
        return 0.0
    return float(2.0 ** (-(usage / total_usage) / (share / total_share)))


# ---- the per-pool working state ---------------------------------------------------------------


@dataclass
class _Pool:
    pool: Pool
    now: float
    settings: PolicySettings
    nodes: dict[str, Node]
    domains: dict[str, list[str]]  # domain → node ids, sorted
    busy_until: dict[str, float]  # node → when it frees (running non-preemptible, held); absent: free
    preemptible_of: dict[str, Allocation]  # node → its running preemptible allocation
    taken: set[str] = field(default_factory=set)  # placed or freed by preemption this decision
    hold_until: dict[str, float] = field(default_factory=dict)  # node → reservation start (held back)
    hold_release: dict[str, float] = field(default_factory=dict)  # node → reservation end
    head_nodes: set[str] = field(default_factory=set)
    head_start: float | None = None
    preempted: dict[str, Preemption] = field(default_factory=dict)
    placed_until: dict[str, float] = field(default_factory=dict)

    def usable(self, node: str, duration: float | None, *, preempt: bool) -> bool:
        """May a request that runs `duration` use this node now (`preempt`: taking back preemptible work)?"""
        if node in self.taken or node in self.busy_until:
            return False
        if node in self.preemptible_of and not preempt:
            return False
        ends_by = INF if duration is None else self.now + duration
        if node in self.hold_until and ends_by > self.hold_until[node]:
            return False
        return not (node in self.head_nodes and (self.head_start is None or ends_by > self.head_start))

    def take(self, node_ids: Iterable[str], until: float) -> None:
        for node in node_ids:
            self.taken.add(node)
            self.placed_until[node] = until

    def preempt(self, allocation: Allocation, for_id: str, reason: str) -> None:
        self.preempted.setdefault(allocation.id, Preemption(allocation.id, for_id, reason))
        for node in allocation.node_ids:
            if node in self.nodes and self.preemptible_of.get(node) is allocation:
                self.taken.add(node)  # frees after the grace period; not reused in this decision

    def find(
        self, count: int, duration: float | None, *, preempt: bool
    ) -> tuple[str, list[str], list[Allocation]] | None:
        """The best domain with `count` usable nodes: free ones only (best fit), else, if `preempt`,
        the fewest nodes taken back from preemptible allocations."""
        fits = []
        for domain, ids in sorted(self.domains.items()):
            free = [n for n in ids if n not in self.preemptible_of and self.usable(n, duration, preempt=False)]
            if len(free) >= count:
                fits.append((len(free), domain, free))
        if fits:
            _, domain, free = min(fits)
            return domain, self._prefer(free)[:count], []
        if not preempt or count <= 0:
            return None
        options = []
        for domain, ids in sorted(self.domains.items()):
            free = [n for n in ids if n not in self.preemptible_of and self.usable(n, duration, preempt=False)]
            need = count - len(free)
            by_alloc: dict[str, list[str]] = defaultdict(list)
            allocs: dict[str, Allocation] = {}
            for n in ids:
                if n in self.preemptible_of and self.usable(n, duration, preempt=True):
                    running = self.preemptible_of[n]
                    by_alloc[running.id].append(n)
                    allocs[running.id] = running
            if sum(len(v) for v in by_alloc.values()) < need:
                continue
            order = sorted(by_alloc, key=lambda a: (-len(by_alloc[a]), len(allocs[a].node_ids), a))
            chosen: list[str] = []
            got = 0
            for a in order:
                if got >= need:
                    break
                chosen.append(a)
                got += len(by_alloc[a])
            for a in sorted(chosen, key=lambda a: (len(by_alloc[a]), a)):  # drop what is not needed
                if got - len(by_alloc[a]) >= need:
                    chosen.remove(a)
                    got -= len(by_alloc[a])
            cost = sum(len(allocs[a].node_ids) for a in chosen)
            freed = [n for a in chosen for n in by_alloc[a]]
            nodes = self._prefer(free) + sorted(freed)
            options.append((cost, len(chosen), domain, nodes[:count], [allocs[a] for a in sorted(chosen)]))
        if not options:
            return None
        _, _, domain, nodes, victims = min(options, key=lambda o: (o[0], o[1], o[2]))
        return domain, nodes, victims

    def _prefer(self, ids: list[str]) -> list[str]:
        """Nodes nobody has a claim on first, then held-back ones (their claim ends soonest last)."""
        return sorted(ids, key=lambda n: (n in self.head_nodes or n in self.hold_until, n))

    def available_at(self, node: str, *, preemptible_free: bool) -> float:
        """When a node is next available, after this decision."""
        if node in self.placed_until:
            t = self.placed_until[node]
        elif node in self.taken:  # freed by preemption: after the grace period, call it now
            t = self.now
        elif node in self.busy_until:
            t = self.busy_until[node]
        elif node in self.preemptible_of and not preemptible_free:
            end = self.preemptible_of[node].expected_end
            t = INF if end is None else max(end, self.now)
        else:
            t = self.now
        if node in self.hold_release:
            t = max(t, self.hold_release[node])
        return t


def _pool_state(state: SchedulerState, pool: Pool, nodes: list[Node], allocations: list[Allocation]) -> _Pool:
    now = state.now
    busy: dict[str, float] = {}
    preemptible: dict[str, Allocation] = {}
    for node in nodes:
        if node.held:
            busy[node.id] = INF if node.held_until is None else max(node.held_until, now)
    for a in allocations:
        for n in a.node_ids:
            if a.tier == "preemptible":
                preemptible[n] = a
            else:
                busy[n] = INF if a.expected_end is None else max(a.expected_end, now)
    for n in preemptible:
        busy.pop(n, None)
    domains: dict[str, list[str]] = defaultdict(list)
    for node in sorted(nodes, key=lambda n: n.id):
        domains[node.fabric_domain].append(node.id)
    return _Pool(pool, now, state.settings, {n.id: n for n in nodes}, dict(domains), busy, preemptible)


# ---- 1. capacity reservations -----------------------------------------------------------------


def _reservations(
    p: _Pool, reservations: list[CapacityReservation], running: dict[str, Allocation]
) -> tuple[list[Placement], list[ReservationStatus], list[str]]:
    now, settings = p.now, p.settings
    placements: list[Placement] = []
    statuses: list[ReservationStatus] = []
    ended: list[str] = []
    claimed: set[str] = set()
    for r in sorted(reservations, key=lambda r: (r.start, r.id)):
        if r.id in running:
            alloc = running[r.id]
            if now >= r.end:
                ended.append(alloc.id)
            else:
                for n in alloc.node_ids:
                    p.busy_until[n] = max(p.busy_until.get(n, now), r.end)
            statuses.append(ReservationStatus(r.id, "placed", alloc.node_ids))
            continue
        if now >= r.end or r.start > now + settings.lead_time_s:
            continue
        best = None
        for domain, ids in sorted(p.domains.items()):
            ready = []
            for n in ids:
                if n in claimed:
                    continue
                if n in p.preemptible_of:
                    ready.append((now, 1, n))  # ready now, by preemption
                elif n in p.busy_until:
                    ready.append((p.busy_until[n], 2, n))  # at its expected end: not yet, even if due
                else:
                    ready.append((now, 0, n))
            if len(ready) < r.node_count:
                continue
            ready.sort()
            pick = ready[: r.node_count]
            latest = max(t for t, _, _ in pick)
            late = latest > max(r.start, now) or (now >= r.start and any(k == 2 for _, k, _ in pick))
            score = (late, sum(k == 1 for _, k, _ in pick), latest, domain)
            if best is None or score < best[0]:
                best = (score, domain, [n for _, _, n in pick])
        if best is None:
            statuses.append(ReservationStatus(r.id, "infeasible"))
            continue
        (late, _, _, _), domain, node_ids = best
        claimed.update(node_ids)
        victims = sorted(
            {p.preemptible_of[n].id: p.preemptible_of[n] for n in node_ids if n in p.preemptible_of}.items()
        )
        if now >= r.start and not late:
            for _, v in victims:
                p.preempt(v, r.id, f"reservation {r.id} starts")
            p.take(node_ids, r.end)
            p.hold_release.update(dict.fromkeys(node_ids, r.end))
            placements.append(
                Placement(
                    r.id, r.tenant, p.pool, tuple(sorted(node_ids)), domain, "reserved", tuple(v.id for _, v in victims)
                )
            )
            statuses.append(ReservationStatus(r.id, "placed", tuple(node_ids)))
            continue
        if now >= r.start - settings.preemption_notice_s:
            for _, v in victims:
                p.preempt(v, r.id, f"reservation {r.id} starts at {r.start:.0f}")
        for n in node_ids:
            p.hold_until[n] = r.start
            p.hold_release[n] = r.end
        statuses.append(ReservationStatus(r.id, "late" if now >= r.start else "held", tuple(node_ids)))
    return placements, statuses, ended


# ---- 2. ordering ------------------------------------------------------------------------------


def _charge(request: QueuedRequest, settings: PolicySettings) -> float:
    duration = settings.default_run_s if request.expected_duration_s is None else request.expected_duration_s
    return request.node_count * duration


def _order(
    requests: list[QueuedRequest], shares: Mapping[str, TenantShare], now: float, settings: PolicySettings
) -> list[tuple[QueuedRequest, float]]:
    """Requests in fair-share order, each with its tenant's factor when it was ordered."""
    by_tenant: dict[str, list[QueuedRequest]] = defaultdict(list)
    for r in sorted(requests, key=lambda r: (r.submitted_at, r.id)):
        by_tenant[r.tenant].append(r)
    usage: dict[str, float] = {}
    weight: dict[str, float] = {}
    for tenant in set(by_tenant) | set(shares):
        share = shares.get(tenant)
        weight[tenant] = 1.0 if share is None else max(share.weight, 0.0)
        usage[tenant] = (
            0.0 if share is None else decayed_usage(share.usage_node_s, share.usage_as_of, now, settings.half_life_s)
        )
    total_share = sum(weight.values())
    cursor = dict.fromkeys(by_tenant, 0)
    ordered: list[tuple[QueuedRequest, float]] = []
    while True:
        heads = [(t, by_tenant[t][i]) for t, i in cursor.items() if i < len(by_tenant[t])]
        if not heads:
            return ordered

        def key(item: tuple[str, QueuedRequest]) -> tuple[float, float, str]:
            tenant, r = item
            w = weight[tenant]
            return (usage[tenant] / w if w > 0 else INF, r.submitted_at, r.id)  # a zero share goes last

        tenant, r = min(heads, key=key)
        factor = fair_share_factor(usage[tenant], sum(usage.values()), weight[tenant], total_share)
        ordered.append((r, factor))
        usage[tenant] += _charge(r, settings)
        cursor[tenant] += 1


# ---- 3-5. placement, expiry, estimates --------------------------------------------------------


def _shadow(p: _Pool, count: int) -> tuple[float, str, list[str]] | None:
    """When and where `count` nodes of one domain are first all available (preemptible: now)."""
    best: tuple[float, str, list[str]] | None = None
    for domain, ids in sorted(p.domains.items()):
        if len(ids) < count:
            continue
        times = sorted((p.available_at(n, preemptible_free=True), n) for n in ids)
        pick = times[:count]
        start = pick[-1][0]
        if best is None or start < best[0]:
            best = (start, domain, [n for _, n in pick])
    return best


def _estimate(p: _Pool, waiting: list[QueuedRequest]) -> dict[str, float | None]:
    """Lay the waiting requests, in order, on the nodes' availability profile."""
    free_at = {n: p.available_at(n, preemptible_free=True) for n in p.nodes}
    estimates: dict[str, float | None] = {}
    for r in waiting:
        best: tuple[float, list[str]] | None = None
        for _, ids in sorted(p.domains.items()):
            if len(ids) < r.node_count:
                continue
            pick = sorted(ids, key=lambda n: (free_at[n], n))[: r.node_count]
            start = max(free_at[n] for n in pick)
            if best is None or start < best[0]:
                best = (start, pick)
        if best is None:
            estimates[r.id] = None
            continue
        start, pick = best
        estimates[r.id] = None if start == INF else start
        end = INF if r.expected_duration_s is None else start + r.expected_duration_s  # unknown: claims them
        for n in pick:
            free_at[n] = end
    return estimates


def _decide_pool(
    state: SchedulerState,
    pool: Pool,
    nodes: list[Node],
    allocations: list[Allocation],
    queue: list[QueuedRequest],
    reservations: list[CapacityReservation],
    shares: Mapping[str, TenantShare],
) -> Decision:
    now, settings = state.now, state.settings
    p = _pool_state(state, pool, nodes, allocations)
    running = {a.reservation_id: a for a in allocations if a.reservation_id is not None}
    placements, statuses, ended = _reservations(p, reservations, running)

    on_demand = _order([r for r in queue if r.tier == "on_demand"], shares, now, settings)
    kept = [pair for pair in on_demand if pair[0].id in state.heads]
    on_demand = kept + [pair for pair in on_demand if pair[0].id not in state.heads]
    spare = _order([r for r in queue if r.tier == "preemptible"], shares, now, settings)
    order = on_demand + spare
    head: HeadReservation | None = None
    waiting: list[QueuedRequest] = []
    expired: list[Expiry] = []
    for r, _ in order:
        duration = r.expected_duration_s
        found = None
        if r.node_count > 0:
            found = p.find(r.node_count, duration, preempt=r.tier == "on_demand" and r.may_preempt)
        if found is not None:
            domain, node_ids, victims = found
            for v in victims:
                p.preempt(v, r.id, f"{r.node_count}-node {r.tier} request {r.id} needs the nodes")
            backfilled = head is not None
            p.take(node_ids, INF if duration is None else now + duration)
            placements.append(
                Placement(
                    r.id,
                    r.tenant,
                    pool,
                    tuple(sorted(node_ids)),
                    domain,
                    r.tier,
                    tuple(v.id for v in victims),
                    backfilled,
                )
            )
            continue
        if r.max_wait_s is not None and now >= r.submitted_at + r.max_wait_s:
            expired.append(
                Expiry(r.id, f"no {r.node_count} nodes in one fabric domain within max_wait_s={r.max_wait_s:g}")
            )
            continue
        waiting.append(r)
        if head is None and r.tier == "on_demand":
            shadow = _shadow(p, r.node_count)
            if shadow is not None:
                start, domain, node_ids = shadow
                p.head_nodes = set(node_ids)
                p.head_start = None if start == INF else start
                head = HeadReservation(pool, r.id, p.head_start, domain, tuple(sorted(node_ids)))

    estimates = _estimate(p, waiting)
    if head is not None:
        estimates[head.request_id] = head.start
    factors = {r.id: f for r, f in order}
    entries = tuple(
        QueueEntry(r.id, pool, i, estimates.get(r.id), factors[r.id]) for i, r in enumerate(waiting, start=1)
    )
    return Decision(
        placements=tuple(placements),
        preemptions=tuple(p.preempted.values()),
        expired=tuple(expired),
        queue=entries,
        heads=(head,) if head is not None else (),
        reservations=tuple(statuses),
        ended=tuple(ended),
    )


def decide(state: SchedulerState) -> Decision:
    """The policy (see the module docstring): what to place, preempt, expire and promise, now."""
    nodes: dict[Pool, list[Node]] = defaultdict(list)
    for node in state.nodes:
        nodes[node.pool].append(node)
    allocations: dict[Pool, list[Allocation]] = defaultdict(list)
    for a in state.allocations:
        allocations[a.pool].append(a)
    queue: dict[Pool, list[QueuedRequest]] = defaultdict(list)
    for r in state.queue:
        queue[r.pool].append(r)
    reservations: dict[Pool, list[CapacityReservation]] = defaultdict(list)
    for c in state.reservations:
        reservations[c.pool].append(c)
    shares: dict[Pool, dict[str, TenantShare]] = defaultdict(dict)
    for s in state.shares:
        shares[s.pool][s.tenant] = s
    parts = [
        _decide_pool(state, pool, nodes[pool], allocations[pool], queue[pool], reservations[pool], shares[pool])
        for pool in sorted(set(nodes) | set(queue) | set(reservations))
    ]
    return Decision(
        placements=tuple(x for d in parts for x in d.placements),
        preemptions=tuple(x for d in parts for x in d.preemptions),
        expired=tuple(x for d in parts for x in d.expired),
        queue=tuple(x for d in parts for x in d.queue),
        heads=tuple(x for d in parts for x in d.heads),
        reservations=tuple(x for d in parts for x in d.reservations),
        ended=tuple(x for d in parts for x in d.ended),
    )
