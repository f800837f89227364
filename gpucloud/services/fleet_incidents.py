"""Fleet incidents: faults on several nodes behind one leaf switch, rack or PDU within the
correlation window are one incident that suspects the shared component, not that many broken
nodes (`health.correlation`).

Where nodes sit comes from the node records (`rack`, `leaf_switch`, `pdu`, set at enrollment
from the operator's inventory; the simulated fleet reports its own): `topology_of`.

The health service asks `hold_if_correlated` before it asks the circuit breaker for a pull: the
fleet's recent faults (the XIDs and signals that pull a node on one occurrence, over the
correlation window, fleet-wide: a switch or PDU spans pools) are correlated, and when the node's
every recent fault lies in a burst behind one component, it is not pulled. Instead the burst's
nodes join one open incident for that component (`Node.fleet_incident_id`): cordoned (no new
tenant) but neither drained, replaced, repaired nor power-cycled, and one operator alert (kind
`fleet_incident`) names the component and its nodes. Nodes the health loop had asked to drain
before the burst was recognizable (fewer than `min_nodes` faults so far) have that drain
withdrawn if it has not begun, and their breaker budget refunded; one already draining finishes
into quarantine and waits there (the reconciler repairs no node inside an open incident). A node
with faults outside any burst is judged alone, as before.

`resolve` (the operator's, `POST /v1/fleet-incidents/{id}:resolve`) closes the incident: its nodes
leave it, those it cordoned are uncordoned, and a `fleet_incident_resolved` note in each node's
history marks what came before as dealt with (`health.cleared_at`), as a passed burn-in does; the
caller judges them again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, or_, select

from gpucloud.health.correlation import (
    Correlation,
    CorrelationPolicy,
    FaultObservation,
    FleetIncident,
    NodePlacement,
    Topology,
    correlate,
)
from gpucloud.health.pulls import pulls
from gpucloud.health.signals import SIGNAL_TABLE
from gpucloud.health.xid import XID_TABLE, XidClass
from gpucloud.models.health_tables import (
    FleetIncidentRecord,
    OperatorAlertRecord,
    QuarantinePull,
    SignalObservationRecord,
    XidEventRecord,
)
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodeTransition

OPEN, RESOLVED = "open", "resolved"
ALERT_KIND = "fleet_incident"
# The note in a node's history that clears what came before it (`health.cleared_at`).
RESOLVED_EVENT = "fleet_incident_resolved"
ACTOR = "health"
# Faults that pull a node on one occurrence: what a failed shared component shows on each node.
_PULLING_XIDS = sorted(x for x, p in XID_TABLE.items() if p.xid_class != XidClass.APPLICATION and pulls(p.action))
_PULLING_SIGNALS = sorted(
    s.value for s, p in SIGNAL_TABLE.items() if not p.application and p.threshold is None and pulls(p.action)
)
# Where a health drain may still be withdrawn: not begun (the drain moves the node on first).
_UNBEGUN = (NodeState.AVAILABLE.value, NodeState.ACTIVE.value)


class IncidentNotFound(LookupError):
    pass


def topology_of(session: Session, node_ids: Iterable[str]) -> Topology:
    """The placements of `node_ids` and of every node that shares a rack, leaf switch or PDU with
    one of them (retired nodes aside), so each component's size is the whole of it."""
    ids = sorted(set(node_ids))
    if not ids:
        return Topology([])
    seeds = session.exec(select(Node.rack, Node.leaf_switch, Node.pdu).where(col(Node.id).in_(ids))).all()
    racks = {r for r, _, _ in seeds}
    leaves = {leaf for _, leaf, _ in seeds if leaf is not None}
    pdus = {p for _, _, p in seeds if p is not None}
    rows = session.exec(
        select(Node.id, Node.rack, Node.leaf_switch, Node.pdu).where(
            col(Node.state) != NodeState.RETIRED.value,
            or_(
                col(Node.id).in_(ids),
                col(Node.rack).in_(racks),
                col(Node.leaf_switch).in_(leaves),
                col(Node.pdu).in_(pdus),
            ),
        )
    ).all()
    return Topology(
        NodePlacement(node_id=node_id, rack=rack, leaf_switch=leaf, pdu=pdu) for node_id, rack, leaf, pdu in rows
    )


def recent_faults(session: Session, *, now: datetime, policy: CorrelationPolicy) -> list[FaultObservation]:
    """The fleet's faults of the last correlation window: XIDs and signals that pull on one
    occurrence, each named as its condition is (`xid_79`, `ib_link_down`)."""
    since = now - policy.window
    xids = session.exec(
        select(XidEventRecord.node_id, XidEventRecord.timestamp, XidEventRecord.xid).where(
            col(XidEventRecord.timestamp) >= since,
            col(XidEventRecord.timestamp) <= now,
            col(XidEventRecord.xid).in_(_PULLING_XIDS),
        )
    ).all()
    signals = session.exec(
        select(SignalObservationRecord.node_id, SignalObservationRecord.at, SignalObservationRecord.signal).where(
            col(SignalObservationRecord.at) >= since,
            col(SignalObservationRecord.at) <= now,
            col(SignalObservationRecord.signal).in_(_PULLING_SIGNALS),
        )
    ).all()
    faults = [FaultObservation(node_id=n, at=at, signal=f"xid_{xid}") for n, at, xid in xids] + [
        FaultObservation(node_id=n, at=at, signal=signal) for n, at, signal in signals
    ]
    # What a resolved incident dealt with makes no new burst (nor does it with a later fault).
    resolved = dict(
        session.exec(
            select(NodeTransition.node_id, sa.func.max(NodeTransition.at))
            .where(
                col(NodeTransition.node_id).in_(sorted({f.node_id for f in faults})),
                col(NodeTransition.event) == RESOLVED_EVENT,
                col(NodeTransition.at) >= since,
            )
            .group_by(col(NodeTransition.node_id))
        ).all()
    )
    return [f for f in faults if f.node_id not in resolved or f.at > resolved[f.node_id]]


def correlation_now(session: Session, *, now: datetime, policy: CorrelationPolicy) -> Correlation:
    faults = recent_faults(session, now=now, policy=policy)
    return correlate(faults, topology_of(session, {f.node_id for f in faults}), policy=policy)


def hold_if_correlated(
    session: Session, node: Node, *, now: datetime, policy: CorrelationPolicy
) -> FleetIncidentRecord | None:
    """The open incident that holds the node's pull (joined now if a burst behind one of its
    components explains its every recent fault), or None: judge it alone."""
    if node.fleet_incident_id is not None:
        held = session.get(FleetIncidentRecord, node.fleet_incident_id)
        if held is not None and held.status == OPEN:
            return held
    correlation = correlation_now(session, now=now, policy=policy)
    if not correlation.pull_suppressed(node.id):
        return None
    incident = next(i for i in correlation.incidents if node.id in i.nodes)
    record = _open(session, incident, now=now)
    _join(session, record, incident, now=now, policy=policy)
    return record


def _open(session: Session, incident: FleetIncident, *, now: datetime) -> FleetIncidentRecord:
    """The component's open incident, grown by this burst, or a new one with its one alert."""
    record = session.exec(
        select(FleetIncidentRecord).where(
            col(FleetIncidentRecord.component_kind) == incident.component.kind.value,
            col(FleetIncidentRecord.component_id) == incident.component.id,
            col(FleetIncidentRecord.status) == OPEN,
        )
    ).first()
    if record is not None:
        record.node_ids = sorted(set(record.node_ids) | set(incident.nodes))
        record.signals = sorted(set(record.signals) | set(incident.signals))
        record.first_at = min(record.first_at, incident.first)
        record.last_at = max(record.last_at, incident.last)
        session.add(record)
        return record
    record = FleetIncidentRecord(
        id=f"fi-{uuid.uuid4().hex[:12]}",
        component_kind=incident.component.kind.value,
        component_id=incident.component.id,
        component_size=incident.component_size,
        node_ids=list(incident.nodes),
        signals=list(incident.signals),
        first_at=incident.first,
        last_at=incident.last,
        reason=incident.reason,
        opened_at=now,
    )
    session.add(record)
    session.add(
        OperatorAlertRecord(
            kind=ALERT_KIND,
            reason=(
                f"fleet incident {record.id}: look at {incident.component}; {incident.reason}. "
                f"Nodes: {', '.join(incident.nodes)}. Resolve it once the component is fixed."
            )[:2000],
            at=now,
        )
    )
    return record


def _join(
    session: Session, record: FleetIncidentRecord, incident: FleetIncident, *, now: datetime, policy: CorrelationPolicy
) -> None:
    """Every node of the burst into the incident: cordoned, a health drain not begun withdrawn,
    the breaker budget its pull spent in the burst refunded."""
    cordoned = set(record.cordoned)
    nodes = session.exec(select(Node).where(col(Node.id).in_(incident.nodes)).order_by(col(Node.id))).all()
    for node in nodes:
        if node.fleet_incident_id is not None and node.fleet_incident_id != record.id:
            continue  # another open incident holds it already
        values: dict = {"fleet_incident_id": record.id}
        if not node.cordoned:
            values["cordoned"] = True
            cordoned.add(node.id)
        elif node.id not in cordoned and _by_health(session, node.id, "cordon", since=incident.first):
            cordoned.add(node.id)  # the health loop's cordon for a fault the burst explains
        cause = f"fleet incident {record.id}: suspect {incident.component}"
        if (
            node.drain_requested
            and node.state in _UNBEGUN
            and _by_health(session, node.id, "drain", since=incident.first)
        ):
            values["drain_requested"] = False
            session.add(NodeTransition.noted(node, "drain_withdrawn", cause=cause, actor=ACTOR, at=now))
        if node.fleet_incident_id is None:
            session.add(NodeTransition.noted(node, ALERT_KIND, cause=cause, actor=ACTOR, at=now))
        session.execute(sa.update(Node).where(col(Node.id) == node.id).values(**values))
    record.cordoned = sorted(cordoned)
    session.add(record)
    # The pulls the burst's nodes were allowed before it was recognizable spend no budget.
    session.execute(
        sa.delete(QuarantinePull).where(
            col(QuarantinePull.node_id).in_(incident.nodes), col(QuarantinePull.at) >= incident.first - policy.window
        )
    )


def _by_health(session: Session, node_id: str, event: str, *, since: datetime) -> bool:
    """Whether the node's last `event` (a cordon, a drain request) is the health loop's, since `since`."""
    last = session.exec(
        select(NodeTransition.actor, NodeTransition.at)
        .where(col(NodeTransition.node_id) == node_id, col(NodeTransition.event) == event)
        .order_by(col(NodeTransition.seq).desc())
        .limit(1)
    ).first()
    return last is not None and last[0] == ACTOR and last[1] >= since


def get(session: Session, incident_id: str) -> FleetIncidentRecord:
    record = session.get(FleetIncidentRecord, incident_id)
    if record is None:
        raise IncidentNotFound(incident_id)
    return record


def resolve(session: Session, incident_id: str, *, actor: str, now: datetime, note: str = "") -> FleetIncidentRecord:
    """Close the incident: its nodes leave it (uncordoned if it cordoned them and nothing else
    took them out since), and what they showed before now is dealt with. Resolving a resolved
    incident changes nothing. The caller judges the nodes again (`health.judge_again`)."""
    record = get(session, incident_id)
    if record.status != OPEN:
        return record
    for node in session.exec(select(Node).where(col(Node.fleet_incident_id) == incident_id)).all():
        values: dict = {"fleet_incident_id": None}
        if node.id in record.cordoned and node.state in _UNBEGUN and not node.drain_requested:
            values["cordoned"] = False
            session.add(
                NodeTransition.noted(
                    node, "uncordon", cause=f"fleet incident {incident_id} resolved", actor=actor, at=now
                )
            )
        session.add(
            NodeTransition.noted(
                node, RESOLVED_EVENT, cause=note or f"fleet incident {incident_id}", actor=actor, at=now
            )
        )
        session.execute(sa.update(Node).where(col(Node.id) == node.id).values(**values))
    record.status, record.resolved_at, record.resolved_by, record.resolution = RESOLVED, now, actor, note[:1000]
    session.add(record)
    return record
