"""Node records: enrollment and the compare-and-swap transition, the only way a state changes.

Every change bumps `generation` under `WHERE generation = :seen`, and writes a NodeTransition
row in the same transaction, so concurrent writers (workflows, the API, a reconciler) can never
both win, and the history always matches the record. A move that takes the node out of its
tenant's hands (`node_states.ends_tenancy`) revokes the node's agent credential in that same
transaction, so no path out of an allocation can leave the tenant's copy working.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.db import rowcount, table_of
from gpucloud.models.messages import NodeTransitionInput
from gpucloud.models.node_states import (
    InvalidTransition,
    NodeEvent,
    NodeState,
    deadline_for,
    ends_tenancy,
    is_transient,
    next_state,
)
from gpucloud.models.tables import Node, NodeEnroll, NodeTransition, Operation, OperationStatus, utcnow
from gpucloud.reconciler.plan import backoff
from gpucloud.services import agent_credentials, node_conditions


class NodeNotFound(LookupError):
    pass


class StaleNode(RuntimeError):
    """The node is not in the state the caller expected: someone else moved it first."""


def enroll_nodes(session: Session, nodes: Iterable[NodeEnroll]) -> tuple[list[str], list[str]]:
    """Create the records the fleet registers; known nodes keep their state. Returns (new, known)."""
    wanted = {n.id: n for n in nodes}
    known = set(session.exec(select(col(Node.id)).where(col(Node.id).in_(list(wanted)))).all()) if wanted else set()
    now = utcnow()
    for node_id, spec in wanted.items():
        if node_id in known:
            # A re-registering agent may have moved (new URL), and the network may have given the
            # node another address (a restarted simulated fleet: new ports); its state is ours to keep.
            moved = {"agent_url": spec.agent_url, "ssh_host": spec.ssh_host, "ssh_port": spec.ssh_port}
            # Where it sits, when the inventory says (a node enrolled before it was recorded).
            moved |= {k: v for k, v in (("leaf_switch", spec.leaf_switch), ("pdu", spec.pdu)) if v is not None}
            session.execute(sa.update(Node).where(col(Node.id) == node_id).values(**moved))
            continue
        session.add(Node(**spec.model_dump(), state_entered_at=now, created_at=now, updated_at=now))
    return [i for i in wanted if i not in known], [i for i in wanted if i in known]


BRINGUP_STATES = (NodeState.ENROLLED.value, NodeState.INSPECTING.value)
# Every state a bring-up batch moves its nodes through, each held until its deadline.
BRINGUP_BATCH_STATES = (*BRINGUP_STATES, NodeState.WIPING.value, NodeState.BURN_IN.value)


def lease_for_bringup(
    session: Session, node_ids: list[str], *, deadline_scale: float = 1.0, now: datetime | None = None
) -> list[str]:
    """Hold nodes waiting for bring-up for a batch about to start: the reconciler leaves them
    alone until the inspection deadline (by then the batch has moved them on, renewing the hold
    to each state's deadline, or the deadline sends them to their failure target).

    Returns the ids that are waiting for bring-up and not held already (in the order given).
    """
    if not node_ids:
        return []
    now = now or utcnow()
    until = deadline_for(NodeState.INSPECTING, now, scale=deadline_scale)
    # One conditional UPDATE: of two callers racing for a node, only one sees it free (Postgres
    # re-checks the WHERE after waiting on the row lock; SQLite writers are serialized).
    held = set(
        session.execute(
            sa.update(Node)
            .where(
                col(Node.id).in_(node_ids),
                col(Node.state).in_(BRINGUP_STATES),
                col(Node.allocation_id).is_(None),
                sa.or_(col(Node.next_reconcile_at).is_(None), col(Node.next_reconcile_at) <= now),
            )
            .values(next_reconcile_at=until)
            .returning(col(Node.id))
            .execution_options(synchronize_session=False)
        )
        .scalars()
        .all()
    )
    return [i for i in node_ids if i in held]


def release_bringup_holds(
    session: Session, node_ids: list[str], *, base_s: float, cap_s: float, now: datetime | None = None
) -> int:
    """Hand nodes a bring-up batch could not finish back to the reconciler, after a backoff
    that doubles with each attempt (so a silent agent is retried ever more slowly)."""
    now = now or utcnow()
    nodes = session.exec(
        select(Node).where(
            col(Node.id).in_(node_ids),
            col(Node.state).in_(BRINGUP_BATCH_STATES),
            col(Node.allocation_id).is_(None),
        )
    ).all()
    for node in nodes:
        node.reconcile_attempts += 1
        node.next_reconcile_at = now + backoff(node.reconcile_attempts, base_s=base_s, cap_s=cap_s)
        node.updated_at = now
        session.add(node)
    return len(nodes)


def held_for_bringup(session: Session, now: datetime | None = None) -> int:
    """Nodes a bring-up batch holds: they count against the global limit on node operations."""
    now = now or utcnow()
    return session.exec(
        select(sa.func.count())
        .select_from(Node)
        .where(
            col(Node.state).in_(BRINGUP_BATCH_STATES),
            col(Node.allocation_id).is_(None),
            col(Node.next_reconcile_at) > now,
        )
    ).one()


def waiting_for_bringup(session: Session, limit: int, now: datetime | None = None) -> list[str]:
    """Enrolled nodes no batch holds and no backoff keeps back, oldest id first: what an
    enrolment beyond the global limit left for later."""
    now = now or utcnow()
    return list(
        session.exec(
            select(col(Node.id))
            .where(
                col(Node.state) == NodeState.ENROLLED.value,
                sa.or_(col(Node.next_reconcile_at).is_(None), col(Node.next_reconcile_at) <= now),
            )
            .order_by(col(Node.id))
            .limit(limit)
        ).all()
    )


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
        raise StaleNode(f"node {node_id} is {node.state!r}, expected {str(from_state)!r} for event {str(event)!r}")
    to_state = next_state(from_state, event)
    now = now or utcnow()
    values = {
        "state": to_state.value,
        "generation": node.generation + 1,
        "state_entered_at": now,
        "updated_at": now,
        "deadline_at": deadline_for(to_state, now, scale=deadline_scale),
        **_implied_changes(NodeState(from_state), NodeEvent(event), to_state),
        **changes,
    }
    result = session.execute(
        sa.update(Node).where(col(Node.id) == node_id, col(Node.generation) == node.generation).values(**values)
    )
    if rowcount(result) != 1:
        raise StaleNode(f"node {node_id} changed under us (generation {node.generation})")
    session.add(
        NodeTransition(
            node_id=node_id,
            from_state=str(from_state),
            to_state=to_state.value,
            event=str(event),
            cause=cause,
            actor=actor,
            op_id=op_id,
            generation=node.generation + 1,
            at=now,
        )
    )
    if ends_tenancy(from_state, to_state):
        agent_credentials.revoke(session, [node_id], now=now)
    if to_state == NodeState.QUARANTINED:
        complete_drains(session, node_id)
    if from_state == NodeState.BURN_IN and to_state == NodeState.AVAILABLE and node.cordoned:
        _lift_health_cordon(session, node_id, generation=node.generation + 1, now=now)
    session.flush()
    session.refresh(node)
    return node


def _lift_health_cordon(session: Session, node_id: str, *, generation: int, now: datetime) -> None:
    """The burn-in the health loop's pull led to has passed: its cordon goes with it. An
    operator's cordon (the newest cordon event is not the health loop's) stays."""
    last = session.exec(
        select(NodeTransition)
        .where(
            col(NodeTransition.node_id) == node_id,
            col(NodeTransition.event).in_(["cordon", "uncordon", "drain"]),
            # marks (operator or health), not the drain operation's own state changes
            col(NodeTransition.from_state) == col(NodeTransition.to_state),
        )
        .order_by(col(NodeTransition.seq).desc())
        .limit(1)
    ).first()
    if last is None or last.event == "uncordon" or last.actor != "health":
        return
    session.execute(sa.update(Node).where(col(Node.id) == node_id).values(cordoned=False))
    session.add(
        NodeTransition(
            node_id=node_id,
            from_state=NodeState.AVAILABLE.value,
            to_state=NodeState.AVAILABLE.value,
            event="uncordon",
            cause="burn-in passed: the health loop's cordon is lifted",
            actor="health",
            generation=generation,
            at=now,
        )
    )


def transition_many(
    session: Session,
    steps: list[NodeTransitionInput],
    *,
    deadline_scale: float = 1.0,
    lease_to_deadline: bool = False,
    now: datetime | None = None,
) -> list[tuple[str, str | None, str | None]]:
    """`transition` for a batch of nodes in a handful of statements: (node id, new state, None)
    per applied or already-applied step, (node id, None, why) per refused one.

    The same rules as one at a time: a step applies only from its `from_state` (a retry whose
    step is already the node's newest transition is reported applied), bumps `generation`, and
    writes its NodeTransition row in the same transaction. The batch's rows are locked first
    (FOR UPDATE on Postgres; SQLite has one writer), so the generation checks cannot lose to a
    concurrent writer; if one somehow does, the whole batch rolls back.
    """
    now = now or utcnow()
    ids = list(dict.fromkeys(s.node_id for s in steps))
    nodes = {n.id: n for n in session.exec(select(Node).where(col(Node.id).in_(ids)).with_for_update()).all()}
    seen: dict[str, tuple[str, int]] = {i: (n.state, n.generation) for i, n in nodes.items()}
    outcomes: list[tuple[str, str | None, str | None]] = []
    updates: dict[tuple[str, ...], list[dict]] = {}
    rows: list[dict] = []
    quarantined: list[str] = []
    left_tenant: list[str] = []
    for step in steps:
        if step.node_id not in seen:
            outcomes.append((step.node_id, None, f"node {step.node_id!r} does not exist"))
            continue
        state, generation = seen[step.node_id]
        if state != step.from_state:
            if step.op_id and _last_transition_is(session, step.node_id, step.op_id, step.event):
                outcomes.append((step.node_id, state, None))
            else:
                outcomes.append(
                    (
                        step.node_id,
                        None,
                        f"node {step.node_id} is {state!r}, expected {step.from_state!r} for event {step.event!r}",
                    )
                )
            continue
        try:
            to_state = next_state(state, step.event)
        except InvalidTransition as exc:
            outcomes.append((step.node_id, None, str(exc)))
            continue
        deadline = deadline_for(to_state, now, scale=deadline_scale)
        values = {
            "state": to_state.value,
            "generation": generation + 1,
            "state_entered_at": now,
            "updated_at": now,
            "deadline_at": deadline,
            **_implied_changes(NodeState(state), NodeEvent(step.event), to_state),
        }
        if step.tenant_id is not None:
            values["tenant_id"] = step.tenant_id  # entering provisioning, as `transition` does
        if lease_to_deadline and deadline is not None:
            values["next_reconcile_at"] = deadline
        updates.setdefault(tuple(sorted(values)), []).append({**values, "_id": step.node_id, "_generation": generation})
        rows.append(
            {
                "node_id": step.node_id,
                "from_state": state,
                "to_state": to_state.value,
                "event": step.event,
                "cause": step.cause,
                "actor": step.actor,
                "op_id": step.op_id,
                "generation": generation + 1,
                "at": now,
            }
        )
        if to_state == NodeState.QUARANTINED:
            quarantined.append(step.node_id)
        if ends_tenancy(state, to_state):
            left_tenant.append(step.node_id)
        seen[step.node_id] = (to_state.value, generation + 1)
        outcomes.append((step.node_id, to_state.value, None))
    table = table_of(Node)
    for columns, params in updates.items():
        stmt = (
            sa.update(table)
            .where(table.c.id == sa.bindparam("_id"), table.c.generation == sa.bindparam("_generation"))
            .values({c: sa.bindparam(c) for c in columns})
        )
        result = session.connection().execute(stmt, params)
        if rowcount(result) != len(params):
            raise StaleNode(f"{len(params) - rowcount(result)} of the batch's nodes changed under us")
    if rows:
        session.connection().execute(sa.insert(table_of(NodeTransition)), rows)
    agent_credentials.revoke(session, left_tenant, now=now)
    for node_id in quarantined:
        complete_drains(session, node_id)
    session.expire_all()  # the loaded nodes are stale now
    return outcomes


# A node moved into one of these belongs to no allocation any more (`_implied_changes`).
LEAVES_ALLOCATION = frozenset({NodeState.WIPING, NodeState.AVAILABLE, NodeState.QUARANTINED})


def _implied_changes(from_state: NodeState, event: NodeEvent, to_state: NodeState) -> dict[str, object]:
    """Membership follows state, in the same write: a node being wiped (or unreserved) belongs
    to no allocation; a node whose wipe succeeded holds no tenant's data."""
    changes: dict[str, object] = {}
    if to_state in LEAVES_ALLOCATION:
        changes["allocation_id"] = None
    if from_state in (NodeState.WIPING, NodeState.REPAIRING) and event == NodeEvent.OK:
        changes["tenant_id"] = None  # both steps wipe the disks first
    if from_state == NodeState.BURN_IN and to_state == NodeState.AVAILABLE:
        # Burn-in is the gate that verifies a repair: what the health rules held against the
        # node is cleared with it.
        changes.update(node_conditions.cleared())
    if not is_transient(to_state):
        # Converged: the reconciler's backoff for this node starts over.
        changes["reconcile_attempts"] = 0
        changes["next_reconcile_at"] = None
    if to_state == NodeState.QUARANTINED:
        changes["drain_requested"] = False  # a drain's intent is fulfilled
    return changes


def _last_transition_is(session: Session, node_id: str, op_id: str, event: str) -> bool:
    last = session.exec(
        select(NodeTransition)
        .where(col(NodeTransition.node_id) == node_id)
        .order_by(col(NodeTransition.seq).desc())
        .limit(1)
    ).first()
    return last is not None and last.op_id == op_id and last.event == event


LEAVING_STATES = frozenset({NodeState.RELEASING.value, NodeState.DRAINING.value})
"""States in which a node still records its allocation, but its tenant is letting it go."""


@dataclass(frozen=True)
class Holding:
    """Who holds a node now: its tenant, the allocation it serves in (None when it serves in
    none, or is leaving one), and the URL its agent answers on."""

    tenant_id: str | None
    allocation_id: str | None
    agent_url: str


def holdings(session: Session, node_ids: Collection[str]) -> dict[str, Holding]:
    """Each known node's `Holding`, read now: for those that must stop sending a tenant's data
    to a node the moment it leaves the tenant (a rollout's steps, the tracker and the origin)."""
    found: dict[str, Holding] = {}
    ids = list(node_ids)
    for start in range(0, len(ids), 500):  # bounded IN lists, for every database's limit
        for node in session.exec(select(Node).where(col(Node.id).in_(ids[start : start + 500]))).all():
            serving = node.allocation_id if node.state not in LEAVING_STATES else None
            found[node.id] = Holding(tenant_id=node.tenant_id, allocation_id=serving, agent_url=node.agent_url)
    return found


def complete_drains(session: Session, node_id: str) -> None:
    """The node's running drain operations are done (it reached where a drain ends)."""
    for op in session.exec(
        select(Operation).where(
            col(Operation.resource_id) == node_id,
            col(Operation.kind) == "node_drain",
            col(Operation.status) == OperationStatus.RUNNING,
        )
    ).all():
        op.status, op.updated_at = OperationStatus.SUCCEEDED, utcnow()
        session.add(op)
