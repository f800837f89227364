"""Incidents (`docs/health.md`, "Incidents"): the record of each health pull, from the first fault
to the node's return (or RMA), with its write-up. An operator reads them all and writes the root
cause and follow-ups; a tenant reads only the incidents that touched its allocations, with every
other tenant's data removed (any other is the same 404 as a missing one). Both kinds are here:
a node's pull, and a fleet incident (a correlated burst, a circuit-breaker trip), which an
operator may resolve."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse

from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, DbDep, FleetOperatorDep, ReadsDep, SettingsDep, TemporalDep
from gpucloud.models.api_schemas import FleetIncidentResolve, IncidentPage, IncidentStatusName, RootCauseRequest
from gpucloud.models.health_tables import Incident, IncidentPublic
from gpucloud.services import incidents
from gpucloud.web.problems import not_found

router = APIRouter(prefix="/v1", tags=["incidents"])


def _view(session, incident: Incident, caller: Caller) -> IncidentPublic:
    return incidents.views(session, [incident], tenant_id=caller.tenant_scope)[0]


@router.get("/incidents", response_model=IncidentPage)
def list_incidents(
    caller: CallerDep,
    reads: ReadsDep,
    page: pagination.PageDep,
    status: Annotated[IncidentStatusName | None, Query(description="only incidents with this status")] = None,
    node_id: Annotated[str | None, Query(max_length=128, description="only this node's incidents")] = None,
    kind: Annotated[Literal["node", "fleet"] | None, Query(description="only incidents of this kind")] = None,
):
    """Incidents of both kinds, oldest first (a tenant's: those that touched its allocations)."""
    tenant = None if caller.is_operator else (caller.tenant_id or "")
    with reads() as session:
        rows, token = pagination.fetch(
            session,
            Incident,
            "seq",
            page=page,
            equal={"status": status, "node_id": node_id, "kind": kind},
            where={"tenant_id": (tenant, incidents.tenant_filter(tenant or ""))},
        )
        return IncidentPage(items=incidents.views(session, rows, tenant_id=caller.tenant_scope), next_page_token=token)


@router.get("/incidents/{incident_id}", response_model=IncidentPublic)
def get_incident(incident_id: str, caller: CallerDep, reads: ReadsDep):
    with reads() as session:
        return _view(session, incidents.visible(session, incident_id, tenant_id=caller.tenant_scope), caller)


@router.get(
    "/incidents/{incident_id}/write-up",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/markdown": {}}, "description": "the write-up, as Markdown"}},
)
def get_write_up(incident_id: str, caller: CallerDep, reads: ReadsDep):
    """The incident's write-up (Markdown); an incident still open gets one written from where it stands."""
    with reads() as session:
        incident = incidents.visible(session, incident_id, tenant_id=caller.tenant_scope)
        text = incidents.write_up_of(
            _view(session, incident, caller), incident.write_up, tenant_view=not caller.is_operator
        )
    return PlainTextResponse(text, media_type="text/markdown; charset=utf-8")


def _set_root_cause(incident_id: str, req: RootCauseRequest, operator: Caller, db) -> IncidentPublic:
    with db.session() as session:
        try:
            incident = incidents.set_root_cause(
                session, incident_id, root_cause=req.root_cause, follow_ups=req.follow_ups, actor=operator.actor
            )
        except incidents.IncidentNotFound:
            raise not_found("incident", incident_id) from None
        return incidents.public(incident)


@router.post("/incidents/{incident_id}/root-cause", response_model=IncidentPublic)
def post_root_cause(incident_id: str, req: RootCauseRequest, operator: FleetOperatorDep, db: DbDep):
    """An operator's root cause and follow-ups (written again into a closed incident's write-up)."""
    return _set_root_cause(incident_id, req, operator, db)


@router.patch("/incidents/{incident_id}/root-cause", response_model=IncidentPublic)
def patch_root_cause(incident_id: str, req: RootCauseRequest, operator: FleetOperatorDep, db: DbDep):
    """As POST: the root cause replaced, the follow-ups too when given."""
    return _set_root_cause(incident_id, req, operator, db)


@router.post(
    "/incidents/{incident_id}:resolve",
    response_model=IncidentPublic,
    responses={409: {"description": "a node incident: it ends with its node (burn-in or RMA)"}},
)
async def resolve_incident(
    incident_id: str,
    operator: FleetOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: FleetIncidentResolve | None = None,
):
    """An operator ends a fleet incident: a correlated burst's component is fixed (as
    `POST /v1/fleet-incidents/{id}:resolve`: its nodes are judged again), or a breaker trip is
    dealt with (the breaker's window is left as it is). Its workflow then writes it up once
    its nodes are back to normal judgement. A node incident is not resolved by hand (409).
    The one resolve (`services/incidents.resolve`), which the console calls too."""
    note = req.note if req else ""
    return await incidents.resolve(db, settings, temporal, incident_id, actor=operator.actor, note=note)
