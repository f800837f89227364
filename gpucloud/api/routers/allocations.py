"""Allocations: create (idempotent, 202 + operation), read, list, cancel (intent, 202)."""

from __future__ import annotations

import functools
import logging

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlmodel import Session
from temporalio.client import Client
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import signal_cancel
from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import (
    CallerDep,
    CallerOrFleetOperatorDep,
    DbDep,
    ReadsDep,
    SettingsDep,
    TemporalDep,
    TenantDep,
    visible,
)
from gpucloud.api.idempotency import IdempotencyKey, accepted, idempotent
from gpucloud.models.api_schemas import (
    AllocationAccepted,
    AllocationEventPage,
    AllocationNode,
    AllocationNodes,
    AllocationPage,
    AllocationRequest,
)
from gpucloud.models.health_tables import AllocationEvent, AllocationEventPublic
from gpucloud.models.tables import (
    Allocation,
    AllocationPublic,
    AllocationStatus,
    Operation,
    OperationPublic,
)
from gpucloud.protocol.reports import WorkloadStatus
from gpucloud.services import allocation_requests as requests
from gpucloud.services.node_access import nodes_of, ssh_endpoint
from gpucloud.services.workflow_engine import log_undelivered

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["allocations"])

RESERVE_ATTEMPTS = 8


def _public(alloc: Allocation) -> AllocationPublic:
    return AllocationPublic.model_validate(alloc, from_attributes=True)


def _op_public(op: Operation | None) -> OperationPublic | None:
    return OperationPublic.model_validate(op, from_attributes=True) if op is not None else None


def _visible(session: Session, caller: Caller, allocation_id: str) -> Allocation:
    return visible(session, caller, Allocation, "allocation", allocation_id)


@router.post(
    "/allocations",
    status_code=202,
    response_model=AllocationAccepted,
    responses={
        409: {"description": "not enough capacity, no quota granted, quota exceeded, or tenant not active"},
        422: {"description": "invalid request, or a GPU type or region the fleet has no nodes of"},
    },
)
async def create_allocation(
    request: Request,
    req: AllocationRequest,
    tenant: TenantDep,
    settings: SettingsDep,
    db: DbDep,
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        tag = f"{tenant.id}:{idempotency_key}" if idempotency_key else None
        alloc, op = await requests.create(
            db, temporal, settings, tenant.tenant_id, req, actor=tenant.actor, idempotency_tag=tag
        )
        body = AllocationAccepted(allocation=_public(alloc), operation=_op_public(op))
        return accepted(body, f"/v1/allocations/{alloc.id}")

    return await idempotent(request, db, tenant.id, idempotency_key, handler)


@router.get("/allocations/{allocation_id}", response_model=AllocationPublic)
def get_allocation(allocation_id: str, caller: CallerDep, reads: ReadsDep):
    with reads() as session:
        return _public(_visible(session, caller, allocation_id))


@router.get("/allocations", response_model=AllocationPage)
def list_allocations(
    caller: CallerDep,
    reads: ReadsDep,
    page: pagination.PageDep,
    status: AllocationStatus | None = None,
    tenant_id: str | None = None,
):
    with reads() as session:
        scope = caller.tenant_id if not caller.is_operator else tenant_id
        rows, token = pagination.fetch(
            session, Allocation, "seq", page=page, equal={"tenant_id": scope, "status": status}
        )
        return AllocationPage(items=[_public(a) for a in rows], next_page_token=token)


@router.get(
    "/allocations/{allocation_id}/nodes",
    response_model=AllocationNodes,
    responses={404: {"description": "no such allocation visible to the caller"}},
)
def allocation_nodes(allocation_id: str, caller: CallerDep, reads: ReadsDep, settings: SettingsDep):
    """The allocation's nodes now: state, health, what each agent last reported of the workload
    (running, exited with its code, none), and where to log in to it (`services/node_access.py`)."""
    with reads() as session:
        alloc = _visible(session, caller, allocation_id)
        by_id = nodes_of(session, alloc)
        items = []
        for node_id in alloc.node_ids:
            node = by_id.get(node_id)
            if node is None:
                continue
            reported = (node.observed or {}).get("workload") if node.allocation_id == alloc.id else None
            items.append(
                AllocationNode(
                    node_id=node.id,
                    state=node.state,
                    health=node.health,
                    last_heartbeat_at=node.last_heartbeat_at,
                    workload=WorkloadStatus.model_validate(reported) if reported else None,
                    ssh=ssh_endpoint(node, allocation_id=alloc.id, user=settings.agent.ssh_user),
                )
            )
        return AllocationNodes(allocation_id=alloc.id, items=items)


@router.get("/allocations/{allocation_id}/events", response_model=AllocationEventPage)
def allocation_events(allocation_id: str, caller: CallerDep, reads: ReadsDep, page: pagination.PageDep):
    """What happened to the allocation's nodes: fault notices, pulls, replacements, ready again."""
    with reads() as session:
        alloc = _visible(session, caller, allocation_id)
        rows, token = pagination.fetch(
            session, AllocationEvent, "seq", page=page, equal={"allocation_id": alloc.id, "tenant_id": alloc.tenant_id}
        )
        return AllocationEventPage(
            items=[AllocationEventPublic.model_validate(e, from_attributes=True) for e in rows], next_page_token=token
        )


@router.post(
    "/allocations/{allocation_id}/cancel",
    response_model=AllocationAccepted,
    responses={
        202: {"description": "cancellation recorded; the allocation shows `cancelling`", "model": AllocationAccepted}
    },
)
async def cancel_allocation(allocation_id: str, caller: CallerOrFleetOperatorDep, db: DbDep, temporal: TemporalDep):
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
    body = AllocationAccepted(allocation=_public(alloc), operation=_op_public(op))
    if op is None:  # already released or failed: nothing to cancel
        return JSONResponse(body.model_dump(mode="json"), status_code=200)
    await _notify(temporal, alloc.id, op.id)
    return JSONResponse(body.model_dump(mode="json"), status_code=202)


async def _notify(temporal: Client, allocation_id: str, operation_id: str) -> None:
    # The intent is already durable in the DB; the signal only makes the workflow act now.
    # If it is lost, the workflow's periodic re-read of the DB picks the cancel up.
    try:
        await signal_cancel(temporal, allocation_id, operation_id)
    except RPCError as exc:
        log_undelivered(log, exc, f"cancel signal for {allocation_id}", "the workflow will see the DB intent")
