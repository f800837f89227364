"""The pools' queues: a create that finds no room waits in its pool's queue (`capacity.wait =
queue`), and each plan of the pool places, expires and ranks the queued requests as the policy
decides (`scheduler/policy.py`, docs/scheduling.md).

One decision path for both doors. A create takes the pool's lock (`allocations.lock_pool`); when
nothing is queued in the pool it reserves at once as it always did (`allocations.reserve_gang`),
and when something is, the policy decides for the newcomer among the queued requests, so it can
neither jump the queue nor take the nodes a large gang at the head is waiting for. The pool's
scheduler workflow (`workflows/pool_scheduler.py`) plans the pool again every `scheduler.poll_s`
while its queue is not empty (`plan_pool`): placements reserve their nodes by compare-and-swap
(node available -> reserved at the generation read, allocation queued -> provisioning), in one
transaction under the pool's lock, so two placements never take one node and a request
cancelled meanwhile is not placed. A plan that loses a race is simply made again on fresh rows.

The policy sees (per pool, from the rows): nodes a reservation may take as free; the nodes of
the pool's running allocations as busy until the allocation's expected end (`placed_at +
expected_duration_s`, unknown without one; `now` for one being cancelled); nodes on their way
back to the pool (wiping, burn-in) as held for an unknown time; nodes out of service (failed,
cordoned, in maintenance, under repair) not at all. Fair-share usage is the tenant's node-seconds
held in the pool, halving every `scheduler.half_life_s`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.config import SchedulerSettings
from gpucloud.db import Database, rowcount
from gpucloud.models.node_states import RETURNING_TO_POOL, NodeState
from gpucloud.models.scheduling_tables import CapacityReservation, TenantPoolShare
from gpucloud.models.tables import TERMINAL_ALLOCATION, Allocation, AllocationStatus, Node, Tenant, utcnow
from gpucloud.scheduler import policy
from gpucloud.services import allocations as alloc_service
from gpucloud.services import reservations
from gpucloud.services.errors import NotFound
from gpucloud.web import metrics

RUNNING = (
    AllocationStatus.PROVISIONING,
    AllocationStatus.READY,
    AllocationStatus.DEGRADED,
    AllocationStatus.CANCELLING,
)
PLAN_ATTEMPTS = 4


@dataclass
class PoolPlan:
    """What one plan of a pool did: the allocations it placed and expired, and how many still wait."""

    placed: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    # Reservations' allocations to start (id, tenant) and to cancel (their window ended).
    start: list[tuple[str, str]] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    queued: int = 0
    reservations: int = 0  # open in the pool (accepted or active)
    unbilled: int = 0  # reservations whose window began that the ledger has not recorded
    # Seconds until a plan can change anything for the open reservations: each one accepted and
    # its hold (`reservation_hold_s` before its prepared start) still ahead; 0 otherwise.
    quiet_s: float = 0.0


def _quiet_s(windows: list[CapacityReservation], now: datetime, settings: SchedulerSettings) -> float:
    if not windows or any(w.status != reservations.ReservationStatus.ACCEPTED for w in windows):
        return 0.0
    ahead = timedelta(seconds=settings.reservation_hold_s + settings.reservation_prepare_s)
    return max(0.0, (min(w.start_at for w in windows) - ahead - now).total_seconds())


def _ts(at: datetime) -> float:
    return (at if at.tzinfo is not None else at.replace(tzinfo=UTC)).timestamp()


def _at(ts: float | None) -> datetime | None:
    return None if ts is None or math.isinf(ts) else datetime.fromtimestamp(ts, tz=UTC)


def policy_settings(settings: SchedulerSettings) -> policy.PolicySettings:
    """The policy's knobs from the settings. A reservation's window begins `reservation_prepare_s`
    early for the policy (`reservations.for_policy`), so its preemptions come that much earlier
    again: the victims' notice and release, then the wipe, fit before its allocation is placed."""
    return policy.PolicySettings(
        half_life_s=settings.half_life_s,
        default_run_s=settings.default_run_s,
        lead_time_s=settings.reservation_hold_s,
        preemption_notice_s=settings.preemption_notice_s + settings.reservation_prepare_s,
    )


def queued_in_pool(session: Session, gpu_type: str, region: str) -> int:
    return session.exec(
        select(sa.func.count())
        .select_from(Allocation)
        .where(
            col(Allocation.gpu_type) == gpu_type,
            col(Allocation.region) == region,
            col(Allocation.status) == AllocationStatus.QUEUED,
        )
    ).one()


def pools_needing_scheduler(db: Database) -> list[tuple[str, str]]:
    """The pools with a queue or an open capacity reservation."""
    with db.session() as session:
        return sorted(set(pools_with_queues(session)) | set(reservations.pools_with_open(session)))


def pools_with_queues(session: Session) -> list[tuple[str, str]]:
    rows = session.exec(
        select(Allocation.gpu_type, Allocation.region)
        .where(col(Allocation.status) == AllocationStatus.QUEUED)
        .distinct()
    ).all()
    return sorted((g, r) for g, r in rows)


def _decayed_node_seconds(count: int, start: float, end: float, now: float, half_life_s: float) -> float:
    """∫ count · 2^-((now - t)/h) dt over [start, end]: node-seconds, each halving every h."""
    if end <= start:
        return 0.0
    k = math.log(2) / half_life_s
    return count / k * (math.exp(-k * (now - end)) - math.exp(-k * (now - start)))


def _usage(
    session: Session, gpu_type: str, region: str, now: datetime, settings: SchedulerSettings
) -> dict[str, float]:
    since = now - timedelta(seconds=8 * settings.half_life_s)
    rows = session.execute(
        sa.select(
            col(Allocation.tenant_id),
            col(Allocation.node_count),
            col(Allocation.placed_at),
            col(Allocation.status),
            col(Allocation.updated_at),
        ).where(
            col(Allocation.gpu_type) == gpu_type,
            col(Allocation.region) == region,
            col(Allocation.placed_at).is_not(None),
            col(Allocation.updated_at) >= since,
        )
    ).all()
    usage: dict[str, float] = {}
    t_now = _ts(now)
    for tenant, count, placed_at, status, updated_at in rows:
        assert placed_at is not None
        end = _ts(updated_at) if status in TERMINAL_ALLOCATION else t_now
        usage[tenant] = usage.get(tenant, 0.0) + _decayed_node_seconds(
            count, _ts(placed_at), end, t_now, settings.half_life_s
        )
    return usage


def _tier(alloc: Allocation) -> Literal["on_demand", "preemptible"]:
    return "preemptible" if alloc.tier == "preemptible" else "on_demand"


def _request(
    alloc: Allocation, pool: policy.Pool, *, max_wait_s: int | None, may_preempt: bool = True
) -> policy.QueuedRequest:
    return policy.QueuedRequest(
        id=alloc.id,
        tenant=alloc.tenant_id,
        pool=pool,
        node_count=alloc.node_count,
        submitted_at=_ts(alloc.created_at),
        max_wait_s=max_wait_s,
        expected_duration_s=alloc.expected_duration_s,
        tier=_tier(alloc),
        may_preempt=may_preempt,
    )


@dataclass(frozen=True)
class Notice:
    """A preemptible allocation taken back: its workflow stops it at `stop_at`."""

    allocation_id: str
    reason: str
    stop_at: datetime


def _notice(alloc: Allocation, settings: SchedulerSettings) -> Notice:
    assert alloc.preempted_at is not None
    stop_at = alloc.preempted_at + timedelta(seconds=settings.preemption_notice_s)
    return Notice(alloc.id, f"preempted: its nodes are taken back for allocation {alloc.preempted_for}", stop_at)


def pending_notices(session: Session, gpu_type: str, region: str, settings: SchedulerSettings) -> list[Notice]:
    """Preempted allocations whose workflows have not begun their release yet (told again each plan:
    a signal is idempotent, and one lost with a crash is sent again)."""
    rows = session.exec(
        select(Allocation).where(
            col(Allocation.gpu_type) == gpu_type,
            col(Allocation.region) == region,
            col(Allocation.preempted_at).is_not(None),
            col(Allocation.status).in_(
                [AllocationStatus.PROVISIONING, AllocationStatus.READY, AllocationStatus.DEGRADED]
            ),
        )
    ).all()
    return [_notice(a, settings) for a in rows]


def preempt(
    session: Session, victim_ids: Iterable[str], *, for_id: str, now: datetime, settings: SchedulerSettings
) -> list[str]:
    """Take back preemptible allocations for `for_id` (compare-and-swap: each once, and only while it
    runs): the notice event on each, counted. The ones this call preempted."""
    taken: list[str] = []
    for victim_id in victim_ids:
        moved = session.execute(
            sa.update(Allocation)
            .where(
                col(Allocation.id) == victim_id,
                col(Allocation.tier) == "preemptible",
                col(Allocation.preempted_at).is_(None),
                col(Allocation.status).in_(
                    [AllocationStatus.PROVISIONING, AllocationStatus.READY, AllocationStatus.DEGRADED]
                ),
            )
            .values(preempted_at=now, preempted_for=for_id, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        if rowcount(moved) != 1:
            continue
        victim = session.exec(select(Allocation).where(col(Allocation.id) == victim_id)).one()
        session.refresh(victim)
        notice = settings.preemption_notice_s
        alloc_service.record_event(
            session,
            victim,
            "preemption_notice",
            reason=f"taken back for allocation {for_id}: the workload gets SIGTERM in {notice:g} s, then the"
            " agent's grace period to exit; checkpoint now",
            actor="scheduler",
        )
        metrics.PREEMPTIONS.labels(victim.gpu_type, victim.region).inc()
        taken.append(victim_id)
    return taken


def pool_state(
    session: Session,
    gpu_type: str,
    region: str,
    *,
    now: datetime,
    settings: SchedulerSettings,
    newcomer: policy.QueuedRequest | None = None,
    booked: list[CapacityReservation] | None = None,
) -> tuple[policy.SchedulerState, dict[str, Allocation]]:
    """The policy's view of one pool, read from the rows (see the module docstring), and the
    queued allocations by id. `newcomer`: a request being created, not yet a row; `booked`: the
    pool's open reservations when the caller read them already."""
    pool = policy.Pool(gpu_type, region)
    t_now = _ts(now)
    allocs = session.exec(
        select(Allocation).where(
            col(Allocation.gpu_type) == gpu_type,
            col(Allocation.region) == region,
            col(Allocation.status).in_([*RUNNING, AllocationStatus.QUEUED]),
        )
    ).all()
    queued = {a.id: a for a in allocs if a.status == AllocationStatus.QUEUED}
    running: list[policy.Allocation] = []
    members: set[str] = set()
    for a in allocs:
        if a.status == AllocationStatus.QUEUED or not a.node_ids:
            continue
        tier: policy.Tier = "reserved" if a.reservation_id is not None else _tier(a)
        if a.status == AllocationStatus.CANCELLING:
            end: float | None = t_now
        elif a.preempted_at is not None:  # taken back already: it frees at its notice's end
            end, tier = _ts(a.preempted_at) + settings.preemption_notice_s, "on_demand"
        elif a.expected_duration_s is not None:
            end = _ts(a.placed_at or a.created_at) + a.expected_duration_s
        else:
            end = None
        running.append(
            policy.Allocation(
                a.id, a.tenant_id, pool, tuple(a.node_ids), tier=tier, expected_end=end, reservation_id=a.reservation_id
            )
        )
        members.update(a.node_ids)

    rows = session.execute(
        sa.select(
            col(Node.id),
            col(Node.pod),
            col(Node.state),
            col(Node.cordoned),
            col(Node.maintenance),
            col(Node.health),
            col(Node.diag_lease_until),
        ).where(col(Node.gpu_type) == gpu_type, col(Node.region) == region)
    ).all()
    state_of = {row[0]: row[2] for row in rows}
    nodes: list[policy.Node] = []
    for node_id, pod, state, cordoned, maintenance, health, lease in rows:
        if node_id in members:
            nodes.append(policy.Node(node_id, pool, pod))
            continue
        if cordoned or maintenance or health != "ok":
            continue
        if state == NodeState.AVAILABLE:
            leased = lease is not None and _ts(lease) > t_now
            held_until = _ts(lease) if leased else None
            nodes.append(policy.Node(node_id, pool, pod, held=leased, held_until=held_until))
        elif state in RETURNING_TO_POOL:
            nodes.append(policy.Node(node_id, pool, pod, held=True))

    tenants = {a.tenant_id for a in allocs} | ({newcomer.tenant} if newcomer else set())
    weights = {
        s.tenant_id: s.weight
        for s in session.exec(
            select(TenantPoolShare).where(
                col(TenantPoolShare.gpu_type) == gpu_type,
                col(TenantPoolShare.region) == region,
                col(TenantPoolShare.tenant_id).in_(sorted(tenants)),
            )
        ).all()
    }
    usage = _usage(session, gpu_type, region, now, settings)
    shares = tuple(
        policy.TenantShare(t, pool, weight=weights.get(t, 1.0), usage_node_s=usage.get(t, 0.0), usage_as_of=t_now)
        for t in sorted(tenants | set(usage))
    )
    waiting_on = _preempting(session, list(queued), state_of)
    queue = [_request(a, pool, max_wait_s=a.max_wait_s, may_preempt=a.id not in waiting_on) for a in queued.values()]
    if newcomer is not None:
        queue.append(newcomer)
    with_allocation = {a.reservation_id for a in running if a.reservation_id is not None}
    windows = reservations.for_policy(
        reservations.open_in_pool(session, gpu_type, region) if booked is None else booked,
        with_allocation,
        pool,
        settings,
    )
    state = policy.SchedulerState(
        now=t_now,
        nodes=tuple(nodes),
        allocations=tuple(running),
        queue=tuple(queue),
        reservations=tuple(windows),
        shares=shares,
        settings=policy_settings(settings),
        # The last plan's head keeps its place until it is placed: the one it ranked first and
        # promised a start (its reservation, `SchedulerState.heads`).
        heads=tuple(
            a.id
            for a in queued.values()
            if a.queue_position == 1 and a.estimated_start_at is not None and _tier(a) == "on_demand"
        ),
    )
    return state, queued


def _preemptible_running(session: Session, gpu_type: str, region: str) -> bool:
    """Whether the pool has preemptible allocations an on-demand request could take back."""
    return (
        session.exec(
            select(Allocation.id).where(
                col(Allocation.gpu_type) == gpu_type,
                col(Allocation.region) == region,
                col(Allocation.tier) == "preemptible",
                col(Allocation.preempted_at).is_(None),
                col(Allocation.status).in_(
                    [AllocationStatus.PROVISIONING, AllocationStatus.READY, AllocationStatus.DEGRADED]
                ),
            )
        ).first()
        is not None
    )


def _preempting(session: Session, request_ids: list[str], state_of: dict[str, str]) -> set[str]:
    """The requests whose preemptions are still under way: an allocation taken back for one of them
    that has not ended, or whose nodes are not yet back in the pool (released, wiped, burned in)."""
    if not request_ids:
        return set()
    victims = session.exec(select(Allocation).where(col(Allocation.preempted_for).in_(request_ids))).all()
    busy: set[str] = set()
    for v in victims:
        if v.preempted_for is None:
            continue
        if v.status not in TERMINAL_ALLOCATION or any(state_of.get(n) in RETURNING_TO_POOL for n in v.node_ids):
            busy.add(v.preempted_for)
    return busy


def _reserve(
    session: Session,
    alloc: Allocation,
    placement: policy.Placement,
    *,
    now: datetime,
    deadline_scale: float,
    actor: str,
) -> None:
    """The placement's nodes available -> reserved for `alloc`, each by compare-and-swap
    (`allocations.ReservationConflict` when one moved since it was read)."""
    nodes = session.exec(select(Node).where(col(Node.id).in_(placement.node_ids))).all()
    if len(nodes) != len(placement.node_ids):
        raise alloc_service.ReservationConflict(alloc.id)
    for node in sorted(nodes, key=lambda n: n.id):
        alloc_service.reserve_node(
            session, node, alloc.id, now=now, deadline_scale=deadline_scale, op_id=f"reserve-{alloc.id}", actor=actor
        )


def admit(
    session: Session,
    alloc: Allocation,
    *,
    wait: Literal["fail", "queue"],
    settings: SchedulerSettings,
    deadline_scale: float,
    now: datetime | None = None,
) -> str | None:
    """A create's reservation, inside its transaction: reserve the gang now (None), or queue the
    request (`status = queued`, no nodes) when `wait` is `queue` or when it takes nodes back from
    preemptible allocations (why it is queued); `allocations.InsufficientCapacity` when it is
    `fail` and the policy places it nowhere. Slices of NVL72 racks never queue."""
    now = now or utcnow()
    alloc_service.lock_pool(session, alloc.gpu_type, alloc.region)
    waiting = queued_in_pool(session, alloc.gpu_type, alloc.region)
    held = reservations.held_soon(session, alloc.gpu_type, alloc.region, now=now, settings=settings)
    if alloc.nvl72_trays is not None or (waiting == 0 and not held):
        try:
            alloc_service.reserve_gang(session, alloc, now=now, deadline_scale=deadline_scale)
            alloc.placed_at = now
            return None
        except alloc_service.InsufficientCapacity:
            takes_back = alloc.tier != "preemptible" and _preemptible_running(session, alloc.gpu_type, alloc.region)
            if alloc.nvl72_trays is not None or (wait == "fail" and not takes_back):
                raise
    pool = policy.Pool(alloc.gpu_type, alloc.region)
    newcomer = dataclasses.replace(
        _request(alloc, pool, max_wait_s=0 if wait == "fail" else alloc.max_wait_s), submitted_at=_ts(now)
    )
    state, _ = pool_state(session, alloc.gpu_type, alloc.region, now=now, settings=settings, newcomer=newcomer)
    decision = policy.decide(state)
    placement = next((p for p in decision.placements if p.id == alloc.id), None)
    if placement is not None and placement.preempts:
        # Room is taken back from preemptible allocations: it waits (at the head) for their nodes.
        preempt(session, placement.preempts, for_id=alloc.id, now=now, settings=settings)
        alloc.status = AllocationStatus.QUEUED
        alloc.node_ids = []
        alloc.queue_position = 1
        alloc.estimated_start_at = now + timedelta(seconds=settings.preemption_notice_s)
        return (
            f"taking back {len(placement.preempts)} preemptible allocation(s) in {placement.fabric_domain}:"
            " placed once their notice ends and their nodes are released"
        )
    if placement is not None:
        _reserve(session, alloc, placement, now=now, deadline_scale=deadline_scale, actor="api")
        alloc.node_ids = list(placement.node_ids)
        alloc.fabric_domain = placement.fabric_domain
        alloc.placed_at = now
        return None
    if wait == "fail":
        members = {n for a in state.allocations for n in a.node_ids}
        free: dict[str, int] = {}
        for node in state.nodes:
            if not node.held and node.id not in members:
                free[node.fabric_domain] = free.get(node.fabric_domain, 0) + 1
        raise alloc_service.InsufficientCapacity(
            gpu_type=alloc.gpu_type,
            region=alloc.region,
            wanted=alloc.node_count,
            largest_domain=max(free.values(), default=0),
            total=sum(free.values()),
            queued=waiting,
        )
    alloc.status = AllocationStatus.QUEUED
    alloc.node_ids = []
    entry = next((e for e in decision.queue if e.request_id == alloc.id), None)
    alloc.queue_position = entry.position if entry is not None else waiting + 1
    alloc.estimated_start_at = _at(entry.estimated_start) if entry is not None else None
    return queued_reason(alloc)


def queued_reason(alloc: Allocation) -> str:
    limit = f"for at most {alloc.max_wait_s} s" if alloc.max_wait_s is not None else "until placed or cancelled"
    return (
        f"no fabric domain of {alloc.gpu_type} in {alloc.region} has room for {alloc.node_count} nodes now;"
        f" queued at position {alloc.queue_position}, waiting {limit}"
    )


def _plan_once(
    session: Session,
    gpu_type: str,
    region: str,
    *,
    now: datetime,
    settings: SchedulerSettings,
    deadline_scale: float,
) -> PoolPlan:
    alloc_service.lock_pool(session, gpu_type, region)
    booked = reservations.open_in_pool(session, gpu_type, region)
    reservations.settle(session, booked, now=now)
    windows = {r.id: r for r in booked if r.status in reservations.OPEN}
    state, queued = pool_state(session, gpu_type, region, now=now, settings=settings, booked=list(windows.values()))
    result = PoolPlan()
    if not queued and not windows:
        result.notices = pending_notices(session, gpu_type, region, settings)
        result.unbilled = reservations.unbilled_count(session, gpu_type, region, now=now)
        return result
    decision = policy.decide(state)
    for taken in decision.preemptions:  # for a queued request or a reservation, idempotent by victim
        preempt(session, [taken.allocation_id], for_id=taken.for_id, now=now, settings=settings)
    for placement in decision.placements:
        if placement.tier == "reserved":
            window = windows.get(placement.id)
            if window is None or placement.preempts:  # it waits for the nodes it takes back
                continue
            placed = reservations.place_window(
                session, window, placement.node_ids, placement.fabric_domain, now=now, deadline_scale=deadline_scale
            )
            if placed is not None:
                result.start.append((placed.id, placed.tenant_id))
            continue
        alloc = queued.get(placement.id)
        if alloc is None or placement.preempts:  # it waits for the nodes it takes back (no more preemption)
            continue
        moved = session.execute(
            sa.update(Allocation)
            .where(col(Allocation.id) == alloc.id, col(Allocation.status) == AllocationStatus.QUEUED)
            .values(
                status=AllocationStatus.PROVISIONING.value,
                node_ids=list(placement.node_ids),
                fabric_domain=placement.fabric_domain,
                placed_at=now,
                queue_position=None,
                estimated_start_at=None,
                updated_at=now,
            )
            .execution_options(synchronize_session=False)
        )
        if rowcount(moved) != 1:
            continue  # cancelled since it was read
        _reserve(session, alloc, placement, now=now, deadline_scale=deadline_scale, actor="scheduler")
        waited = _ts(now) - _ts(alloc.created_at)
        how = "backfilled onto" if placement.backfilled else "placed on"
        alloc_service.record_event(
            session,
            alloc,
            "placed",
            reason=f"{how} {len(placement.node_ids)} nodes of {placement.fabric_domain} after {waited:.0f} s"
            " in the queue",
            actor="scheduler",
        )
        result.placed.append(alloc.id)
        metrics.SCHEDULER_PLACEMENTS.labels(gpu_type, region).inc()
    for expiry in decision.expired:
        alloc = queued.get(expiry.request_id)
        if alloc is None:
            continue
        reason = (
            f"not placed within max_wait_s={alloc.max_wait_s}: no fabric domain of {gpu_type} in {region}"
            f" had {alloc.node_count} nodes free in time; create it again, or with a longer max_wait_s"
        )
        failed = session.execute(  # a tenant's cancel since it was read wins
            sa.update(Allocation)
            .where(col(Allocation.id) == alloc.id, col(Allocation.status) == AllocationStatus.QUEUED)
            .values(status=AllocationStatus.FAILED.value, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        if rowcount(failed) != 1:
            continue
        alloc_service.set_status(session, alloc.id, AllocationStatus.FAILED, failure_reason=reason)
        alloc_service.record_event(session, alloc, "failed", reason=reason, actor="scheduler")
        result.expired.append(alloc.id)
    for entry in decision.queue:
        alloc = queued.get(entry.request_id)
        if alloc is None:
            continue
        estimate = _at(entry.estimated_start)
        if alloc.queue_position != entry.position or alloc.estimated_start_at != estimate:
            session.execute(
                sa.update(Allocation)
                .where(col(Allocation.id) == alloc.id, col(Allocation.status) == AllocationStatus.QUEUED)
                .values(queue_position=entry.position, estimated_start_at=estimate)
                .execution_options(synchronize_session=False)
            )
    for allocation_id in decision.ended:
        if reservations.end_window(session, allocation_id, now=now):
            result.cancel.append(allocation_id)
    result.queued = len(decision.queue) + sum(1 for p in decision.placements if p.preempts and p.id in queued)
    result.notices = pending_notices(session, gpu_type, region, settings)
    result.reservations = len(windows)
    result.quiet_s = _quiet_s(list(windows.values()), now, settings) if not result.queued else 0.0
    result.unbilled = reservations.unbilled_count(session, gpu_type, region, now=now)
    # A window's allocation whose workflow a crash may have kept from starting is started again.
    result.start += reservations.provisioning_windows(
        session, list(windows.values()), skip={a for a, _ in result.start}
    )
    return result


def plan_pool(
    db: Database,
    gpu_type: str,
    region: str,
    *,
    settings: SchedulerSettings,
    deadline_scale: float,
    now: datetime | None = None,
) -> PoolPlan:
    """Plan the pool once (see the module docstring), again on fresh rows when a node moved under
    a placement; what it placed, expired and left queued."""
    for _ in range(PLAN_ATTEMPTS):
        try:
            with db.session() as session:
                return _plan_once(
                    session,
                    gpu_type,
                    region,
                    now=now or utcnow(),
                    settings=settings,
                    deadline_scale=deadline_scale,
                )
        except alloc_service.ReservationConflict:
            continue
    with db.session() as session:
        return PoolPlan(queued=queued_in_pool(session, gpu_type, region))


def queue_of(
    session: Session,
    gpu_type: str | None = None,
    region: str | None = None,
    *,
    tenant_id: str | None = None,
    limit: int = 1000,
) -> list[Allocation]:
    """The queued allocations (of one pool, or all; of one tenant, or all), in each pool's order
    as last planned."""
    query = select(Allocation).where(col(Allocation.status) == AllocationStatus.QUEUED)
    if tenant_id is not None:
        query = query.where(col(Allocation.tenant_id) == tenant_id)
    if gpu_type is not None:
        query = query.where(col(Allocation.gpu_type) == gpu_type)
    if region is not None:
        query = query.where(col(Allocation.region) == region)
    # Ordered before the limit: the first `limit` in the queue's order, not the first created.
    unplanned_last = sa.case((col(Allocation.queue_position).is_(None), 1), else_=0)
    ordered = query.order_by(
        col(Allocation.gpu_type),
        col(Allocation.region),
        unplanned_last,
        col(Allocation.queue_position),
        col(Allocation.created_at),
        col(Allocation.seq),
    )
    return list(session.exec(ordered.limit(limit)).all())


def set_share(session: Session, tenant_id: str, gpu_type: str, region: str, weight: float) -> TenantPoolShare:
    """Set a tenant's weight in a pool (`NotFound` for a tenant that does not exist)."""
    if session.exec(select(Tenant.id).where(col(Tenant.id) == tenant_id)).first() is None:
        raise NotFound("tenant", tenant_id)
    share = session.get(TenantPoolShare, (tenant_id, gpu_type, region))
    if share is None:
        share = TenantPoolShare(tenant_id=tenant_id, gpu_type=gpu_type, region=region)
    share.weight, share.updated_at = weight, utcnow()
    session.add(share)
    session.flush()
    return share


def shares_of(session: Session, tenant_id: str) -> list[TenantPoolShare]:
    if session.exec(select(Tenant.id).where(col(Tenant.id) == tenant_id)).first() is None:
        raise NotFound("tenant", tenant_id)
    rows = session.exec(select(TenantPoolShare).where(col(TenantPoolShare.tenant_id) == tenant_id)).all()
    return sorted(rows, key=lambda s: (s.gpu_type, s.region))
