"""The one writer of a node's health and conditions (`Node.health`, `Node.health_conditions`).

Three paths change them, each owning its own conditions by name: the health service's judgement
(every condition but the reconciler's), the reconciler's reachability (`AGENT_UNREACHABLE`),
and a passed burn-in, which clears them all (the gate that verifies a repair). Each path asks
here for the values to write, so no path drops another's conditions or computes the node's
health from a different rule.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col

from gpucloud.health.verdict import HealthVerdict
from gpucloud.models.tables import Node
from gpucloud.reconciler.plan import AGENT_UNREACHABLE

# Conditions the reconciler owns on the node: a re-judgement of XIDs and readings keeps them.
RECONCILER_CONDITIONS = frozenset({AGENT_UNREACHABLE})


def judged(node: Node, verdict: HealthVerdict) -> dict[str, object]:
    """The judgement's conditions, with the reconciler's kept."""
    kept = [c for c in node.health_conditions if c.get("name") in RECONCILER_CONDITIONS]
    conditions = kept + [c.model_dump(mode="json") for c in verdict.conditions]
    health = verdict.health.value if verdict.health != "ok" or not kept else node.health
    return {"health": health, "health_conditions": conditions}


def reachability(node: Node, *, reachable: bool, reason: str, now: datetime) -> dict[str, object]:
    """The agent's reachability as the reconciler found it, with the judgement's conditions kept."""
    conditions = [c for c in node.health_conditions if c.get("name") != AGENT_UNREACHABLE]
    if not reachable:
        conditions.append({"name": AGENT_UNREACHABLE, "reason": reason, "since": now.isoformat()})
    health = (
        "suspect"
        if any(c.get("name") == AGENT_UNREACHABLE for c in conditions)
        else (node.health if conditions else "ok")
    )
    return {"agent_reachable": reachable, "health": health, "health_conditions": conditions}


def cleared() -> dict[str, object]:
    """What a passed burn-in leaves: nothing held against the node (the XIDs stay on record for
    the lemon rule)."""
    return {"health": "ok", "health_conditions": []}


def write(session: Session, node_id: str, values: dict[str, object], *, now: datetime) -> None:
    session.execute(sa.update(Node).where(col(Node.id) == node_id).values(**values, updated_at=now))
