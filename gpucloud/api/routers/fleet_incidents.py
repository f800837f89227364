"""Fleet incidents: faults on several nodes behind one leaf switch, rack or PDU that suspect the
shared component (`services/fleet_incidents.py`). Operators list them and resolve one once the
component is fixed, which returns its nodes to normal judgement (`services/incidents.resolve_fleet_incident`,
the resolve the incidents' routes and the console call too)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from gpucloud.api import pagination
from gpucloud.api.deps import DbDep, FleetOperatorDep, ReadOperatorDep, ReadsDep, SettingsDep, TemporalDep
from gpucloud.api.routers.health import _decisions
from gpucloud.models.api_schemas import FleetIncidentPage, FleetIncidentResolve, FleetIncidentResolved
from gpucloud.models.health_tables import FleetIncidentPublic, FleetIncidentRecord
from gpucloud.services import fleet_incidents, incidents
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
    incident, outcomes = await incidents.resolve_fleet_incident(
        db, settings, temporal, incident_id, actor=operator.actor, note=req.note if req else ""
    )
    return FleetIncidentResolved(incident=incident, decisions=_decisions(outcomes))
