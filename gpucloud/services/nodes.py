"""Node records: enrollment and the compare-and-swap transition, the only way a state changes.

Every change bumps `generation` under `WHERE generation = :seen`, and writes a NodeTransition
row in the same transaction, so concurrent writers (workflows, the API, a reconciler) can never
both win, and the history always matches the record.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, select

from gpucloud.models.node_states import NodeEvent, NodeState, deadline_for, is_transient, next_state
from gpucloud.models.tables import Node, NodeEnroll, NodeTransition, utcnow
from gpucloud.services.fleet import complete_drains


class NodeNotFound(LookupError):
    pass


class StaleNode(RuntimeError):
    """The node is not in the state the caller expected: someone else moved it first."""


def enroll_nodes(session: Session, nodes: Iterable[NodeEnroll]) -> tuple[list[str], list[str]]:
    """Create the records the fleet registers; known nodes keep their state. Returns (new, known)."""
    wanted = {n.id: n for n in nodes}
    known = set(session.exec(select(Node.id).where(Node.id.in_(list(wanted)))).all()) if wanted else set()
    now = utcnow()
    for node_id, spec in wanted.items():
        if node_id in known:
            # A re-registering agent may have moved (new URL); its state is ours to keep.
            session.execute(sa.update(Node).where(Node.id == node_id).values(agent_url=spec.agent_url))
            continue
        session.add(Node(**spec.model_dump(), state_entered_at=now, created_at=now, updated_at=now))
    return [i for i in wanted if i not in known], [i for i in wanted if i in known]


def transition(
    session: Session,
    node_id: str,
    event: NodeEvent | str,
    *,
    from_state: NodeState | str,
    op_id: str | None = None,
    cause: str = "",
    actor: str = "system",
    now: datetime | None = None,
    deadline_scale: float = 1.0,
    **changes: object,
) -> Node:
    """Apply `event` to a node that must be in `from_state`; compare-and-swap on generation.

    Idempotent per `op_id`: if the node's newest transition is this very op and event (a retry
    after the first try committed), the current record is returned unchanged.
    """
    node = session.get(Node, node_id)
    if node is None:
        raise NodeNotFound(f"node {node_id!r} does not exist")
    if node.state != from_state:
        if op_id and _last_transition_is(session, node_id, op_id, str(event)):
            return node
        raise StaleNode(
            f"node {node_id} is {node.state!r}, expected {str(from_state)!r} for event {str(event)!r}"
        )
    to_state = next_state(from_state, event)
    now = now or utcnow()
    values = {"state": to_state.value, "generation": node.generation + 1, "state_entered_at": now,
              "updated_at": now, "deadline_at": deadline_for(to_state, now, scale=deadline_scale),
              **_implied_changes(NodeState(from_state), NodeEvent(event), to_state), **changes}
    result = session.execute(
        sa.update(Node)
        .where(Node.id == node_id, Node.generation == node.generation)
        .values(**values)
    )
    if result.rowcount != 1:
        raise StaleNode(f"node {node_id} changed under us (generation {node.generation})")
    session.add(NodeTransition(
        node_id=node_id, from_state=str(from_state), to_state=to_state.value, event=str(event),
        cause=cause, actor=actor, op_id=op_id, generation=node.generation + 1, at=now,
    ))
    if to_state == NodeState.QUARANTINED:
        complete_drains(session, node_id)
    session.flush()
    session.refresh(node)
    return node


def _implied_changes(from_state: NodeState, event: NodeEvent, to_state: NodeState) -> dict[str, object]:
    """Membership follows state, in the same write: a node being wiped (or unreserved) belongs
    to no allocation; a node whose wipe succeeded holds no tenant's data."""
    changes: dict[str, object] = {}
    if to_state in (NodeState.WIPING, NodeState.AVAILABLE, NodeState.QUARANTINED):
        changes["allocation_id"] = None
    if from_state in (NodeState.WIPING, NodeState.REPAIRING) and event == NodeEvent.OK:
        changes["tenant_id"] = None  # both steps wipe the disks first
    if from_state == NodeState.BURN_IN and to_state == NodeState.AVAILABLE:
        # Burn-in is the gate that verifies a repair: what the health rules held against the
        # node is cleared with it (the XIDs stay on record for the lemon rule).
        changes["health"] = "ok"
        changes["health_conditions"] = []
    if not is_transient(to_state):
        # Converged: the reconciler's backoff for this node starts over.
        changes["reconcile_attempts"] = 0
        changes["next_reconcile_at"] = None
    if to_state == NodeState.QUARANTINED:
        changes["drain_requested"] = False  # a drain's intent is fulfilled
    return changes


def _last_transition_is(session: Session, node_id: str, op_id: str, event: str) -> bool:
    last = session.exec(
        select(NodeTransition).where(NodeTransition.node_id == node_id)
        .order_by(NodeTransition.seq.desc()).limit(1)
    ).first()
    return last is not None and last.op_id == op_id and last.event == event
