"""Incidents and the queue, for operators and tenants alike, as the API answers them.

- Incidents (`services/incidents.py`, the API's `/v1/incidents`): the list (by status and
  kind), one incident's story from detection to write-up (its phases, signals, actions and the
  write-up, Markdown rendered without raw HTML), and the operator's root cause and follow-ups
  (`incidents.set_root_cause`, with `fleet`), and the operator's resolve of a fleet-kind
  incident (`incidents.resolve`, the API's resolve, with `fleet`). A tenant sees only the incidents that touched its
  allocations, with other tenants' data removed (`incidents.for_tenant`); any other is a 404.
- The queue (`services/scheduling.queue_of`, the API's `GET /v1/queue`): queued allocations by
  pool with their positions and estimated starts; a tenant's own only.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from markdown_it import MarkdownIt
from markupsafe import Markup
from pydantic import ValidationError
from sqlmodel import col, select

from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerOrReadOperatorDep as Reader
from gpucloud.api.deps import DbDep, ReadsDep, SettingsDep, TemporalDep
from gpucloud.api.deps import FleetOperatorDep as FleetOperator
from gpucloud.console import web
from gpucloud.console.session import PREFIX
from gpucloud.models.api_schemas import FleetIncidentResolve, RootCauseRequest
from gpucloud.models.health_tables import Incident
from gpucloud.services import incidents, scheduling
from gpucloud.services.errors import Conflict
from gpucloud.web.problems import field_of, not_found

router = web.pages_router()
LISTED = 200
STATUSES = ("open", "closed", "abandoned")
# A write-up is Markdown the control plane wrote, with operators' words in it: no raw HTML.
MARKDOWN = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
PHASES = (
    ("detected_at", "Detected"),
    ("pulled_at", "Pulled"),
    ("stabilized_at", "Stabilized"),
    ("diagnosed_at", "Diagnosed"),
    ("repaired_at", "Repaired"),
    ("gated_at", "Passed the gate"),
    ("closed_at", "Closed"),
)


@router.get("/incidents")
def incidents_page(request: Request, caller: Reader, reads: ReadsDep, status: str = "", kind: str = "") -> Response:
    status = status if status in STATUSES else ""
    kind = kind if kind in ("node", "fleet") else ""
    with reads() as session:
        query = select(Incident).order_by(col(Incident.seq).desc()).limit(LISTED)
        if status:
            query = query.where(col(Incident.status) == status)
        if kind:
            query = query.where(col(Incident.kind) == kind)
        if not caller.is_operator:
            query = query.where(incidents.tenant_filter(caller.tenant_id or ""))
        views = incidents.views(session, list(session.exec(query).all()), tenant_id=caller.tenant_scope)
    return web.page(
        request, "incidents.html", incidents=views, status_filter=status, kind=kind, statuses=STATUSES, listed=LISTED
    )


def _incident_page(request: Request, caller: Caller, reads: Any, incident_id: str, **context: Any) -> Response:
    with reads() as session:
        incident = incidents.visible(session, incident_id, tenant_id=caller.tenant_scope)
        view = incidents.views(session, [incident], tenant_id=caller.tenant_scope)[0]
        text = incidents.write_up_of(view, incident.write_up, tenant_view=not caller.is_operator)
    return web.page(
        request,
        "incident.html",
        incident=view,
        phases=[(label, getattr(view, name)) for name, label in PHASES],
        write_up=Markup(MARKDOWN.render(text)),
        errors=context.pop("errors", {}),
        values=context.pop("values", {}),
        resolve_errors=context.pop("resolve_errors", {}),
        resolve_values=context.pop("resolve_values", {}),
        resolve_refused=context.pop("resolve_refused", None),
        notice=context.pop("notice", None),
        status=context.pop("status", 200),
    )


DONE = {"root-cause": "Root cause saved.", "resolve": "Resolved."}


@router.get("/incidents/{incident_id}")
def incident_page(request: Request, incident_id: str, caller: Reader, reads: ReadsDep, done: str = "") -> Response:
    return _incident_page(request, caller, reads, incident_id, notice=DONE.get(done))


@router.post("/incidents/{incident_id}/root-cause")
async def root_cause(
    request: Request, incident_id: str, operator: FleetOperator, reads: ReadsDep, db: DbDep
) -> Response:
    """The operator's root cause and follow-ups (one a line), checked by the API's schema and
    saved by the same service as `POST /v1/incidents/{id}/root-cause`."""
    fields = await web.form(request)
    follow_ups = [line.strip() for line in fields.get("follow_ups", "").splitlines() if line.strip()]
    values = {"root_cause": fields.get("root_cause", "").strip(), "follow_ups": "\n".join(follow_ups)}
    try:
        req = RootCauseRequest.model_validate({"root_cause": values["root_cause"], "follow_ups": follow_ups})
    except ValidationError as exc:
        errors = {field_of(tuple(e.get("loc", ()))): e.get("msg", "invalid") for e in exc.errors()}
        page = functools.partial(_incident_page, request, operator, reads, incident_id, errors=errors, values=values)
        return await run_in_threadpool(functools.partial(page, status=422))

    def save() -> None:
        with db.session() as session:
            try:
                incidents.set_root_cause(
                    session, incident_id, root_cause=req.root_cause, follow_ups=req.follow_ups, actor=operator.actor
                )
            except incidents.IncidentNotFound:
                raise not_found("incident", incident_id) from None

    await run_in_threadpool(save)
    return web.see_other(f"{PREFIX}/incidents/{incident_id}?done=root-cause")


@router.post("/incidents/{incident_id}/resolve")
async def resolve(
    request: Request,
    incident_id: str,
    operator: FleetOperator,
    reads: ReadsDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
) -> Response:
    """An operator ends a fleet-kind incident with a note and a ticked confirmation, through the
    one resolve the API's `POST /v1/incidents/{id}:resolve` calls (`incidents.resolve`): a
    node's incident is refused in the API's words."""
    fields = await web.form(request)
    values = {"note": fields.get("note", "").strip()}
    errors: dict[str, str] = {}
    req = None
    try:
        req = FleetIncidentResolve.model_validate(values)
    except ValidationError as exc:
        errors = {field_of(tuple(e.get("loc", ()))): e.get("msg", "invalid") for e in exc.errors()}
    if fields.get("confirm") != "yes":
        errors["confirm"] = "tick the box to confirm the resolve"
    page = functools.partial(_incident_page, request, operator, reads, incident_id, resolve_values=values)
    if errors or req is None:
        return await run_in_threadpool(functools.partial(page, resolve_errors=errors, status=422))
    try:
        await incidents.resolve(db, settings, temporal, incident_id, actor=operator.actor, note=req.note)
    except Conflict as refused:
        refusal = f"{refused.title}: {refused.detail}"
        return await run_in_threadpool(functools.partial(page, resolve_refused=refusal, status=409))
    return web.see_other(f"{PREFIX}/incidents/{incident_id}?done=resolve")


@router.get("/queue")
def queue_page(request: Request, caller: Reader, reads: ReadsDep, gpu_type: str = "", region: str = "") -> Response:
    scope = None if caller.is_operator else caller.tenant_id
    with reads() as session:
        rows = scheduling.queue_of(
            session, gpu_type.strip() or None, region.strip() or None, tenant_id=scope, limit=1000
        )
    pools: dict[tuple[str, str], list[Any]] = {}
    for a in rows:
        pools.setdefault((a.gpu_type, a.region), []).append(a)
    return web.page(
        request,
        "queue.html",
        pools=sorted(pools.items()),
        total=len(rows),
        filters={"gpu_type": gpu_type.strip(), "region": region.strip()},
    )
