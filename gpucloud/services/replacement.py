"""Drain-and-replace inside an allocation: pull the bad node out, reserve one in the same fabric
domain (the same NVL72 rack for a slice of one), attach it once provisioned. Each function is one
short transaction the allocation workflow calls through an activity, and each is idempotent (a
retried activity changes nothing twice). The tenant's view of it is the allocation's event log
(`AllocationEvent`).
"""

from __future__ import annotations

from sqlmodel import Session, col, select

from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Allocation, AllocationStatus, Node, utcnow
from gpucloud.services.allocations import (
    ReservationConflict,
    available_candidates,
    lock_pool,
    record_event,
    set_status,
)
from gpucloud.services.allocations import reserve_node as cas_reserve

RESERVE_ATTEMPTS = 5


def _allocation(session: Session, allocation_id: str) -> Allocation:
    return session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).one()


def detach_node(session: Session, allocation_id: str, node_id: str, *, reason: str) -> Allocation:
    """The node leaves the allocation's membership; the allocation is `degraded` with the reason."""
    allocation = _allocation(session, allocation_id)
    if node_id not in allocation.node_ids:
        return allocation
    allocation.node_ids = [n for n in allocation.node_ids if n != node_id]
    session.add(allocation)
    record_event(session, allocation, "degraded", node_id=node_id, reason=f"node {node_id} pulled: {reason}")
    return set_status(
        session,
        allocation_id,
        AllocationStatus.DEGRADED,
        failure_reason=f"node {node_id} pulled: {reason}; replacement pending",
    )


def detach_nodes(session: Session, allocation_id: str, pulls: list[tuple[str, str]]) -> tuple[Allocation, list[str]]:
    """Pull many reported nodes ((node id, reason) each) out of the allocation in one
    transaction; returns the allocation and the nodes pulled.

    Pulled means a member until now, or one this same pull already took out on an earlier try
    (its answer lost): no longer a member, yet still held for the allocation and `active`, as a
    pulled node stays until its drain starts. A node gone earlier (draining, released) or never a
    member is skipped, so a retry returns what the first try did.

    A member an open fleet incident holds (`services/fleet_incidents.py`: a leaf switch, rack or
    PDU is suspected, not the node) stays: a fault reported before the burst behind its component
    showed gave the tenant a grace period, and the incident it joined meanwhile holds the pull."""
    allocation = _allocation(session, allocation_id)
    wanted = [node_id for node_id, _ in pulls]
    held = set(
        session.exec(
            select(col(Node.id)).where(col(Node.id).in_(wanted), col(Node.fleet_incident_id).is_not(None))
        ).all()
    )
    members = set(allocation.node_ids) - held
    # Only a retry reports nodes that are no longer members: look those up, and nothing else.
    outside = [node_id for node_id in wanted if node_id not in members and node_id not in held]
    held_active = set(
        session.exec(
            select(col(Node.id)).where(
                col(Node.id).in_(outside),
                col(Node.allocation_id) == allocation_id,
                col(Node.state) == NodeState.ACTIVE.value,
            )
        ).all()
        if outside
        else ()
    )
    pulled = [node_id for node_id in wanted if node_id in members or node_id in held_active]
    for node_id, reason in pulls:
        if node_id in members:
            allocation = detach_node(session, allocation_id, node_id, reason=reason)
    return allocation, pulled


def reserve_replacement(
    session: Session, allocation_id: str, *, deadline_scale: float, exclude: frozenset[str] = frozenset()
) -> tuple[str | None, str]:
    """One node for the allocation, in its fabric domain; (node id, "") or (None, why not).

    A node already reserved (or provisioning) for the allocation but not yet attached is the
    replacement a previous try reserved: it is returned again.
    """
    allocation = _allocation(session, allocation_id)
    pending = session.exec(
        select(col(Node.id)).where(
            col(Node.allocation_id) == allocation_id,
            col(Node.state).in_([NodeState.RESERVED.value, NodeState.PROVISIONING.value]),
            col(Node.id).not_in(allocation.node_ids),
        )
    ).first()
    if pending is not None:
        return pending, ""
    lock_pool(session, allocation.gpu_type, allocation.region)
    for _ in range(RESERVE_ATTEMPTS):
        # A slice of an NVL72 rack is replaced from the same rack: its NVLink partition spans one.
        found = available_candidates(
            session,
            gpu_type=allocation.gpu_type,
            region=allocation.region,
            pod=allocation.fabric_domain,
            nvlink_domain=allocation.nvlink_domain,
        )
        candidates = sorted((n for n in found if n.id not in exclude), key=lambda n: (n.rack, n.id))
        if not candidates:
            where = (
                f"NVL72 rack {allocation.nvlink_domain}"
                if allocation.nvlink_domain
                else f"fabric domain {allocation.fabric_domain}"
            )
            return None, f"no available {allocation.gpu_type} node in {where}; waiting for capacity"
        try:
            # A lost CAS wrote nothing: look again on fresh data.
            cas_reserve(
                session,
                candidates[0],
                allocation_id,
                now=utcnow(),
                deadline_scale=deadline_scale,
                op_id=f"replace-{allocation_id}",
                actor="allocation",
            )
            return candidates[0].id, ""
        except ReservationConflict:
            session.expire_all()
    return None, "replacement capacity contended; retrying"


def attach_node(session: Session, allocation_id: str, node_id: str, *, replaces: str, ready: bool) -> Allocation:
    allocation = _allocation(session, allocation_id)
    if node_id in allocation.node_ids:
        return allocation
    allocation.node_ids = [*allocation.node_ids, node_id]
    session.add(allocation)
    record_event(
        session,
        allocation,
        "replaced",
        node_id=replaces,
        replacement_node_id=node_id,
        reason=f"node {replaces} replaced by {node_id}",
    )
    if not ready:
        return allocation
    record_event(session, allocation, "ready", reason="every node healthy again")
    return set_status(session, allocation_id, AllocationStatus.READY)
