"""Fleet-kind incidents (`docs/health.md`, "Incidents"): the incident record of a correlated burst
(`services.fleet_incidents`) and of a circuit-breaker trip (`services.health`), kept by the same
incident workflow as a node's pull (`workflows/incident.py`), whose activities call
`services.incidents`, which hands a fleet-kind incident's look and its operator's resolve here.

- A **correlated burst** has one incident (workflow id from its fleet incident's id,
  `for_burst`), made in the transaction that opens the fleet incident and grown as nodes join:
  its nodes, the tenants whose allocations held them (`IncidentTenant`), the component
  suspected, the category its signals name. Whether the component is fixed is the fleet
  incident's to say (`FleetIncidentRecord.status`, resolved by an operator): the incident reads
  it, and then waits for each node to be back to normal judgement.
- A **breaker trip** has one incident per pool and trip (`for_trip`: the open one of the pool,
  or a new one whose workflow id names the pool and the window's oldest pull, so concurrent
  refusals agree), which gathers every node refused while it is open and ends when the window
  lets pulls through again (`breaker_window`) or an operator resolves it (`resolve_trip`).

Neither is opened through the workflow engine in the judgement's transaction: the row is
written there, and the caller starts its workflow afterwards (`IncidentStart`,
`services.pulls.open_fleet_incidents`); an engine that refuses never fails the judgement, and the
reconciler's sweep (`to_start`) starts what is not being followed (and makes the incident of an
open fleet incident that lacks one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from gpucloud.health import incidents as rules
from gpucloud.health.breaker import BreakerState, CircuitBreaker, OperatorAlert, Pull
from gpucloud.health.categories import FaultCategory
from gpucloud.health.pulls import HELD
from gpucloud.models import workflow_ids as ids
from gpucloud.models.health_tables import FleetIncidentRecord, Incident, IncidentTenant, OperatorAlertRecord
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodeTransition, new_id
from gpucloud.services import breaker_window

FLEET = "fleet"
BURST, TRIP = "correlated_burst", "breaker_trip"
OPEN = rules.IncidentStatus.OPEN.value
# Who ended a trip when its window let pulls through again (`repaired_by`).
WINDOW_REOPENED = "breaker window"
# What a fleet incident's joining node and its resolution write into the node's history
# (`services.fleet_incidents`: ALERT_KIND, RESOLVED_EVENT), and who the health loop is there.
JOINED_EVENT, RESOLVED_EVENT, HEALTH_ACTOR = "fleet_incident", "fleet_incident_resolved", "health"
MAX_STEPS = 500
MAX_SUMMARY_NODES = 20
_LABEL = {"leaf_switch": "leaf switch", "rack": "rack", "pdu": "PDU"}
_PULLED_BY_HEALTH = frozenset({"cordon", "drain"})
_OUT = frozenset(
    {NodeState.DRAINING.value, NodeState.QUARANTINED.value, NodeState.REPAIRING.value, NodeState.RMA.value}
)
_GONE = frozenset({NodeState.RMA.value, NodeState.RETIRED.value})


@dataclass(frozen=True)
class IncidentStart:
    """A fleet-kind incident whose workflow the caller starts (or joins) after the commit."""

    incident_id: str
    workflow_id: str
    node_id: str  # its first node, for the workflow's search attribute
    detected_at: datetime


def start_of(incident: Incident) -> IncidentStart:
    return IncidentStart(
        incident_id=incident.id,
        workflow_id=incident.workflow_id,
        node_id=(incident.node_ids or [incident.pool or incident.fleet_incident_id or incident.id])[0],
        detected_at=incident.detected_at,
    )


def _find(session: Session, workflow_id: str) -> Incident | None:
    return session.exec(select(Incident).where(col(Incident.workflow_id) == workflow_id)).first()


def _insert(session: Session, incident: Incident) -> Incident:
    """The new row, or the one a concurrent opener of the same workflow id wrote first."""
    try:
        with session.begin_nested():
            session.add(incident)
    except IntegrityError:
        return session.exec(select(Incident).where(col(Incident.workflow_id) == incident.workflow_id)).one()
    return incident


def _link(session: Session, incident: Incident, nodes: Iterable[Node]) -> None:
    """The allocations holding `nodes` (those an allocation holds) recorded as touched."""
    held = [n for n in nodes if n.allocation_id is not None and n.tenant_id is not None and n.state in HELD]
    if not held:
        return
    known = {
        (a, n)
        for a, n in session.exec(
            select(IncidentTenant.allocation_id, IncidentTenant.node_id).where(
                col(IncidentTenant.incident_id) == incident.id
            )
        ).all()
    }
    tenants, allocations = set(incident.tenant_ids), set(incident.allocation_ids)
    for node in held:
        assert node.allocation_id is not None and node.tenant_id is not None
        if (node.allocation_id, node.id) in known:
            continue
        session.add(
            IncidentTenant(
                incident_id=incident.id, allocation_id=node.allocation_id, node_id=node.id, tenant_id=node.tenant_id
            )
        )
        known.add((node.allocation_id, node.id))
        tenants.add(node.tenant_id)
        allocations.add(node.allocation_id)
    incident.tenant_ids, incident.allocation_ids = sorted(tenants), sorted(allocations)


def _names(node_ids: Sequence[str]) -> str:
    shown = ", ".join(node_ids[:MAX_SUMMARY_NODES])
    return shown + (f" and {len(node_ids) - MAX_SUMMARY_NODES} more" if len(node_ids) > MAX_SUMMARY_NODES else "")


# ----------------------------------------------------------------- correlated bursts


def component_of(record: FleetIncidentRecord) -> str:
    return f"{_LABEL.get(record.component_kind, record.component_kind)} {record.component_id}"


def for_burst(session: Session, record: FleetIncidentRecord, *, now: datetime) -> Incident:
    """The burst's incident, found or made, with the nodes and tenants the fleet incident has now."""
    workflow_id = ids.fleet_incident_workflow_id(record.id)
    incident = _find(session, workflow_id)
    if incident is None:
        incident = _insert(
            session,
            Incident(
                id=new_id("inc"),
                workflow_id=workflow_id,
                kind=FLEET,
                trigger=BURST,
                fleet_incident_id=record.id,
                suspected_component=component_of(record),
                category=rules.burst_category(record.component_kind, record.signals).value,
                detected_at=record.first_at,
                created_at=now,
                updated_at=now,
            ),
        )
    if incident.status == OPEN:
        _refresh_burst(session, incident, record)
    return incident


def _refresh_burst(session: Session, incident: Incident, record: FleetIncidentRecord) -> list[Node]:
    nodes = list(session.exec(select(Node).where(col(Node.id).in_(record.node_ids)).order_by(col(Node.id))).all())
    _link(session, incident, nodes)
    incident.node_ids = sorted(record.node_ids)
    incident.gpu_count = sum(n.gpu_count for n in nodes)
    incident.detected_at = min(incident.detected_at, record.first_at)
    incident.category = rules.burst_category(record.component_kind, record.signals).value
    incident.summary = (
        f"{component_of(record)} suspected: {len(record.node_ids)} of its {record.component_size} nodes "
        f"faulted ({', '.join(record.signals)}); they were cordoned and kept by their tenants"
    )[:1000]
    incident.signals = [
        {"name": s, "since": record.first_at.isoformat(), "reason": record.reason[:500]} for s in record.signals
    ]
    session.add(incident)
    return nodes


def _transitions(session: Session, node_ids: Sequence[str], *, since: datetime, **where) -> list[NodeTransition]:
    query = select(NodeTransition).where(col(NodeTransition.node_id).in_(node_ids), col(NodeTransition.at) >= since)
    for name, value in where.items():
        query = query.where(getattr(NodeTransition, name) == value)
    return list(session.exec(query.order_by(col(NodeTransition.seq)).limit(MAX_STEPS)).all())


def _back_at(node: Node | None, record: FleetIncidentRecord, after: Sequence[NodeTransition]) -> datetime | None:
    """When a node of a resolved burst was back to normal judgement: pulled on its own (the
    health loop's cordon or drain, or out of the pool), gone, in another incident, or healthy
    and uncordoned; None while it is none of these."""
    assert record.resolved_at is not None
    resolved_at = record.resolved_at
    if node is None:
        return resolved_at  # gone from the table
    for step in after:
        pulled = step.event in _PULLED_BY_HEALTH and step.actor == HEALTH_ACTOR
        if pulled or (step.to_state in _OUT | _GONE and step.from_state != step.to_state):
            return step.at
    if node.state in _GONE:
        return resolved_at
    if node.fleet_incident_id is not None and node.fleet_incident_id != record.id:
        return resolved_at  # another burst's incident holds it now
    if not node.cordoned and node.health != "failed":
        uncordons = [s.at for s in after if s.event == "uncordon"]
        return max([resolved_at, *uncordons])
    return None


def _observe_burst(session: Session, incident: Incident, *, now: datetime) -> rules.Phases:
    record = session.get(FleetIncidentRecord, incident.fleet_incident_id)
    if record is None:
        return rules.Phases()
    nodes = {n.id: n for n in _refresh_burst(session, incident, record)} if record.status == OPEN else {}
    if not nodes:
        nodes = {n.id: n for n in session.exec(select(Node).where(col(Node.id).in_(incident.node_ids))).all()}
    since = incident.detected_at - rules.CLOCK_SKEW
    joined: dict[str, datetime] = {}
    for step in _transitions(session, incident.node_ids, since=since, event=JOINED_EVENT):
        if step.cause.startswith(f"fleet incident {record.id}:"):
            joined.setdefault(step.node_id, step.at)
    after: dict[str, list[NodeTransition]] = {}
    if record.resolved_at is not None:
        for step in _transitions(session, incident.node_ids, since=record.resolved_at):
            after.setdefault(step.node_id, []).append(step)
    found = rules.fleet_phases(
        opened_at=record.opened_at,
        resolved_at=record.resolved_at,
        resolved_by=(record.resolution or f"resolved by {record.resolved_by}") if record.resolved_at else None,
        nodes=[
            rules.BurstNode(
                node_id=node_id,
                joined_at=joined.get(node_id),
                back_at=_back_at(nodes.get(node_id), record, after.get(node_id, []))
                if record.resolved_at is not None
                else None,
            )
            for node_id in incident.node_ids
        ],
    )
    if record.resolved_by is not None:
        incident.detail = {**incident.detail, "resolved_by": record.resolved_by}
    end = found.ended_at
    incident.actions = [
        {**_action(s), "node": s.node_id}
        for s in _transitions(session, incident.node_ids, since=incident.detected_at)
        if end is None or s.at <= end
    ]
    incident.gpu_hours_lost = rules.fleet_gpu_hours_lost(
        gpu_count=incident.gpu_count, detected_at=incident.detected_at, until=found.repaired_at, now=now
    )
    return found


def _action(step: NodeTransition) -> dict:
    return rules.Step(
        at=step.at,
        event=step.event,
        from_state=step.from_state,
        to_state=step.to_state,
        cause=step.cause,
        actor=step.actor,
    ).as_action()


# ----------------------------------------------------------------- breaker trips


def for_trip(
    session: Session,
    node: Node,
    alert: OperatorAlert,
    *,
    tenant: str | None,
    window_start: datetime,
    now: datetime,
) -> Incident:
    """The open incident of the pool's trip, joined by the refused node, or a new one."""
    incident = session.exec(
        select(Incident)
        .where(col(Incident.trigger) == TRIP, col(Incident.pool) == alert.pool, col(Incident.status) == OPEN)
        .order_by(col(Incident.seq))
    ).first()
    if incident is None:
        incident = _insert(
            session,
            Incident(
                id=new_id("inc"),
                workflow_id=ids.breaker_incident_workflow_id(alert.pool, window_start),
                kind=FLEET,
                trigger=TRIP,
                pool=alert.pool,
                suspected_component=f"pool {alert.pool}",
                category=FaultCategory.OTHER.value,
                detected_at=now,
                detail={
                    "gpu_type": node.gpu_type,
                    "region": node.region,
                    "tenant": tenant,
                    "window_s": alert.window.total_seconds(),
                    "max_pulled_share": alert.max_pulled_share,
                },
                created_at=now,
                updated_at=now,
            ),
        )
    if incident.status != OPEN:
        return incident
    refused = list(incident.node_ids)
    if node.id not in refused:
        refused.append(node.id)
        incident.gpu_count += node.gpu_count
    incident.node_ids = refused
    _link(session, incident, [node])
    share = alert.pulled_in_window / alert.pool_size if alert.pool_size else 0.0
    incident.detail = {
        **incident.detail,
        "pulled_in_window": alert.pulled_in_window,
        "pool_size": alert.pool_size,
    }
    incident.summary = (
        f"circuit breaker tripped in pool {alert.pool}: {alert.pulled_in_window} of {alert.pool_size} nodes "
        f"({share:.0%}, over the {alert.max_pulled_share:.0%} allowed) pulled in the last {alert.window}; "
        f"automatic pulls refused for {_names(refused)}"
    )[:1000]
    if not any(s.get("node") == node.id for s in incident.signals):
        incident.signals = [
            *incident.signals,
            {
                "name": "circuit_breaker",
                "node": node.id,
                "since": now.isoformat(),
                "action": "pull refused",
                "reason": alert.reason[:500],
            },
        ]
    incident.updated_at = now
    session.add(incident)
    return incident


def _when(value: object) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _window_lets_pulls_through(session: Session, incident: Incident, *, now: datetime) -> bool:
    detail, pool = incident.detail, incident.pool or ""
    window = timedelta(seconds=float(detail.get("window_s", 3600.0)))
    rows = breaker_window.recent_pulls(session, pool, now=now, window=window)
    size = breaker_window.pool_size(
        session,
        gpu_type=str(detail.get("gpu_type", "")),
        region=str(detail.get("region", "")),
        tenant=detail.get("tenant"),
    )
    breaker = CircuitBreaker(
        max_pulled_share=float(detail.get("max_pulled_share", 0.05)),
        window=window,
        state=BreakerState(pulls={pool: [Pull(node_id=r.node_id, at=r.at) for r in rows]}),
    )
    # A node that is in no window: would the breaker take one more pull now?
    return breaker.request_quarantine(pool=pool, node_id="\x00probe", pool_size=size, now=now).allowed


def _observe_trip(session: Session, incident: Incident, *, now: datetime) -> rules.Phases:
    detail = incident.detail
    closed_at, closed_by = _when(detail.get("resolved_at")), detail.get("resolution") or None
    if closed_at is not None and closed_by is None:
        closed_by = f"resolved by {detail.get('resolved_by')}"
    if closed_at is None:
        closed_at = _when(detail.get("window_reopened_at"))
        closed_by = WINDOW_REOPENED if closed_at is not None else None
    if closed_at is None and _window_lets_pulls_through(session, incident, now=now):
        closed_at, closed_by = now, WINDOW_REOPENED
        incident.detail = {**detail, "window_reopened_at": now.isoformat()}
    found = rules.breaker_phases(detected_at=incident.detected_at, closed_at=closed_at, closed_by=closed_by)
    alerts = session.exec(
        select(OperatorAlertRecord)
        .where(
            col(OperatorAlertRecord.kind) == "circuit_breaker",
            col(OperatorAlertRecord.pool) == incident.pool,
            col(OperatorAlertRecord.at) >= incident.detected_at,
            col(OperatorAlertRecord.at) <= (closed_at or now),
        )
        .order_by(col(OperatorAlertRecord.seq))
        .limit(MAX_STEPS)
    ).all()
    incident.actions = [
        {
            "at": a.at.isoformat(),
            "event": "pull_refused",
            "from": "",
            "to": "",
            "cause": a.reason,
            "actor": "circuit breaker",
            "node": a.node_id,
        }
        for a in alerts
    ]
    incident.gpu_hours_lost = rules.fleet_gpu_hours_lost(
        gpu_count=incident.gpu_count, detected_at=incident.detected_at, until=found.repaired_at, now=now
    )
    return found


class NotResolvable(ValueError):
    """The incident ends with its node (burn-in or RMA): nobody resolves it."""


def resolve_trip(session: Session, incident: Incident, *, actor: str, note: str, now: datetime) -> Incident:
    """An operator ends a breaker trip's incident (the breaker's window is left as it is)."""
    if incident.trigger != TRIP:
        raise NotResolvable(incident.id)
    if incident.status == OPEN and "resolved_at" not in incident.detail:
        incident.detail = {
            **incident.detail,
            "resolved_at": now.isoformat(),
            "resolved_by": actor,
            "resolution": note[:1000],
        }
        incident.updated_at = now
        session.add(incident)
    return incident


# ----------------------------------------------------------------- both


def observe(session: Session, incident: Incident, *, now: datetime) -> rules.Phases:
    """Read the fleet-kind incident's history again and write what it shows."""
    found = (
        _observe_trip(session, incident, now=now)
        if incident.trigger == TRIP
        else _observe_burst(session, incident, now=now)
    )
    incident.pulled_at = found.pulled_at
    incident.stabilized_at = found.stabilized_at
    incident.diagnosed_at = found.diagnosed_at
    incident.repaired_at = found.repaired_at
    incident.repaired_by = found.repaired_by[:1000] if found.repaired_by else None
    incident.gated_at = found.gated_at
    incident.phase = found.phase.value
    incident.updated_at = now
    session.add(incident)
    return found


def to_start(session: Session, *, now: datetime, stale_after: timedelta) -> list[IncidentStart]:
    """What the reconciler's sweep starts: the incident of every open fleet incident lacking one
    (made now), and every open fleet-kind incident nobody has looked at for `stale_after` (its
    workflow never started, or was lost)."""
    lacking = session.exec(
        select(FleetIncidentRecord).where(
            col(FleetIncidentRecord.status) == "open",
            ~sa.exists().where(col(Incident.fleet_incident_id) == col(FleetIncidentRecord.id)),
        )
    ).all()
    made = [for_burst(session, record, now=now) for record in lacking]
    stale = session.exec(
        select(Incident).where(
            col(Incident.kind) == FLEET, col(Incident.status) == OPEN, col(Incident.updated_at) < now - stale_after
        )
    ).all()
    seen: set[str] = set()
    starts = []
    for incident in [*made, *stale]:
        if incident.id not in seen and incident.status == OPEN:
            seen.add(incident.id)
            starts.append(start_of(incident))
    return starts
