"""The operator's pages: the fleet map (every node a cell, grouped by region, pod and rack,
filterable, kept live over Server-Sent Events) and a node's page (state, power, health
conditions, events, and cordon/uncordon through the API's own service, `services/node_requests`).

The map is one query of the columns a cell shows, whatever the fleet's size; the live stream
asks every `TICK_S` only for the nodes whose `updated_at` moved since its last look.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import groupby
from typing import Annotated, Any
from urllib.parse import urlencode

import sqlalchemy as sa
from fastapi import Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from sqlmodel import Session, col, select

from gpucloud.api.deps import DbDep, ReadsDep, SettingsDep, TemporalDep
from gpucloud.api.deps import FleetOperatorDep as FleetOperator
from gpucloud.api.deps import ReadOperatorDep as ReadOperator
from gpucloud.console import charts, web
from gpucloud.console.session import PREFIX
from gpucloud.models.api_schemas import MaintenanceRequest, OperatorActionRequest, PowerRequest
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodeTransition, utcnow
from gpucloud.services import node_health, node_requests
from gpucloud.services.errors import Conflict, Invalid
from gpucloud.web.problems import field_of, not_found

router = web.pages_router()

TICK_S = 1.0
# A write committed a moment after the `updated_at` it set is still seen: each look reaches back.
OVERLAP = timedelta(seconds=5)
# A stream ends after this long and the browser reconnects (EventSource does, from its last
# event id): an open stream holds one of the operator lane's slots, so it must give it back.
STREAM_S = 30.0
EVENTS_SHOWN = 200

_CELL_COLUMNS = (
    col(Node.id),
    col(Node.region),
    col(Node.pod),
    col(Node.rack),
    col(Node.gpu_type),
    col(Node.state),
    col(Node.health),
    col(Node.cordoned),
    col(Node.maintenance),
    col(Node.tenant_id),
    col(Node.updated_at),
)
STATE_CODES = {
    NodeState.ENROLLED: "EN",
    NodeState.INSPECTING: "IN",
    NodeState.BURN_IN: "BI",
    NodeState.AVAILABLE: "AV",
    NodeState.RESERVED: "RS",
    NodeState.PROVISIONING: "PR",
    NodeState.ACTIVE: "AC",
    NodeState.RELEASING: "RL",
    NodeState.WIPING: "WI",
    NodeState.DRAINING: "DR",
    NodeState.QUARANTINED: "QU",
    NodeState.REPAIRING: "RP",
    NodeState.RMA: "RM",
    NodeState.RETIRED: "RT",
}
# Health as a shape as well as a colour: the cell's mark.
HEALTH_MARKS = {"ok": "", "suspect": "?", "failed": "✕"}


@dataclass(frozen=True)
class Filters:
    gpu_type: str = ""
    region: str = ""
    state: str = ""
    tenant: str = ""

    def where(self) -> list[Any]:
        terms: list[Any] = []
        for value, column in (
            (self.gpu_type, Node.gpu_type),
            (self.region, Node.region),
            (self.state, Node.state),
            (self.tenant, Node.tenant_id),
        ):
            if value:
                terms.append(col(column) == value)
        return terms


def cell(row: Any) -> dict[str, Any]:
    """What a node's cell shows (the page renders it; the stream sends it)."""
    flags = [name for name, on in (("cordoned", row.cordoned), ("maintenance", row.maintenance)) if on]
    label = f"{row.id}: {row.state}, health {row.health}" + "".join(f", {flag}" for flag in flags)
    code = STATE_CODES.get(row.state, row.state[:2].upper())
    mark = HEALTH_MARKS.get(row.health, "?") + ("C" if row.cordoned else "")
    # The name starts with the cell's visible text (its code and mark), then says it in words.
    return {
        "id": row.id,
        "state": row.state,
        "health": row.health,
        "code": code,
        "mark": mark,
        "label": f"{code}{mark} {label}" + (f", tenant {row.tenant_id}" if row.tenant_id else ""),
        "cordoned": row.cordoned,
    }


def _grouped(rows: Iterable[Any]) -> list[tuple[str, list[tuple[str, list[tuple[str, list[dict]]]]]]]:
    regions = []
    for region, in_region in groupby(rows, key=lambda r: r.region):
        pods = []
        for pod, in_pod in groupby(in_region, key=lambda r: r.pod):
            pods.append(
                (pod, [(rack, [cell(r) for r in in_rack]) for rack, in_rack in groupby(in_pod, lambda r: r.rack)])
            )
        regions.append((region, pods))
    return regions


def _fleet(session: Session, filters: Filters) -> tuple[list[Any], dict[str, list[str]]]:
    query = (
        sa.select(*_CELL_COLUMNS)
        .where(*filters.where())
        .order_by(col(Node.region), col(Node.pod), col(Node.rack), col(Node.id))
    )
    rows = list(session.execute(query).all())
    choices = session.execute(sa.select(col(Node.gpu_type), col(Node.region)).distinct()).all()
    options = {
        "gpu_types": sorted({c.gpu_type for c in choices}),
        "regions": sorted({c.region for c in choices}),
    }
    return rows, options


@router.get("/fleet")
def fleet_page(
    request: Request,
    operator: ReadOperator,
    reads: ReadsDep,
    gpu_type: str = "",
    region: str = "",
    state: str = "",
    tenant: str = "",
) -> Response:
    filters = Filters(gpu_type=gpu_type.strip(), region=region.strip(), state=state.strip(), tenant=tenant.strip())
    since = utcnow()
    with reads() as session:
        rows, options = _fleet(session, filters)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    query = request.url.query
    return web.page(
        request,
        "fleet.html",
        regions=_grouped(rows),
        total=len(rows),
        counts=sorted(counts.items()),
        filters=filters,
        states=[s.value for s in NodeState],
        state_codes=STATE_CODES,
        options=options,
        stream=f"{PREFIX}/fleet/events?" + (f"{query}&" if query else "") + urlencode({"since": since.isoformat()}),
    )


def _as_utc(moment: datetime) -> datetime:
    """A time without a zone is taken as UTC, as every time the console writes is (a naive one,
    compared with the rows' aware times, would end the stream)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _changed(reads: Any, filters: Filters, since: datetime) -> list[Any]:
    with reads() as session:
        query = sa.select(*_CELL_COLUMNS).where(col(Node.updated_at) >= since - OVERLAP, *filters.where())
        return list(session.execute(query).all())


@router.get("/fleet/events")
async def fleet_events(
    request: Request,
    operator: ReadOperator,
    reads: ReadsDep,
    since: Annotated[datetime | None, Query()] = None,
    gpu_type: str = "",
    region: str = "",
    state: str = "",
    tenant: str = "",
) -> StreamingResponse:
    """The cells that changed, as `nodes` events (a JSON list of cells), each event's id the
    newest `updated_at` it carries; the browser resumes from it (`Last-Event-ID`)."""
    filters = Filters(gpu_type=gpu_type, region=region, state=state, tenant=tenant)
    resumed = request.headers.get("last-event-id")
    start = _as_utc(since) if since is not None else utcnow()
    if resumed:
        with contextlib.suppress(ValueError):  # not one of ours: start from `since`
            start = _as_utc(datetime.fromisoformat(resumed))

    async def events() -> AsyncIterator[str]:
        mark = start
        yield "retry: 1000\n\n"
        loop = asyncio.get_running_loop()
        ends = loop.time() + STREAM_S
        while loop.time() < ends and not await request.is_disconnected():
            rows = await run_in_threadpool(_changed, reads, filters, mark)
            if rows:
                mark = max(mark, *(r.updated_at for r in rows))
                yield f"id: {mark.isoformat()}\nevent: nodes\ndata: {json.dumps([cell(r) for r in rows])}\n\n"
            else:
                yield ": tick\n\n"
            await asyncio.sleep(TICK_S)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})


# The node page's actions: (the form's action, what the page calls it, its confirmation's words).
ACTIONS = ("cordon", "uncordon", "drain", "maintenance", "power")
DONE = {
    "cordon": "Cordoned.",
    "uncordon": "Uncordoned.",
    "drain": "Drain requested: the node is cordoned and the reconciler drains it.",
    "maintenance_on": "Maintenance on.",
    "maintenance_off": "Maintenance off.",
    "power": "Power action requested through the BMC: it shows in the events when the BMC confirms it.",
}
READINGS_CHARTED = 100  # the most `GET /v1/nodes/{id}/health` answers (`reading_limit`)


@router.get("/nodes/{node_id}")
def node_page(request: Request, node_id: str, operator: ReadOperator, reads: ReadsDep, done: str = "") -> Response:
    return _node_page(request, reads, node_id, notice=DONE.get(done))


def _node_page(request: Request, reads: Any, node_id: str, **context: Any) -> Response:
    with reads() as session:
        node = session.get(Node, node_id)
        if node is None:
            raise not_found("node", node_id)
        events = session.exec(
            select(NodeTransition)
            .where(col(NodeTransition.node_id) == node_id)
            .order_by(col(NodeTransition.seq).desc())
            .limit(EVENTS_SHOWN)
        ).all()
        health = node_health.node_health(session, node_id, limit=20, reading_limit=READINGS_CHARTED, signal_limit=20)
    context.setdefault("status", 200)
    return web.page(
        request,
        "node.html",
        node=node,
        cell=cell(node),
        events=events,
        health=health,
        charts=charts.charts(health.readings),
        errors=context.pop("errors", {}),
        values=context.pop("values", {}),
        notice=context.pop("notice", None),
        failed_action=context.pop("failed_action", None),
        form_error=context.pop("form_error", None),
        **context,
    )


def _action_errors(action: str, fields: dict[str, str]) -> tuple[dict[str, str], Any]:
    """The form's refusals by field, in the API's words where its schema refuses (reason, power
    action), and the API's request body when there are none."""
    errors: dict[str, str] = {}
    reason = fields.get("reason", "").strip()
    if not reason:
        errors["reason"] = "say why (it is kept in the node's events with your name)"
    body: Any = None
    try:
        if action == "power":
            body = PowerRequest.model_validate({"action": fields.get("power_action", ""), "reason": reason})
        elif action == "maintenance":
            body = MaintenanceRequest.model_validate({"enabled": fields.get("enabled") == "on", "reason": reason})
        else:
            body = OperatorActionRequest.model_validate({"reason": reason})
    except ValidationError as exc:
        for error in exc.errors():
            name = field_of(tuple(error.get("loc", ())))
            errors.setdefault("power_action" if name == "action" else name, error.get("msg", "invalid"))
    if fields.get("confirm") != "yes":
        errors["confirm"] = "tick the box to confirm"
    return errors, body


@router.post("/nodes/{node_id}/{action}")
async def node_action(
    request: Request,
    node_id: str,
    action: str,
    operator: FleetOperator,
    reads: ReadsDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
) -> Response:
    """Cordon, uncordon, drain, maintenance on or off, power on, off or cycle: each as the API's
    `POST /v1/nodes/{id}/...` does, through the same service (`services/node_requests`), with a
    reason and a ticked confirmation (the page asks again, naming what is missing, without
    either). A refusal (the node in another state, no BMC) is shown beside the action."""
    if action not in ACTIONS:
        raise not_found("node action", action)
    fields = await web.form(request)
    errors, body = _action_errors(action, fields)
    values = {"action": action, "reason": fields.get("reason", "").strip(), "power_action": fields.get("power_action")}
    again = functools.partial(_node_page, request, reads, node_id, values=values, failed_action=action)
    if errors:
        return await run_in_threadpool(functools.partial(again, errors=errors, status=422))
    try:
        if isinstance(body, PowerRequest):
            await node_requests.power(
                db, temporal, settings, node_id, body.action, reason=body.reason, actor=operator.id
            )
            done = "power"
        else:
            done = action
            if isinstance(body, MaintenanceRequest):
                done = "maintenance_on" if body.enabled else "maintenance_off"
            await node_requests.operator_action(
                db, temporal, settings, node_id, done, reason=body.reason, actor=operator.id
            )
    except (Conflict, Invalid) as refused:
        form_error = f"{refused.title}: {refused.detail}"
        return await run_in_threadpool(functools.partial(again, form_error=form_error, status=409))
    return web.see_other(f"{PREFIX}/nodes/{node_id}?done={done}")
