"""Operator actions on nodes (recorded as events), agent heartbeats, and fleet views."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, func, select

from gpucloud.models.node_states import NodeEvent, NodeState
from gpucloud.models.tables import Node, NodeTransition, Operation, OperationStatus, utcnow
from gpucloud.services.nodes import StaleNode, transition

FLAG_ACTIONS = {
    "cordon": {"cordoned": True},
    "uncordon": {"cordoned": False},
    "maintenance_on": {"maintenance": True},
    "maintenance_off": {"maintenance": False},
    "drain": {"drain_requested": True, "cordoned": True},
}


def apply_operator_action(session: Session, node: Node, action: str, *, actor: str, cause: str) -> Operation:
    """Record an operator's intent on a node. Flags take effect at once; a drain is carried out by
    the reconciler, and its operation completes when the node is quarantined."""
    now = utcnow()
    session.execute(
        sa.update(Node)
        .where(col(Node.id) == node.id)
        .values(**FLAG_ACTIONS[action], updated_at=now, next_reconcile_at=None)
    )
    session.add(NodeTransition.noted(node, action, cause=cause, actor=actor, at=now))
    done = action != "drain" or node.state == NodeState.QUARANTINED
    op = Operation(
        kind=f"node_{action}",
        resource_id=node.id,
        status=OperationStatus.SUCCEEDED if done else OperationStatus.RUNNING,
        actor=actor,
    )
    session.add(op)
    return op


# The ways out of RMA (and of the other states a node leaves the fleet from), as operator
# actions: the event each applies and the states it applies in.
LIFECYCLE_ACTIONS: dict[str, tuple[NodeEvent, tuple[NodeState, ...]]] = {
    # The vendor replaced the faulty part: the node is enrolled again, so the reconciler runs it
    # through inspection, wipe and burn-in before it rejoins the pool.
    "hardware_replaced": (NodeEvent.HARDWARE_REPLACED, (NodeState.RMA,)),
    # Out of the fleet for good (it keeps its record and events).
    "retire": (NodeEvent.RETIRE, (NodeState.RMA, NodeState.QUARANTINED, NodeState.ENROLLED)),
}


class NodeStateConflict(Exception):
    """The node is not in a state the action applies to."""


def apply_lifecycle_action(session: Session, node: Node, action: str, *, actor: str, cause: str) -> Operation:
    """An operator moves a node out of RMA (or out of the fleet): a compare-and-swap transition
    recorded in the node's events, and a finished operation."""
    event, allowed = LIFECYCLE_ACTIONS[action]
    if node.state not in allowed:
        raise NodeStateConflict(
            f"node {node.id} is {node.state}; {action.replace('_', '-')} applies to a node that is "
            + " or ".join(s.value for s in allowed)
        )
    try:
        transition(session, node.id, event, from_state=node.state, cause=cause or action, actor=actor)
    except StaleNode as exc:
        raise NodeStateConflict(f"{exc}; read the node again and retry") from None
    op = Operation(kind=f"node_{action}", resource_id=node.id, status=OperationStatus.SUCCEEDED, actor=actor)
    session.add(op)
    return op


# Built once: on SQLite, building this select costs twice what running it does (~150 us
# against ~65 us), and a fleet sends it 1,000 times a second per 10,000 nodes.
_JUDGED = sa.select(
    *map(col, (Node.id, Node.state, Node.tenant_id, Node.last_heartbeat_at, Node.drifted, Node.observed))
).where(col(Node.id).in_(sa.bindparam("ids", expanding=True)))


def judge_heartbeats(
    session: Session | sa.Connection, beats: Iterable[dict], *, refresh_after: timedelta = timedelta(seconds=30)
) -> tuple[list[str], dict[str, dict]]:
    """What agents' reports say, read only: the nodes whose report disagrees with the record (an
    active node whose agent lost the tenant's workload: rebooted or wiped), and the writes the
    reports call for (node id -> new values).

    A report that changes nothing calls for no write until the stored one is `refresh_after` old
    (a fraction of the heartbeat timeout): a steady fleet costs the database a read, not a write,
    per heartbeat."""
    by_node = {b["node_id"]: b for b in beats}
    now = utcnow()
    nodes = session.execute(_JUDGED, {"ids": list(by_node)}).all()
    drifted: list[str] = []
    writes: dict[str, dict] = {}
    for node_id, state, tenant_id, last_seen, was_drifted, was_observed in nodes:
        beat = by_node[node_id]
        is_drift = state == NodeState.ACTIVE and (
            beat.get("tenant_id") != tenant_id or not beat.get("workload_running", True)
        )
        if is_drift:
            drifted.append(node_id)
        observed = {k: beat.get(k) for k in ("tenant_id", "workload_running", "boot_id", "workload")}
        fresh = last_seen is not None and now - last_seen < refresh_after
        if fresh and is_drift == was_drifted and observed == was_observed:
            continue
        writes[node_id] = {"last_heartbeat_at": now, "drifted": is_drift, "observed": observed}
    return drifted, writes


def record_heartbeats(
    session: Session, beats: Iterable[dict], *, refresh_after: timedelta = timedelta(seconds=30)
) -> list[str]:
    """Store what agents report (`judge_heartbeats`, then its writes); returns the drifted nodes."""
    drifted, writes = judge_heartbeats(session, beats, refresh_after=refresh_after)
    for node_id, values in writes.items():
        session.execute(sa.update(Node).where(col(Node.id) == node_id).values(**values))
    return drifted


def summary(session: Session) -> dict:
    def counts(column) -> dict[str, int]:
        return {str(k): v for k, v in session.exec(select(column, func.count()).group_by(column)).all()}

    total = session.exec(select(func.count()).select_from(Node)).one()
    return {
        "total": total,
        "by_state": counts(col(Node.state)),
        "by_health": counts(col(Node.health)),
        "by_gpu_type": counts(col(Node.gpu_type)),
        "by_region": counts(col(Node.region)),
        "cordoned": session.exec(select(func.count()).select_from(Node).where(col(Node.cordoned) == True)).one(),
        "agent_unreachable": session.exec(
            select(func.count()).select_from(Node).where(col(Node.agent_reachable) == False)
        ).one(),
    }
