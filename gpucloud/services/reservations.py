"""Capacity reservations (issue 43, docs/scheduling.md): a tenant books N whole nodes of a pool,
inside one fabric domain, for a future window [start, end).

Admission. A reservation is accepted only if the pool can honour it beside the reservations
already accepted: at each moment of its window where the set of overlapping reservations
changes, every reservation then running must fit a fabric domain of the pool (best-fit
decreasing over the domains' in-service nodes). It must also fit the tenant's quota for the pool
(its GPUs against the quota's limit; what the tenant holds now does not count against a window
in the future). Creates are idempotent under an Idempotency-Key, as allocations are.

Carrying it out is the pool's scheduler's (`services/scheduling.py`): the policy holds the nodes
from `scheduler.reservation_hold_s` before the start (queued requests backfill them only if they
end in time), takes them back from preemptible work ahead of the start, and places the
reservation's allocation (tier `reserved`) `scheduler.reservation_prepare_s` ahead of the start so
it is provisioned by then; at the end its allocation is cancelled as any other (the workload gets
SIGTERM and its grace period). The window is billed at the reservation price, used or not.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.config import SchedulerSettings
from gpucloud.db import Database, rowcount
from gpucloud.models.node_states import NodeState
from gpucloud.models.scheduling_tables import CapacityReservation, ReservationStatus
from gpucloud.models.tables import (
    TERMINAL_ALLOCATION,
    Allocation,
    AllocationStatus,
    Node,
    Operation,
    utcnow,
)
from gpucloud.models.workflow_ids import allocation_workflow_id
from gpucloud.scheduler import policy
from gpucloud.services import allocations as alloc_service
from gpucloud.services import catalog as offers
from gpucloud.services import operations, quotas
from gpucloud.services.errors import Conflict, Invalid, NotFound

OPEN = (ReservationStatus.ACCEPTED, ReservationStatus.ACTIVE)
OUT_OF_SERVICE = (NodeState.RETIRED, NodeState.RMA)
LONGEST_WINDOW = timedelta(days=90)
FURTHEST_START = timedelta(days=365)


@dataclass(frozen=True)
class ReservationAsk:
    gpu_type: str
    region: str
    node_count: int
    start_at: datetime
    end_at: datetime


def domain_sizes(session: Session, gpu_type: str, region: str) -> dict[str, int]:
    """The pool's in-service nodes per fabric domain (cordoned and under repair included: they come back)."""
    rows = session.execute(
        sa.select(col(Node.pod), sa.func.count())
        .where(
            col(Node.gpu_type) == gpu_type,
            col(Node.region) == region,
            col(Node.state).not_in([s.value for s in OUT_OF_SERVICE]),
        )
        .group_by(col(Node.pod))
    ).all()
    return dict(rows)


def _fits(sizes: dict[str, int], counts: list[int]) -> bool:
    """Best-fit decreasing: each reservation, largest first, into the domain it leaves least room in."""
    free = dict(sizes)
    for count in sorted(counts, reverse=True):
        fitting = [(room, domain) for domain, room in free.items() if room >= count]
        if not fitting:
            return False
        _, domain = min(fitting)
        free[domain] -= count
    return True


def feasible(sizes: dict[str, int], ask: ReservationAsk, others: list[CapacityReservation]) -> bool:
    """Whether `ask` fits beside `others` at every moment of its window."""
    overlapping = [r for r in others if r.start_at < ask.end_at and ask.start_at < r.end_at]
    moments = {ask.start_at} | {r.start_at for r in overlapping if ask.start_at <= r.start_at < ask.end_at}
    for t in sorted(moments):
        running = [r.node_count for r in overlapping if r.start_at <= t < r.end_at]
        if not _fits(sizes, [*running, ask.node_count]):
            return False
    return True


def _check_window(ask: ReservationAsk, now: datetime, settings: SchedulerSettings) -> None:
    earliest = now + timedelta(seconds=settings.reservation_min_notice_s)
    if ask.start_at < earliest:
        raise Invalid(
            "start_at",
            f"must be at least {settings.reservation_min_notice_s:g} s from now (the nodes are prepared ahead"
            f" of the window): {earliest.isoformat()} or later",
        )
    if ask.start_at > now + FURTHEST_START:
        raise Invalid("start_at", f"must be within {FURTHEST_START.days} days from now")
    if ask.end_at <= ask.start_at:
        raise Invalid("end_at", "must be after start_at")
    if ask.end_at - ask.start_at > LONGEST_WINDOW:
        raise Invalid("end_at", f"the window may be at most {LONGEST_WINDOW.days} days long")


def create(
    session: Session,
    tenant_id: str,
    ask: ReservationAsk,
    *,
    settings: SchedulerSettings,
    idempotency_tag: str | None = None,
    now: datetime | None = None,
) -> CapacityReservation:
    """Admit and record a reservation (see the module docstring); the one an earlier try of the same
    create recorded, under `idempotency_tag`."""
    if idempotency_tag is not None:
        earlier = session.exec(
            select(CapacityReservation).where(col(CapacityReservation.idempotency_key) == idempotency_tag)
        ).first()
        if earlier is not None:
            return earlier
    now = now or utcnow()
    _check_window(ask, now, settings)
    try:
        offers.require_offered(session, gpu_type=ask.gpu_type, region=ask.region)
        # Its GPUs against the quota's limit alone: what the tenant holds now is not held then.
        quotas.admit(
            session, tenant_id, gpu_type=ask.gpu_type, region=ask.region, node_count=ask.node_count, beside_usage=False
        )
    except offers.NotOffered as exc:
        raise offers.refusal(exc) from exc
    except quotas.REFUSED as exc:
        raise quotas.refusal(exc) from exc
    alloc_service.lock_pool(session, ask.gpu_type, ask.region)  # admissions of one pool take turns
    sizes = domain_sizes(session, ask.gpu_type, ask.region)
    others = list(
        session.exec(
            select(CapacityReservation).where(
                col(CapacityReservation.gpu_type) == ask.gpu_type,
                col(CapacityReservation.region) == ask.region,
                col(CapacityReservation.status).in_([s.value for s in OPEN]),
                col(CapacityReservation.end_at) > ask.start_at,
                col(CapacityReservation.start_at) < ask.end_at,
            )
        ).all()
    )
    if not feasible(sizes, ask, others):
        largest = max(sizes.values(), default=0)
        raise Conflict(
            f"the pool cannot hold {ask.node_count} {ask.gpu_type} nodes in one fabric domain of {ask.region} for"
            f" that window beside the {len(others)} reservation(s) already accepted over it (largest domain:"
            f" {largest} nodes); try fewer nodes or another window",
            type_="reservation-infeasible",
            title="The pool cannot honour the reservation",
            overlapping_reservations=len(others),
            largest_domain=largest,
        )
    row = CapacityReservation(
        tenant_id=tenant_id,
        gpu_type=ask.gpu_type,
        region=ask.region,
        node_count=ask.node_count,
        start_at=ask.start_at,
        end_at=ask.end_at,
        idempotency_key=idempotency_tag,
    )
    session.add(row)
    session.flush()
    return row


def get(session: Session, reservation_id: str, *, tenant_id: str | None) -> CapacityReservation:
    """One reservation the caller sees (a tenant: its own; `tenant_id` None: an operator)."""
    row = session.exec(select(CapacityReservation).where(col(CapacityReservation.id) == reservation_id)).first()
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        raise NotFound("reservation", reservation_id)
    return row


def cancel(session: Session, reservation_id: str, *, tenant_id: str | None, actor: str) -> CapacityReservation:
    """Cancel a reservation before its window begins (not billed); one whose window has begun
    is ended by cancelling its allocation instead (the window stays billed). The cancel is
    recorded as a settled operation (`reservation_cancel`) naming who asked (`Caller.actor`)."""
    row = get(session, reservation_id, tenant_id=tenant_id)
    # Compare-and-swap: a plan that begins the window at the same moment (ACCEPTED -> ACTIVE) wins,
    # and its allocation is never left running under a cancelled, unbilled reservation.
    cancelled = session.execute(
        sa.update(CapacityReservation)
        .where(col(CapacityReservation.id) == row.id, col(CapacityReservation.status) == ReservationStatus.ACCEPTED)
        .values(status=ReservationStatus.CANCELLED.value, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.refresh(row)
    if rowcount(cancelled) != 1:
        raise Conflict(
            f"reservation {row.id} is {row.status}: only an accepted reservation can be cancelled"
            + (f"; cancel its allocation {row.allocation_id} to end it early" if row.allocation_id else ""),
            type_="reservation-not-cancellable",
            title="Reservation cannot be cancelled",
        )
    operations.record_done(session, kind="reservation_cancel", resource_id=row.id, actor=actor, tenant_id=row.tenant_id)
    return row


def open_in_pool(session: Session, gpu_type: str, region: str) -> list[CapacityReservation]:
    return list(
        session.exec(
            select(CapacityReservation).where(
                col(CapacityReservation.gpu_type) == gpu_type,
                col(CapacityReservation.region) == region,
                col(CapacityReservation.status).in_([s.value for s in OPEN]),
            )
        ).all()
    )


def pools_with_open(session: Session) -> list[tuple[str, str]]:
    rows = session.exec(
        select(CapacityReservation.gpu_type, CapacityReservation.region)
        .where(col(CapacityReservation.status).in_([s.value for s in OPEN]))
        .distinct()
    ).all()
    return sorted((g, r) for g, r in rows)


# ---------------------------------------------------------------- carried out by the pool's scheduler


def for_policy(
    rows: list[CapacityReservation], running: Collection[str], pool: policy.Pool, settings: SchedulerSettings
) -> list[policy.CapacityReservation]:
    """The open reservations as the policy sees them: each window begins `reservation_prepare_s`
    early (its allocation is provisioned by the real start); an active one with no running
    allocation (`running`: the reservations that have one) is over and left out."""
    prepare = timedelta(seconds=settings.reservation_prepare_s)
    out = []
    for r in rows:
        if r.status == ReservationStatus.ACTIVE and r.id not in running:
            continue
        start = (r.start_at - prepare).timestamp()
        out.append(policy.CapacityReservation(r.id, r.tenant_id, pool, r.node_count, start, r.end_at.timestamp()))
    return out


def settle(session: Session, rows: list[CapacityReservation], *, now: datetime) -> None:
    """An active reservation whose allocation ended is ended; an accepted one past its end that was
    never placed is ended (late all its window); the first moment its allocation is ready is kept.
    One whose allocation failed before it was ever ready (the platform could not provision it) is
    accepted again, its window still to come or under way: the next plan places it anew."""
    ids = [r.allocation_id for r in rows if r.allocation_id is not None]
    allocs = {a.id: a for a in session.exec(select(Allocation).where(col(Allocation.id).in_(ids))).all()} if ids else {}
    for r in rows:
        alloc = allocs.get(r.allocation_id or "")
        changed = False
        if r.status == ReservationStatus.ACTIVE and alloc is not None:
            if alloc.status == AllocationStatus.READY and r.ready_at is None:
                r.ready_at, changed = now, True
            if alloc.status == AllocationStatus.FAILED and r.ready_at is None and r.end_at > now:
                r.status, r.allocation_id, changed = ReservationStatus.ACCEPTED, None, True
            elif alloc.status in TERMINAL_ALLOCATION:
                r.status, changed = ReservationStatus.ENDED, True
        elif r.status == ReservationStatus.ACCEPTED and r.end_at <= now:
            r.status, changed = ReservationStatus.ENDED, True
        if changed:
            r.updated_at = now
            session.add(r)


def place_window(
    session: Session,
    r: CapacityReservation,
    node_ids: tuple[str, ...],
    fabric_domain: str,
    *,
    now: datetime,
    deadline_scale: float,
) -> Allocation | None:
    """The reservation's allocation (tier `reserved`) on the nodes the policy chose, each reserved by
    compare-and-swap, with its create operation and events; None when the reservation moved on."""
    moved = session.execute(
        sa.update(CapacityReservation)
        .where(col(CapacityReservation.id) == r.id, col(CapacityReservation.status) == ReservationStatus.ACCEPTED)
        .values(status=ReservationStatus.ACTIVE.value, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if rowcount(moved) != 1:
        return None
    alloc = Allocation(
        tenant_id=r.tenant_id,
        gpu_type=r.gpu_type,
        region=r.region,
        node_count=r.node_count,
        tier="reserved",
        reservation_id=r.id,
        expected_duration_s=max(60, int((r.end_at - now).total_seconds())),
        node_ids=list(node_ids),
        fabric_domain=fabric_domain,
        placed_at=now,
    )
    nodes = session.exec(select(Node).where(col(Node.id).in_(node_ids))).all()
    if len(nodes) != len(node_ids):
        raise alloc_service.ReservationConflict(r.id)
    for node in sorted(nodes, key=lambda n: n.id):
        alloc_service.reserve_node(
            session,
            node,
            alloc.id,
            now=now,
            deadline_scale=deadline_scale,
            op_id=f"reserve-{alloc.id}",
            actor="scheduler",
        )
    session.add(alloc)
    session.add(
        Operation(
            tenant_id=r.tenant_id,
            kind="create_allocation",
            resource_id=alloc.id,
            workflow_id=allocation_workflow_id(alloc.id),
            actor="scheduler",
        )
    )
    session.execute(
        sa.update(CapacityReservation)
        .where(col(CapacityReservation.id) == r.id)
        .values(allocation_id=alloc.id)
        .execution_options(synchronize_session=False)
    )
    alloc_service.record_event(
        session,
        alloc,
        "placed",
        reason=f"capacity reservation {r.id}: {r.node_count} nodes of {fabric_domain} for the window"
        f" {r.start_at.isoformat()} to {r.end_at.isoformat()}",
        actor="scheduler",
    )
    return alloc


def end_window(session: Session, allocation_id: str, *, now: datetime) -> bool:
    """The reservation's window is over: cancel its allocation (intent, as a tenant's cancel; the
    workflow stops the workload with its grace period). Whether this call ended it."""
    alloc = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).first()
    if alloc is None or alloc.status in TERMINAL_ALLOCATION or alloc.desired == "cancelled":
        return False
    alloc_service.record_event(
        session,
        alloc,
        "reservation_ended",
        reason=f"capacity reservation {alloc.reservation_id} ended",
        actor="scheduler",
    )
    alloc_service.record_cancel_intent(session, alloc, tenant_id=alloc.tenant_id, actor="scheduler")
    return True


def provisioning_windows(
    session: Session, windows: list[CapacityReservation], *, skip: set[str]
) -> list[tuple[str, str]]:
    """Active reservations' allocations still provisioning (their workflows are started again:
    idempotent), but those in `skip`."""
    ids = [r.allocation_id for r in windows if r.status == ReservationStatus.ACTIVE and r.allocation_id]
    if not ids:
        return []
    rows = session.exec(
        select(Allocation).where(col(Allocation.id).in_(ids), col(Allocation.status) == AllocationStatus.PROVISIONING)
    ).all()
    return [(a.id, a.tenant_id) for a in rows if a.id not in skip]


def held_soon(session: Session, gpu_type: str, region: str, *, now: datetime, settings: SchedulerSettings) -> bool:
    """Whether a reservation of the pool holds nodes now (its hold began, its window not over): a
    create must then go through the policy, which keeps those nodes for it."""
    lead = timedelta(seconds=settings.reservation_hold_s + settings.reservation_prepare_s)
    return (
        session.exec(
            select(CapacityReservation.id).where(
                col(CapacityReservation.gpu_type) == gpu_type,
                col(CapacityReservation.region) == region,
                col(CapacityReservation.status).in_([s.value for s in OPEN]),
                col(CapacityReservation.start_at) <= now + lead,
            )
        ).first()
        is not None
    )


def _unbilled(gpu_type: str, region: str, now: datetime) -> tuple[sa.ColumnElement[bool], ...]:
    """A pool's reservations whose window has begun and whose allocation was ready (delivered: one
    the platform never made ready is never billed) that the ledger has not recorded."""
    return (
        col(CapacityReservation.gpu_type) == gpu_type,
        col(CapacityReservation.region) == region,
        col(CapacityReservation.status) != ReservationStatus.CANCELLED,
        col(CapacityReservation.start_at) <= now,
        col(CapacityReservation.ready_at).is_not(None),
        col(CapacityReservation.billed_at).is_(None),
    )


def unbilled(db: Database, gpu_type: str, region: str) -> list[CapacityReservation]:
    """The pool's reservations whose window has begun and that the ledger has not recorded."""
    with db.session() as session:
        rows = list(session.exec(select(CapacityReservation).where(*_unbilled(gpu_type, region, utcnow()))).all())
        for row in rows:
            session.expunge(row)
        return rows


def unbilled_count(session: Session, gpu_type: str, region: str, *, now: datetime) -> int:
    return session.exec(
        select(sa.func.count()).select_from(CapacityReservation).where(*_unbilled(gpu_type, region, now))
    ).one()


def mark_billed(db: Database, reservation_id: str) -> None:
    with db.session() as session:
        session.execute(
            sa.update(CapacityReservation)
            .where(col(CapacityReservation.id) == reservation_id, col(CapacityReservation.billed_at).is_(None))
            .values(billed_at=utcnow())
            .execution_options(synchronize_session=False)
        )
