"""The health service: XID events in, a judged node and a decision to pull it out.

`ingest_xids` stores events (stamped with the tenant and allocation the node's record shows),
re-judges each node with `health.rules.evaluate_node`, writes its health and conditions, and
decides what to do about a drain-level verdict: an active node is replaced inside its
allocation (the caller signals the allocation workflow), an idle one is drained by the
reconciler. Every automatic pull asks the pool's circuit breaker first, whose window is rebuilt
from `QuarantinePull` rows; a refusal is an operator alert and no pull.

`repair_plan` picks the next rung of the repair ladder for a node in `repairing`, or none (the
lemon rule, or the ladder is exhausted: RMA).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, func, select

from gpucloud.agent.readings import XidEvent
from gpucloud.health.breaker import BreakerState, CircuitBreaker, Pull
from gpucloud.health.rules import evaluate_node
from gpucloud.health.verdict import Action, HealthPolicy, HealthVerdict, action_rank
from gpucloud.models.health_tables import OperatorAlertRecord, QuarantinePull, XidEventRecord
from gpucloud.models.node_states import NodeEvent, NodeState
from gpucloud.models.tables import Node, NodeTransition, utcnow
from gpucloud.reconciler.plan import AGENT_STATE_DRIFT, AGENT_UNREACHABLE

REPAIR_LADDER = ("reset", "reboot", "reflash")
# Conditions other code owns on the node: a re-judgement of XIDs keeps them.
_FOREIGN_CONDITIONS = frozenset({AGENT_UNREACHABLE, AGENT_STATE_DRIFT})
_PULLABLE = frozenset({NodeState.ACTIVE, NodeState.AVAILABLE})


@dataclass(frozen=True)
class BreakerSettings:
    max_pulled_share: float = 0.05
    window: timedelta = timedelta(hours=1)


@dataclass
class HealthOutcome:
    node_id: str
    verdict: HealthVerdict
    # "replace": signal the allocation workflow; "drain": reconcile the node now; None: nothing.
    pull: str | None = None
    allocation_id: str | None = None
    immediate: bool = False  # the fault is already fatal to the job: no grace period
    reason: str = ""
    alert: str | None = None


def pool_of(node: Node) -> str:
    return f"{node.gpu_type}/{node.region}"


def cleared_at(session: Session, node_id: str) -> datetime | None:
    """When the node last passed burn-in: what came before is dealt with (lemon rule aside)."""
    return session.exec(
        select(func.max(NodeTransition.at)).where(
            NodeTransition.node_id == node_id, NodeTransition.from_state == NodeState.BURN_IN.value,
            NodeTransition.to_state == NodeState.AVAILABLE.value)
    ).one()


def judge(session: Session, node: Node, *, now: datetime, policy: HealthPolicy) -> HealthVerdict:
    rows = session.exec(select(XidEventRecord).where(
        XidEventRecord.node_id == node.id, XidEventRecord.timestamp >= now - policy.lemon_window)).all()
    events = [XidEvent(node_id=r.node_id, gpu_index=r.gpu_index, gpu_uuid=r.gpu_uuid, xid=r.xid,
                       timestamp=r.timestamp, message=r.message, tenant_id=r.tenant_id,
                       allocation_id=r.allocation_id) for r in rows]
    return evaluate_node(events=events, readings=[], now=now, cleared_at=cleared_at(session, node.id),
                         policy=policy)


def ingest_xids(session: Session, events: Iterable[XidEvent], *, source: str, now: datetime | None = None,
                policy: HealthPolicy = HealthPolicy(), breaker: BreakerSettings = BreakerSettings(),
                ) -> tuple[list[HealthOutcome], list[str]]:
    """Store and judge; returns the outcome per known node and the ids of unknown nodes."""
    now = now or utcnow()
    by_node: dict[str, list[XidEvent]] = {}
    for event in events:
        by_node.setdefault(event.node_id, []).append(event)
    nodes = {n.id: n for n in session.exec(select(Node).where(Node.id.in_(list(by_node)))).all()}
    for node_id, node_events in by_node.items():
        node = nodes.get(node_id)
        if node is None:
            continue
        session.add_all(XidEventRecord(
            node_id=node_id, gpu_index=e.gpu_index, gpu_uuid=e.gpu_uuid, xid=e.xid, timestamp=e.timestamp,
            message=e.message, source=source, tenant_id=e.tenant_id or node.tenant_id,
            allocation_id=e.allocation_id or node.allocation_id) for e in node_events)
    session.flush()
    outcomes = [_judge_and_decide(session, nodes[n], now=now, policy=policy, breaker=breaker)
                for n in by_node if n in nodes]
    return outcomes, [n for n in by_node if n not in nodes]


def _judge_and_decide(session: Session, node: Node, *, now: datetime, policy: HealthPolicy,
                      breaker: BreakerSettings) -> HealthOutcome:
    verdict = judge(session, node, now=now, policy=policy)
    kept = [c for c in node.health_conditions if c.get("name") in _FOREIGN_CONDITIONS]
    conditions = kept + [c.model_dump(mode="json") for c in verdict.conditions]
    health = verdict.health.value if verdict.health != "ok" or not kept else node.health
    session.execute(sa.update(Node).where(Node.id == node.id).values(
        health=health, health_conditions=conditions, updated_at=now))
    outcome = HealthOutcome(node_id=node.id, verdict=verdict)
    if action_rank(verdict.action) < action_rank(Action.DRAIN) or node.state not in _PULLABLE:
        return outcome
    if node.drain_requested:
        return outcome  # already on its way out
    worst = verdict.conditions[0]
    outcome.reason = f"{worst.name}: {worst.reason}"
    alert = _ask_breaker(session, node, now=now, settings=breaker)
    if alert is not None:
        outcome.alert = alert
        return outcome
    if node.state == NodeState.ACTIVE and node.allocation_id:
        outcome.pull, outcome.allocation_id = "replace", node.allocation_id
        outcome.immediate = action_rank(verdict.action) >= action_rank(Action.DRAIN_NOW)
    else:
        # Intent for the reconciler, as an operator's drain records it, but without the cordon:
        # the node's health already keeps it from reservations, and a passed burn-in returns it.
        session.execute(sa.update(Node).where(Node.id == node.id).values(drain_requested=True, next_reconcile_at=None))
        session.add(NodeTransition(node_id=node.id, from_state=node.state, to_state=node.state, event="drain",
                                   cause=outcome.reason[:500], actor="health", generation=node.generation, at=now))
        outcome.pull = "drain"
    return outcome


def _ask_breaker(session: Session, node: Node, *, now: datetime, settings: BreakerSettings) -> str | None:
    """Record an allowed pull and return None, or record and return the operator alert."""
    pool = pool_of(node)
    rows = session.exec(select(QuarantinePull).where(
        QuarantinePull.pool == pool, QuarantinePull.at > now - settings.window)).all()
    state = BreakerState(pulls={pool: [Pull(node_id=r.node_id, at=r.at) for r in rows]})
    pool_size = session.exec(select(func.count()).select_from(Node).where(
        Node.gpu_type == node.gpu_type, Node.region == node.region,
        Node.state != NodeState.RETIRED.value)).one()
    decision = CircuitBreaker(max_pulled_share=settings.max_pulled_share, window=settings.window,
                              state=state).request_quarantine(pool=pool, node_id=node.id, pool_size=pool_size,
                                                              now=now)
    if decision.allowed:
        if not any(r.node_id == node.id for r in rows):
            session.add(QuarantinePull(pool=pool, node_id=node.id, at=now))
        return None
    alert = decision.alert
    already = session.exec(select(OperatorAlertRecord.seq).where(
        OperatorAlertRecord.node_id == node.id, OperatorAlertRecord.kind == "circuit_breaker",
        OperatorAlertRecord.at > now - settings.window)).first()
    if already is None:
        session.add(OperatorAlertRecord(kind="circuit_breaker", pool=pool, node_id=node.id, reason=alert.reason,
                                        at=now))
    return alert.reason


@dataclass(frozen=True)
class RepairStep:
    rung: int | None  # index into REPAIR_LADDER to start from; None: send the node to RMA
    reason: str


def repair_plan(session: Session, node_id: str, *, now: datetime | None = None,
                policy: HealthPolicy = HealthPolicy()) -> RepairStep:
    """The rung to try for a node entering repair, counted over this quarantine episode: each
    failed burn-in after a repair sends the node back to quarantine and up one rung."""
    now = now or utcnow()
    node = session.get(Node, node_id)
    verdict = judge(session, node, now=now, policy=policy)
    if verdict.action == Action.RMA:
        worst = verdict.conditions[0]
        return RepairStep(None, f"{worst.name}: {worst.reason}")
    episode_start = session.exec(
        select(func.max(NodeTransition.seq)).where(
            NodeTransition.node_id == node_id, NodeTransition.to_state == NodeState.QUARANTINED.value,
            NodeTransition.from_state != NodeState.BURN_IN.value)
    ).one() or 0
    repairs = session.exec(select(func.count()).select_from(NodeTransition).where(
        NodeTransition.node_id == node_id, NodeTransition.seq > episode_start,
        NodeTransition.event == NodeEvent.REPAIR.value)).one()
    rung = max(repairs - 1, 0)
    if rung >= len(REPAIR_LADDER):
        return RepairStep(None, f"repair ladder exhausted ({' -> '.join(REPAIR_LADDER)} did not pass burn-in)")
    return RepairStep(rung, f"repair attempt {rung + 1}: {REPAIR_LADDER[rung]}")
