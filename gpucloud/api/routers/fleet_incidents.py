"""Fleet incidents: faults on several nodes behind one leaf switch, rack or PDU that suspect the
shared component (`services/fleet_incidents.py`). Operators list them and resolve one once the
component is fixed, which returns its nodes to normal judgement."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool

from gpucloud.api import pagination
from gpucloud.api.deps import DbDep, FleetOperatorDep, ReadOperatorDep, ReadsDep, SettingsDep, TemporalDep
from gpucloud.api.routers.health import _decisions
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.models.api_schemas import FleetIncidentPage, FleetIncidentResolve, FleetIncidentResolved
from gpucloud.models.health_tables import FleetIncidentPublic, FleetIncidentRecord
from gpucloud.protocol.reports import utc_now
from gpucloud.services import fleet_incidents, pulls
from gpucloud.services import health as health_service
from gpucloud.web.problems import not_found

router = APIRouter(prefix="/v1", tags=["health"])


def _public(record: FleetIncidentRecord) -> FleetIncidentPublic:
    return FleetIncidentPublic.model_validate(record, from_attributes=True)


@router.get("/fleet-incidents", response_model=FleetIncidentPage)
def list_fleet_incidents(
    operator: ReadOperatorDep,
    reads: ReadsDep,
    page: pagination.PageDep,
    status: Annotated[Literal["open", "resolved"] | None, Query(description="only incidents with this status")] = None,
):
    """Fleet incidents, open and resolved (`status` filters)."""
    with reads() as session:
        rows, token = pagination.fetch(session, FleetIncidentRecord, "id", page=page, equal={"status": status})
        return FleetIncidentPage(items=[_public(r) for r in rows], next_page_token=token)


@router.get("/fleet-incidents/{incident_id}", response_model=FleetIncidentPublic)
def get_fleet_incident(incident_id: str, operator: ReadOperatorDep, reads: ReadsDep):
    with reads() as session:
        try:
            return _public(fleet_incidents.get(session, incident_id))
        except fleet_incidents.IncidentNotFound:
            raise not_found("fleet incident", incident_id) from None


def _resolve(db: Database, settings: Settings, incident_id: str, actor: str, note: str):
    now = utc_now()
    with db.session() as session:
        try:
            record = fleet_incidents.resolve(session, incident_id, actor=actor, now=now, note=note)
        except fleet_incidents.IncidentNotFound:
            raise not_found("fleet incident", incident_id) from None
        session.flush()
        outcomes = health_service.judge_again(
            session, record.node_ids, now=now, breaker=health_service.BreakerSettings.of(settings)
        )
        return _public(record), outcomes


@router.post("/fleet-incidents/{incident_id}:resolve", response_model=FleetIncidentResolved)
async def resolve_fleet_incident(
    incident_id: str,
    operator: FleetOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: FleetIncidentResolve | None = None,
):
    """The suspected component is fixed (or was not the cause): the incident closes, its nodes
    leave it (uncordoned if it cordoned them), what they showed before now is dealt with, and
    they are judged again on what came after; a pull that judgement decides is carried out."""
    incident, outcomes = await resolve(db, settings, temporal, incident_id, operator.actor, req.note if req else "")
    return FleetIncidentResolved(incident=incident, decisions=_decisions(outcomes))


async def resolve(db: Database, settings: Settings, temporal, incident_id: str, actor: str, note: str):
    """Resolve the fleet incident and carry out what judging its nodes again decided (also
    `POST /v1/incidents/{id}:resolve` of its incident)."""
    incident, outcomes = await run_in_threadpool(_resolve, db, settings, incident_id, actor, note)
    await pulls.act_on(temporal, settings, outcomes, {})
    return incident, outcomes
