"""Allocations: atomic gang reservation, cancellation intent, and status changes.

A gang is N whole nodes of one GPU type in one region inside one fabric domain (an InfiniBand
pod); a slice of an NVL72 rack (`nvl72_trays`) is N trays inside one NVLink domain (a rack, which
sits in one pod). It is reserved in one transaction with a compare-and-swap per node: either all N nodes
move available -> reserved for this allocation, or none do. Concurrent requests cannot share a
node: the loser's CAS fails, its transaction rolls back, and it tries again on fresh data.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.db import rowcount
from gpucloud.models.health_tables import AllocationEvent
from gpucloud.models.node_states import NodeEvent, NodeState, deadline_for
from gpucloud.models.tables import (
    SYSTEM_ACTOR,
    TERMINAL_ALLOCATION,
    Allocation,
    AllocationStatus,
    Node,
    Operation,
    OperationStatus,
    utcnow,
)
from gpucloud.models.workflow_ids import allocation_workflow_id
from gpucloud.services import nodes as node_service
from gpucloud.services.catalog import allocatable, not_diagnosing
from gpucloud.web import metrics


class InsufficientCapacity(Exception):
    def __init__(
        self,
        *,
        gpu_type: str,
        region: str,
        wanted: int,
        largest_domain: int,
        total: int,
        domain: str = "fabric domain",
        unit: str = "nodes",
        queued: int = 0,
    ):
        if queued:
            message = (
                f"{queued} request(s) are queued for {gpu_type} in {region} and the queue's order leaves no"
                f" {domain} with {wanted} {unit} for this one now (available in region: {total});"
                " create it with capacity.wait = 'queue' to wait in line, or try later"
            )
        else:
            message = (
                f"no {domain} in {region} has {wanted} available {gpu_type} {unit}"
                f" (largest: {largest_domain}, available in region: {total}); try fewer {unit}, later,"
                " or with capacity.wait = 'queue' to wait for room"
            )
        super().__init__(message)
        self.wanted, self.largest_domain, self.total, self.queued = wanted, largest_domain, total, queued


class ReservationConflict(Exception):
    """Another transaction took one of the chosen nodes first; retry on fresh data."""


def pick_gang(candidates: list[Node], wanted: int) -> list[Node] | None:
    """Choose `wanted` nodes inside one pod: the tightest pod that fits, racks packed in order.

    Tightest fit keeps big pods whole for big gangs (less fragmentation).
    """
    by_pod: dict[str, list[Node]] = defaultdict(list)
    for node in candidates:
        by_pod[node.pod].append(node)
    fitting = [(len(nodes), pod) for pod, nodes in by_pod.items() if len(nodes) >= wanted]
    if not fitting:
        return None
    _, pod = min(fitting)
    return sorted(by_pod[pod], key=lambda n: (n.rack, n.id))[:wanted]


def pick_slice(candidates: list[Node], trays: int) -> list[Node] | None:
    """Choose `trays` nodes inside one NVLink domain (an NVL72 rack): the tightest rack that fits."""
    by_domain: dict[str, list[Node]] = defaultdict(list)
    for node in candidates:
        if node.nvlink_domain is not None:
            by_domain[node.nvlink_domain].append(node)
    fitting = [(len(nodes), domain) for domain, nodes in by_domain.items() if len(nodes) >= trays]
    if not fitting:
        return None
    _, domain = min(fitting)
    return sorted(by_domain[domain], key=lambda n: n.id)[:trays]


def available_candidates(
    session: Session, *, gpu_type: str, region: str, pod: str | None = None, nvlink_domain: str | None = None
) -> list[Node]:
    """Nodes a reservation may take: available, healthy, and neither cordoned nor in maintenance."""
    query = select(Node).where(col(Node.gpu_type) == gpu_type, col(Node.region) == region, *allocatable())
    if pod is not None:
        query = query.where(col(Node.pod) == pod)
    if nvlink_domain is not None:
        query = query.where(col(Node.nvlink_domain) == nvlink_domain)
    return list(session.exec(query).all())


def reserve_node(
    session: Session, node: Node, allocation_id: str, *, now: datetime, deadline_scale: float, op_id: str, actor: str
) -> None:
    """available -> reserved for the allocation, compare-and-swap on the generation seen."""
    result = session.execute(
        sa.update(Node)
        .where(
            col(Node.id) == node.id,
            col(Node.generation) == node.generation,
            col(Node.state) == NodeState.AVAILABLE,
            # A diagnostic that leased the node since it was picked keeps it (`services/diagnostics.py`).
            not_diagnosing(now),
        )
        .values(
            state=NodeState.RESERVED.value,
            generation=node.generation + 1,
            allocation_id=allocation_id,
            state_entered_at=now,
            updated_at=now,
            deadline_at=deadline_for(NodeState.RESERVED, now, scale=deadline_scale),
        )
    )
    if rowcount(result) != 1:
        raise ReservationConflict(node.id)
    session.add(
        node_service.NodeTransition(
            node_id=node.id,
            from_state=NodeState.AVAILABLE.value,
            to_state=NodeState.RESERVED.value,
            event=NodeEvent.RESERVE.value,
            cause=f"allocation {allocation_id}",
            actor=actor,
            op_id=op_id,
            generation=node.generation + 1,
            at=now,
        )
    )


def lock_pool(session: Session, gpu_type: str, region: str) -> None:
    """Reservations from one pool (GPU type and region) take turns, so concurrent creates pick
    disjoint free nodes instead of racing for the same ones and giving up: on Postgres a lock held
    until the transaction ends; SQLite's one writer (BEGIN IMMEDIATE) already takes turns."""
    if session.get_bind().dialect.name != "postgresql":
        return
    digest = hashlib.blake2b(f"{gpu_type}/{region}".encode(), digest_size=8).digest()
    session.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": int.from_bytes(digest, "big", signed=True)})


def reserve_gang(
    session: Session, allocation: Allocation, *, now: datetime | None = None, deadline_scale: float = 1.0
) -> list[Node]:
    lock_pool(session, allocation.gpu_type, allocation.region)
    candidates = available_candidates(session, gpu_type=allocation.gpu_type, region=allocation.region)
    if allocation.nvl72_trays is not None:
        gang = pick_slice(candidates, allocation.nvl72_trays)
    else:
        gang = pick_gang(candidates, allocation.node_count)
    if gang is None:
        sizes: defaultdict[str | None, int] = defaultdict(int)
        for n in candidates:
            sizes[n.nvlink_domain if allocation.nvl72_trays is not None else n.pod] += 1
        sizes.pop(None, None)
        slice_ = allocation.nvl72_trays is not None
        raise InsufficientCapacity(
            gpu_type=allocation.gpu_type,
            region=allocation.region,
            wanted=allocation.node_count,
            largest_domain=max(sizes.values(), default=0),
            total=len(candidates),
            domain="NVL72 rack" if slice_ else "fabric domain",
            unit="trays" if slice_ else "nodes",
        )
    now = now or utcnow()
    for node in gang:
        reserve_node(
            session,
            node,
            allocation.id,
            now=now,
            deadline_scale=deadline_scale,
            op_id=f"reserve-{allocation.id}",
            actor="api",
        )
    allocation.fabric_domain = gang[0].pod
    if allocation.nvl72_trays is not None:
        allocation.nvlink_domain = gang[0].nvlink_domain
    allocation.node_ids = [n.id for n in gang]
    return gang


def record_event(
    session: Session,
    allocation: Allocation,
    kind: str,
    *,
    reason: str,
    node_id: str | None = None,
    replacement_node_id: str | None = None,
    actor: str = SYSTEM_ACTOR,
) -> None:
    """Append to the allocation's event log (what its tenant reads), naming who caused it."""
    session.add(
        AllocationEvent(
            allocation_id=allocation.id,
            tenant_id=allocation.tenant_id,
            kind=kind,
            node_id=node_id,
            replacement_node_id=replacement_node_id,
            reason=reason[:1000],
            actor=actor,
            at=utcnow(),
        )
    )


# What the tenant reads of the allocation workflow's own status changes (the API records
# `requested` and `cancel_requested`, the replacement service `degraded`, `replaced` and a
# replacement's `ready`): the kind of each event, and its reason when the change names none.
STATUS_EVENTS: dict[AllocationStatus, tuple[str, str]] = {
    AllocationStatus.READY: ("ready", "every node provisioned"),
    AllocationStatus.RELEASED: ("released", "every node released"),
    AllocationStatus.FAILED: ("failed", "the allocation failed"),
}


def record_status_event(session: Session, allocation: Allocation, previous: str) -> None:
    """The event for the allocation's move from `previous` to its status now (none when it did not
    move, or to a status the tenant learns of from another event)."""
    if allocation.status == previous or (event := STATUS_EVENTS.get(AllocationStatus(allocation.status))) is None:
        return
    kind, reason = event
    record_event(session, allocation, kind, reason=allocation.failure_reason or reason)


def record_node_provisioning(session: Session, allocation_id: str, node_id: str) -> None:
    """A node of the allocation starts provisioning (the first gang, or a replacement)."""
    allocation = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).first()
    if allocation is not None:
        record_event(session, allocation, "provisioning", node_id=node_id, reason=f"provisioning node {node_id}")


def record_cancel_intent(session: Session, allocation: Allocation, *, tenant_id: str, actor: str) -> Operation | None:
    """Cancellation is intent: record desired=cancelled, with an operation and an allocation
    event that name `actor`; None when there is nothing left to do."""
    if allocation.status in TERMINAL_ALLOCATION:
        return None
    existing = session.exec(
        select(Operation).where(col(Operation.resource_id) == allocation.id, col(Operation.kind) == "cancel_allocation")
    ).first()
    if existing is not None:
        return existing
    now = utcnow()
    allocation.desired = "cancelled"
    allocation.status = AllocationStatus.CANCELLING
    allocation.updated_at = now
    session.add(allocation)
    op = Operation(
        tenant_id=tenant_id,
        kind="cancel_allocation",
        resource_id=allocation.id,
        workflow_id=allocation_workflow_id(allocation.id),
        actor=actor,
    )
    session.add(op)
    record_event(session, allocation, "cancel_requested", reason=f"cancelled by {actor}", actor=actor)
    return op


def set_status(
    session: Session, allocation_id: str, status: AllocationStatus, *, failure_reason: str | None = None
) -> Allocation:
    """Move an allocation's status and settle the operations that were waiting for it."""
    allocation = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).one()
    now = utcnow()
    if allocation.status in TERMINAL_ALLOCATION:
        return allocation
    if status == AllocationStatus.READY and allocation.desired == "cancelled":
        # A cancel arrived while provisioning: the tenant sees `cancelling`, never `ready`.
        status = AllocationStatus.CANCELLING
    if status == AllocationStatus.READY and allocation.status == AllocationStatus.PROVISIONING:
        metrics.ALLOCATION_READY.observe((now - allocation.created_at).total_seconds())
    allocation.status = status
    allocation.failure_reason = failure_reason
    allocation.updated_at = now
    session.add(allocation)
    running = session.exec(
        select(Operation).where(
            col(Operation.resource_id) == allocation_id, col(Operation.status) == OperationStatus.RUNNING
        )
    ).all()
    for op in running:
        outcome = _operation_outcome(op.kind, status, failure_reason)
        if outcome is not None:
            op.status, op.error = outcome
            op.updated_at = now
            session.add(op)
    return allocation


def _operation_outcome(kind: str, status: AllocationStatus, reason: str | None):
    if status == AllocationStatus.FAILED:
        return OperationStatus.FAILED, reason or "allocation failed"
    if kind == "create_allocation" and status == AllocationStatus.READY:
        return OperationStatus.SUCCEEDED, None
    if kind == "create_allocation" and status == AllocationStatus.RELEASED:
        return OperationStatus.FAILED, "cancelled before the allocation became ready"
    if kind == "cancel_allocation" and status == AllocationStatus.RELEASED:
        return OperationStatus.SUCCEEDED, None
    return None
