"""Allocations. A tenant's pages: its allocations, a create form and cancel, through the API's
own service (`services/allocation_requests`), so the console admits, limits, validates and
records exactly as `POST /v1/allocations` and `POST /v1/allocations/{id}/cancel` do. The request
is checked by the API's own schema (`AllocationRequest`), and each field's refusal is shown
beside the field, in the API's words. Another tenant's allocation is a 404, as in the API.

Both lists are newest first, a page at a time, with the API's keyset cursor (`api/pagination`,
the scheme of `GET /v1/allocations`): no row is skipped or shown twice however many are made
while someone pages. An operator's: every tenant's allocations, filtered by status, tenant, GPU
type and region; one
allocation with its nodes (state, health, the workload its agent reports) and its events; cancel
(with `fleet`, as the API's cancel for operators).
"""

from __future__ import annotations

import functools
import logging
import secrets
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError
from sqlmodel import col, select
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import signal_cancel
from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerOrFleetOperatorDep as Canceller
from gpucloud.api.deps import CallerOrReadOperatorDep as Reader
from gpucloud.api.deps import DbDep, ReadsDep, SettingsDep, TemporalDep, TenantDep, visible
from gpucloud.console import web
from gpucloud.console.session import PREFIX
from gpucloud.models.allocation_states import AllocationStatus
from gpucloud.models.api_schemas import AllocationRequest
from gpucloud.models.catalog import GPU_TYPES
from gpucloud.models.health_tables import AllocationEvent
from gpucloud.models.tables import Allocation
from gpucloud.services import allocation_requests as requests
from gpucloud.services.errors import Conflict, Invalid, QuotaExceeded
from gpucloud.services.node_access import nodes_of
from gpucloud.services.workflow_engine import log_undelivered
from gpucloud.web.problems import field_of

log = logging.getLogger(__name__)
router = web.pages_router()
PAGE_SIZE = 200
EVENTS_SHOWN = 200
FIELDS = ("gpu_type", "region", "node_count")
FILTER_COLUMNS = {"status": "status", "tenant": "tenant_id", "gpu_type": "gpu_type", "region": "region"}
# Who reads an allocation's pages: its tenant, or an operator holding `read`; who cancels one:
# its tenant, or an operator holding `fleet` (the API's cancel).


def _listed(reads: Any, equal: dict[str, str | None], page_token: str) -> tuple[list[Allocation], str]:
    """One page of allocations, newest first, and the next page's token ('' at the end): the
    API's keyset cursor (`api/pagination`, as `GET /v1/allocations`), bound to the filters."""
    page = pagination.PageRequest(PAGE_SIZE, page_token.strip() or None)
    with reads() as session:
        return pagination.fetch(session, Allocation, "seq", page=page, equal=equal, newest_first=True)


def _list_page(request: Request, reads: Any, tenant_id: str, page_token: str = "", **context: Any) -> Response:
    rows, token = _listed(reads, {"tenant_id": tenant_id}, page_token)
    return web.page(
        request,
        "allocations.html",
        allocations=rows,
        **web.pager("/allocations", {}, token, page_token),
        gpu_types=sorted(GPU_TYPES),
        errors=context.pop("errors", {}),
        values=context.pop("values", {}),
        form_error=context.pop("form_error", None),
        form_key=secrets.token_urlsafe(16),
        **context,
    )


@router.get("/allocations")
def allocations_page(
    request: Request,
    caller: Reader,
    reads: ReadsDep,
    status: str = "",
    tenant: str = "",
    gpu_type: str = "",
    region: str = "",
    page_token: str = "",
) -> Response:
    if not caller.is_operator:
        assert caller.tenant_id is not None
        return _list_page(request, reads, caller.tenant_id, page_token)
    filters = {
        "status": status.strip(),
        "tenant": tenant.strip(),
        "gpu_type": gpu_type.strip(),
        "region": region.strip(),
    }
    if filters["status"] and filters["status"] not in {s.value for s in AllocationStatus}:
        filters["status"] = ""
    # The API's names for the columns the filters hold (`tenant` is `tenant_id`).
    equal = {column: filters[name] or None for name, column in FILTER_COLUMNS.items()}
    rows, token = _listed(reads, equal, page_token)
    return web.page(
        request,
        "operator_allocations.html",
        allocations=rows,
        filters=filters,
        statuses=[s.value for s in AllocationStatus],
        **web.pager("/allocations", filters, token, page_token),
    )


@router.post("/allocations")
async def create_allocation(
    request: Request, tenant: TenantDep, reads: ReadsDep, db: DbDep, settings: SettingsDep, temporal: TemporalDep
) -> Response:
    fields = await web.form(request)
    values = {name: fields.get(name, "").strip() for name in FIELDS}
    errors: dict[str, str] = {}
    form_error = None
    try:
        req = AllocationRequest.model_validate({name: value or None for name, value in values.items()})
    except ValidationError as exc:
        for error in exc.errors():
            errors.setdefault(field_of(tuple(error.get("loc", ()))), error.get("msg", "invalid"))
    else:
        # The form's key makes a second submit of the same form (a double click, a reload) find
        # the allocation the first made, as an Idempotency-Key does in the API.
        key = fields.get("form_key", "")
        tag = f"{tenant.id}:console-{key}" if key else None
        try:
            alloc, _ = await requests.create(
                db, temporal, settings, tenant.tenant_id, req, actor=tenant.actor, idempotency_tag=tag
            )
        except Invalid as refused:
            errors[refused.field] = refused.message
        except (Conflict, QuotaExceeded) as refused:
            form_error = f"{refused.title}: {refused.detail}"
        else:
            return web.see_other(f"{PREFIX}/allocations/{alloc.id}")
    return await run_in_threadpool(
        functools.partial(
            _list_page,
            request,
            reads,
            tenant.tenant_id,
            errors=errors,
            values=values,
            form_error=form_error,
            status=422,
        )
    )


def _allocation_page(
    request: Request, caller: Caller, reads: Any, allocation_id: str, *, error: str | None = None, status: int = 200
) -> Response:
    """One allocation (the tenant's own, or any for an operator) with its nodes and events."""
    with reads() as session:
        alloc = visible(session, caller, Allocation, "allocation", allocation_id)
        by_id = nodes_of(session, alloc)
        events = session.exec(
            select(AllocationEvent)
            .where(col(AllocationEvent.allocation_id) == alloc.id, col(AllocationEvent.tenant_id) == alloc.tenant_id)
            .order_by(col(AllocationEvent.seq).desc())
            .limit(EVENTS_SHOWN)
        ).all()
    nodes = [by_id[n] for n in alloc.node_ids if n in by_id]
    return web.page(
        request, "allocation.html", allocation=alloc, nodes=nodes, events=events, error=error, status=status
    )


@router.get("/allocations/{allocation_id}")
def allocation_page(request: Request, allocation_id: str, caller: Reader, reads: ReadsDep) -> Response:
    return _allocation_page(request, caller, reads, allocation_id)


@router.get("/allocations/{allocation_id}/status")
def allocation_status(request: Request, allocation_id: str, caller: Reader, reads: ReadsDep) -> Response:
    """The allocation's status alone, the fragment its page polls (htmx) while it changes."""
    with reads() as session:
        alloc = visible(session, caller, Allocation, "allocation", allocation_id)
    return web.page(request, "allocation_status.html", allocation=alloc)


@router.post("/allocations/{allocation_id}/cancel")
async def cancel_allocation(
    request: Request, allocation_id: str, caller: Canceller, reads: ReadsDep, db: DbDep, temporal: TemporalDep
) -> Response:
    fields = await web.form(request)
    if fields.get("confirm") != "yes":
        error = "tick the box to confirm the cancel"
        return await run_in_threadpool(
            functools.partial(_allocation_page, request, caller, reads, allocation_id, error=error, status=422)
        )
    alloc, op = await run_in_threadpool(
        functools.partial(
            requests.record_cancel,
            db,
            allocation_id,
            tenant_id=caller.tenant_id,
            operator=caller.is_operator,
            actor=caller.actor,
        )
    )
    if op is not None:
        # As the API's cancel: the intent is durable already; the signal only makes it act now.
        try:
            await signal_cancel(temporal, alloc.id, op.id)
        except RPCError as exc:
            log_undelivered(log, exc, f"cancel signal for {alloc.id}", "the workflow will see the DB intent")
    return web.see_other(f"{PREFIX}/allocations/{alloc.id}")
