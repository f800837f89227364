"""Incidents (`docs/health.md`, "Incidents"): the record of a health pull, from the first fault to
the node's return to the pool (or RMA), kept by the incident workflow through the activities
in `activities/incidents.py`, which call this module.

`open_incident` finds or makes the row of a pull (its workflow id is the key: a re-sent pull
finds the same row), `observe` reads the node's history and the allocation's events and writes
each phase's timestamp as they show it (`health.incidents.phases`), `close` ends it and writes
the write-up (`health.incident_writeup`). A fleet-kind incident (a correlated burst, a breaker
trip) is made where its cause is recorded and looked at by `services.fleet_kind_incidents`;
`close` ends both kinds alike. The API reads them (`public`, `for_tenant`: a tenant sees only
incidents that touched its allocations, `IncidentTenant`, with every other tenant's data
removed) and an operator writes the root cause and follow-ups (`set_root_cause`) and resolves a
fleet-kind incident (`resolve`, and `resolve_fleet_incident` for the fleet incident record
itself), the one resolve the API's routes and the console call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

from anyio import to_thread
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select
from temporalio.client import Client

from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.health import incidents as rules
from gpucloud.health.incident_writeup import write_up
from gpucloud.health.pulls import HELD, pulls, stored_action
from gpucloud.models.allocation_states import TERMINAL_ALLOCATION
from gpucloud.models.health_tables import (
    AllocationEvent,
    FleetIncidentPublic,
    Incident,
    IncidentPublic,
    IncidentTenant,
    XidEventRecord,
)
from gpucloud.models.incident_messages import IncidentInput
from gpucloud.models.tables import Allocation, Node, NodeTransition, new_id, utcnow
from gpucloud.protocol.reports import utc_now
from gpucloud.services import fleet_incidents, fleet_kind_incidents
from gpucloud.services import health as health_service
from gpucloud.services.errors import Conflict, NotFound
from gpucloud.services.health import HealthOutcome
from gpucloud.services.pulls import act_on

# The most history rows an incident reads and keeps (a node that flaps for a week keeps the first).
MAX_STEPS = 500
MAX_XIDS = 20
MAX_ROOT_CAUSE = 10_000
MAX_FOLLOW_UPS = 50


class IncidentNotFound(LookupError):
    pass


def _pulling(conditions: Sequence[dict]) -> list[dict]:
    return [c for c in conditions if pulls(stored_action([c]))]


def _signals(session: Session, node: Node | None, detected_at: datetime) -> list[dict]:
    """The conditions that pulled the node, then the XIDs it reported around the fault (no
    tenant or allocation stamps: the record is shown to the tenant touched)."""
    conditions = _pulling(node.health_conditions or []) if node is not None else []
    kept = ("name", "reason", "since", "health", "action", "gpu_index", "xid")
    found = [{k: c.get(k) for k in kept} for c in conditions]
    if node is None:
        return found
    window = rules.CLOCK_SKEW
    xids = session.exec(
        select(XidEventRecord)
        .where(
            col(XidEventRecord.node_id) == node.id,
            col(XidEventRecord.timestamp) >= detected_at - window,
            col(XidEventRecord.timestamp) <= detected_at + window,
        )
        .order_by(col(XidEventRecord.timestamp))
        .limit(MAX_XIDS)
    ).all()
    found += [
        {
            "name": f"xid_{x.xid}_event",
            "reason": x.message[:500],
            "since": x.timestamp.isoformat(),
            "gpu_index": x.gpu_index,
            "xid": x.xid,
        }
        for x in xids
    ]
    return found


def open_incident(session: Session, *, workflow_id: str, inp: IncidentInput, now: datetime | None = None) -> Incident:
    """The incident of this workflow: found, or made from the node's record as it is now."""
    now = now or utcnow()
    existing = session.exec(select(Incident).where(col(Incident.workflow_id) == workflow_id)).first()
    if existing is not None:
        return existing
    node = session.get(Node, inp.node_id)
    allocation_id = inp.allocation_id
    if allocation_id is None and node is not None and node.state in HELD:
        allocation_id = node.allocation_id
    tenant_id = None
    if allocation_id is not None:
        allocation = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).first()
        tenant_id = allocation.tenant_id if allocation is not None else (node.tenant_id if node else None)
    conditions = _pulling(node.health_conditions or []) if node is not None else []
    category, component = rules.classify(conditions)
    summary = inp.reason or (f"{conditions[0].get('name')}: {conditions[0].get('reason')}" if conditions else "")
    incident = Incident(
        id=new_id("inc"),
        workflow_id=workflow_id,
        kind=inp.kind,
        node_id=inp.node_id,
        node_ids=[inp.node_id],
        suspected_component=component,
        category=category.value,
        summary=f"node {inp.node_id} pulled: {summary}"[:1000],
        detected_at=inp.detected_at,
        tenant_id=tenant_id,
        tenant_ids=[tenant_id] if tenant_id else [],
        allocation_ids=[allocation_id] if allocation_id else [],
        gpu_count=node.gpu_count if node is not None else 0,
        signals=_signals(session, node, inp.detected_at),
        created_at=now,
        updated_at=now,
    )
    try:
        with session.begin_nested():
            session.add(incident)
    except IntegrityError:  # a concurrent open of the same workflow id: its row is as good
        return session.exec(select(Incident).where(col(Incident.workflow_id) == workflow_id)).one()
    if tenant_id is not None and allocation_id is not None:
        session.add(
            IncidentTenant(
                incident_id=incident.id, allocation_id=allocation_id, node_id=inp.node_id, tenant_id=tenant_id
            )
        )
    return incident


def get(session: Session, incident_id: str) -> Incident:
    incident = session.exec(select(Incident).where(col(Incident.id) == incident_id)).first()
    if incident is None:
        raise IncidentNotFound(incident_id)
    return incident


def _history(session: Session, incident: Incident) -> tuple[list[rules.Step], list[rules.Replacement], datetime | None]:
    since = incident.detected_at - rules.CLOCK_SKEW
    transitions = session.exec(
        select(NodeTransition)
        .where(col(NodeTransition.node_id) == incident.node_id, col(NodeTransition.at) >= since)
        .order_by(col(NodeTransition.seq))
        .limit(MAX_STEPS)
    ).all()
    steps = [
        rules.Step(at=t.at, event=t.event, from_state=t.from_state, to_state=t.to_state, cause=t.cause, actor=t.actor)
        for t in transitions
    ]
    replacements: list[rules.Replacement] = []
    ended_at = None
    if incident.allocation_ids:
        events = session.exec(
            select(AllocationEvent).where(
                col(AllocationEvent.allocation_id).in_(incident.allocation_ids),
                col(AllocationEvent.kind) == "replaced",
                col(AllocationEvent.node_id) == incident.node_id,
                col(AllocationEvent.at) >= since,
            )
        ).all()
        replacements = [
            rules.Replacement(at=e.at, node_id=e.node_id or "", replacement_node_id=e.replacement_node_id)
            for e in events
        ]
        allocations = session.exec(select(Allocation).where(col(Allocation.id).in_(incident.allocation_ids))).all()
        if allocations and all(a.status in TERMINAL_ALLOCATION for a in allocations):
            ended_at = max(a.updated_at for a in allocations)
    return steps, replacements, ended_at


def observe(session: Session, incident_id: str, *, now: datetime | None = None) -> tuple[Incident, rules.Phases]:
    """Read the node's history again and write each phase the incident reached."""
    now = now or utcnow()
    incident = get(session, incident_id)
    if incident.status != rules.IncidentStatus.OPEN:
        return incident, rules.Phases()
    if incident.kind == fleet_kind_incidents.FLEET:
        return incident, fleet_kind_incidents.observe(session, incident, now=now)
    steps, replacements, allocation_ended_at = _history(session, incident)
    held = bool(incident.allocation_ids)
    found = rules.phases(
        node_id=incident.node_id or "",
        detected_at=incident.detected_at,
        held=held,
        steps=steps,
        replacements=replacements,
        allocation_ended_at=allocation_ended_at,
    )
    incident.pulled_at = found.pulled_at
    incident.stabilized_at = found.stabilized_at
    incident.diagnosed_at = found.diagnosed_at
    incident.repaired_at = found.repaired_at
    incident.repaired_by = found.repaired_by
    incident.gated_at = found.gated_at
    incident.replacement_node_ids = [found.replacement_node_id] if found.replacement_node_id else []
    end = found.ended_at
    # What was done about it: from the pull on (the history read reaches back by the clock skew,
    # which may hold the node's bring-up or its last tenant's release).
    start = found.pulled_at or incident.detected_at
    incident.actions = [s.as_action() for s in steps if s.at >= start and (end is None or s.at <= end)]
    incident.gpu_hours_lost = rules.gpu_hours_lost(
        gpu_count=incident.gpu_count, detected_at=incident.detected_at, held=held, phases_=found, now=now
    )
    incident.phase = found.phase.value
    incident.updated_at = now
    session.add(incident)
    return incident, found


def close(session: Session, incident_id: str, *, abandoned: bool, now: datetime | None = None) -> Incident:
    """End the incident as its history shows (resolved, RMA), or else (`abandoned`: the workflow
    stopped waiting) as abandoned; write the write-up. Closing a closed incident changes nothing."""
    now = now or utcnow()
    incident, found = observe(session, incident_id, now=now)
    if incident.status != rules.IncidentStatus.OPEN:
        return incident
    if found.ended is not None:
        incident.status, incident.closed_at = found.ended.value, found.ended_at
    else:  # closed before the history showed an end: the workflow stopped waiting
        incident.status, incident.closed_at = rules.IncidentStatus.ABANDONED.value, now
    incident.phase = rules.Phase.CLOSED.value
    incident.write_up = write_up(public(incident))
    incident.updated_at = now
    session.add(incident)
    return incident


def set_root_cause(
    session: Session,
    incident_id: str,
    *,
    root_cause: str,
    follow_ups: list[str] | None,
    actor: str,
    now: datetime | None = None,
) -> Incident:
    """An operator's root cause and follow-ups; a written write-up is written again with them."""
    now = now or utcnow()
    incident = get(session, incident_id)
    incident.root_cause = root_cause
    if follow_ups is not None:
        incident.follow_ups = list(follow_ups)
    incident.root_cause_by = actor
    incident.root_cause_at = now
    incident.updated_at = now
    if incident.write_up is not None:
        incident.write_up = write_up(public(incident))
    session.add(incident)
    return incident


def public(incident: Incident) -> IncidentPublic:
    return IncidentPublic.model_validate(incident, from_attributes=True)


def tenant_filter(tenant_id: str):
    """The incidents that touched the tenant's allocations (both kinds), as a SQL condition."""
    return col(Incident.id).in_(select(IncidentTenant.incident_id).where(col(IncidentTenant.tenant_id) == tenant_id))


def links_of(session: Session, incident_ids: Sequence[str], tenant_id: str) -> dict[str, list[IncidentTenant]]:
    """The tenant's allocations (and their nodes) each incident touched."""
    found: dict[str, list[IncidentTenant]] = {i: [] for i in incident_ids}
    if not incident_ids:
        return found
    for link in session.exec(
        select(IncidentTenant).where(
            col(IncidentTenant.incident_id).in_(list(incident_ids)), col(IncidentTenant.tenant_id) == tenant_id
        )
    ).all():
        found[link.incident_id].append(link)
    return found


def touches(session: Session, incident: Incident, tenant_id: str) -> bool:
    return bool(links_of(session, [incident.id], tenant_id)[incident.id])


def views(session: Session, rows: list[Incident], *, tenant_id: str | None) -> list[IncidentPublic]:
    """The incidents as their reader may see them: whole for an operator (`tenant_id` None), a
    tenant's view otherwise (`for_tenant`)."""
    if tenant_id is None:
        return [public(r) for r in rows]
    links = links_of(session, [r.id for r in rows], tenant_id)
    return [for_tenant(r, tenant_id, links[r.id]) for r in rows]


def visible(session: Session, incident_id: str, *, tenant_id: str | None) -> Incident:
    """The incident, if its reader may see it (an operator: any; a tenant: one that touched its
    allocations); `NotFound` otherwise, as for one that does not exist."""
    try:
        incident = get(session, incident_id)
    except IncidentNotFound:
        raise NotFound("incident", incident_id) from None
    if tenant_id is not None and not touches(session, incident, tenant_id):
        raise NotFound("incident", incident_id)
    return incident


def for_tenant(incident: Incident, tenant_id: str, links: Sequence[IncidentTenant]) -> IncidentPublic:
    """What the tenant sees (`links`: its allocations and nodes the incident touched): its own
    tenant id, allocations and nodes only, no other tenant's id in the summary, signals or
    actions, and of a fleet incident's nodes and actions only its own (the others' nodes named
    as "another node")."""
    view = public(incident)
    allocations = {link.allocation_id for link in links}
    nodes = {link.node_id for link in links}
    others = [t for t in view.tenant_ids if t != tenant_id]
    fleet = incident.kind == fleet_kind_incidents.FLEET
    other_nodes = sorted((n for n in view.node_ids if n not in nodes), key=len, reverse=True) if fleet else []

    def scrub(text: object) -> object:
        if not isinstance(text, str):
            return text
        for other in others:
            text = text.replace(other, "another tenant")
        if other_nodes:  # whole ids only: `n1` is not taken out of `n10`
            text = re.sub(rf"(?<![\w.-])({'|'.join(map(re.escape, other_nodes))})(?![\w.-])", "another node", text)
        return text

    def mine(entry: dict) -> bool:
        return not fleet or entry.get("node") in nodes

    return view.model_copy(
        update={
            "tenant_ids": [tenant_id],
            "summary": scrub(view.summary),
            "node_ids": [n for n in view.node_ids if n in nodes] if fleet else view.node_ids,
            "allocation_ids": [a for a in view.allocation_ids if a in allocations],
            "signals": [{k: scrub(v) for k, v in s.items()} for s in view.signals if "node" not in s or mine(s)],
            "actions": [{k: scrub(v) for k, v in a.items()} for a in view.actions if mine(a)],
        }
    )


def write_up_of(view: IncidentPublic, stored: str | None, *, tenant_view: bool) -> str:
    """The stored write-up (the operator's view of a closed incident), else one written now from
    the view the caller may see (a tenant's, or an incident still open)."""
    if stored is not None and not tenant_view:
        return stored
    return write_up(view)


# ---------------------------------------------------------------- an operator's resolve


def _resolve_burst(
    db: Database, settings: Settings, fleet_incident_id: str, actor: str, note: str
) -> tuple[FleetIncidentPublic, list[HealthOutcome]]:
    now = utc_now()
    with db.session() as session:
        try:
            record = fleet_incidents.resolve(session, fleet_incident_id, actor=actor, now=now, note=note)
        except fleet_incidents.IncidentNotFound:
            raise NotFound("fleet incident", fleet_incident_id) from None
        session.flush()
        breaker = health_service.BreakerSettings.of(settings)
        outcomes = health_service.judge_again(session, record.node_ids, now=now, breaker=breaker)
        return FleetIncidentPublic.model_validate(record, from_attributes=True), outcomes


async def resolve_fleet_incident(
    db: Database, settings: Settings, temporal: Client, fleet_incident_id: str, *, actor: str, note: str
) -> tuple[FleetIncidentPublic, list[HealthOutcome]]:
    """The suspected component of a correlated burst is fixed (or was not the cause): the fleet
    incident closes, its nodes leave it (uncordoned if it cordoned them), and they are judged
    again on what came after; a pull that judgement decides is carried out. `NotFound` for no
    such fleet incident."""
    incident, outcomes = await to_thread.run_sync(_resolve_burst, db, settings, fleet_incident_id, actor, note)
    await act_on(temporal, settings, outcomes, {})
    return incident, outcomes


def _resolve_trip(db: Database, incident_id: str, actor: str, note: str) -> IncidentPublic:
    now = utc_now()
    with db.session() as session:
        try:
            incident = get(session, incident_id)
            fleet_kind_incidents.resolve_trip(session, incident, actor=actor, note=note, now=now)
            observe(session, incident_id, now=now)
        except IncidentNotFound:
            raise NotFound("incident", incident_id) from None
        return public(incident)


def _kind_of(db: Database, incident_id: str) -> tuple[str, str | None]:
    with db.reads() as session:
        try:
            incident = get(session, incident_id)
        except IncidentNotFound:
            raise NotFound("incident", incident_id) from None
        return incident.trigger, incident.fleet_incident_id


def _observed(db: Database, incident_id: str) -> IncidentPublic:
    """The incident as its history shows it now (its workflow writes the same on its next look)."""
    with db.session() as session:
        incident, _ = observe(session, incident_id, now=utc_now())
        return public(incident)


async def resolve(
    db: Database, settings: Settings, temporal: Client, incident_id: str, *, actor: str, note: str
) -> IncidentPublic:
    """An operator ends a fleet-kind incident (the API's `POST /v1/incidents/{id}:resolve` and
    the console's resolve): a correlated burst's component is fixed (`resolve_fleet_incident`:
    its nodes are judged again), or a breaker trip is dealt with (the breaker's window is left as
    it is). Its workflow then writes it up once its nodes are back to normal judgement. A node
    incident is not resolved by hand (`Conflict`, `not-resolvable`); `NotFound` for none."""
    trigger, fleet_incident_id = await to_thread.run_sync(_kind_of, db, incident_id)
    if trigger == fleet_kind_incidents.TRIP:
        return await to_thread.run_sync(_resolve_trip, db, incident_id, actor, note)
    if trigger != fleet_kind_incidents.BURST or fleet_incident_id is None:
        raise Conflict(
            f"incident {incident_id} is a node's: it ends when its node passes burn-in or goes to RMA",
            type_="not-resolvable",
            title="Incident not resolvable",
        )
    await resolve_fleet_incident(db, settings, temporal, fleet_incident_id, actor=actor, note=note)
    return await to_thread.run_sync(_observed, db, incident_id)
