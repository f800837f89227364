"""Allocations: create (idempotent, 202 + operation), read, list, cancel (intent, 202)."""

from __future__ import annotations

import functools
import logging

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlmodel import Session, col, select
from temporalio.client import Client
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import signal_cancel, start_allocation_workflow
from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import (
    CallerDep,
    CallerOrFleetOperatorDep,
    ReadsDep,
    SettingsDep,
    TemporalDep,
    TenantDep,
    visible,
)
from gpucloud.api.idempotency import IdempotencyKey, accepted, idempotent
from gpucloud.api.schemas import (
    AllocationAccepted,
    AllocationEventPage,
    AllocationNode,
    AllocationNodes,
    AllocationPage,
    AllocationRequest,
)
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.health_tables import AllocationEvent, AllocationEventPublic
from gpucloud.models.node_states import NodeEvent, NodeState
from gpucloud.models.tables import (
    TERMINAL_ALLOCATION,
    Allocation,
    AllocationPublic,
    AllocationStatus,
    Node,
    Operation,
    OperationPublic,
)
from gpucloud.models.workflow_ids import allocation_workflow_id
from gpucloud.protocol.reports import WorkloadStatus
from gpucloud.services import allocations as service
from gpucloud.services import catalog as offers
from gpucloud.services import nodes as node_service
from gpucloud.services import quotas
from gpucloud.services.node_access import ssh_endpoint
from gpucloud.services.workflow_engine import engine_problem, log_undelivered
from gpucloud.web.problems import Problem, invalid

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["allocations"])

RESERVE_ATTEMPTS = 8


def _public(alloc: Allocation) -> AllocationPublic:
    return AllocationPublic.model_validate(alloc, from_attributes=True)


def _op_public(op: Operation | None) -> OperationPublic | None:
    return OperationPublic.model_validate(op, from_attributes=True) if op is not None else None


def _visible(session: Session, caller: Caller, allocation_id: str) -> Allocation:
    return visible(session, caller, Allocation, "allocation", allocation_id)


def _created_under(session: Session, tag: str) -> tuple[Allocation, Operation] | None:
    """The allocation an earlier try of this create (same caller and Idempotency-Key) committed."""
    alloc = session.exec(select(Allocation).where(col(Allocation.idempotency_key) == tag)).first()
    if alloc is None:
        return None
    op = session.exec(
        select(Operation).where(col(Operation.resource_id) == alloc.id, col(Operation.kind) == "create_allocation")
    ).one()
    return alloc, op


def _create_in_db(
    settings: Settings, tenant_id: str, req: AllocationRequest, *, actor: str, idempotency_tag: str | None = None
) -> tuple[Allocation, Operation]:
    """Reserve the gang and record the allocation, its operation and its first event (naming the
    caller), in one transaction; under an `idempotency_tag`, an allocation already created under
    it is returned instead."""
    for _ in range(RESERVE_ATTEMPTS):
        try:
            with session_scope(settings.database_url) as session:
                if idempotency_tag is not None and (earlier := _created_under(session, idempotency_tag)) is not None:
                    return earlier
                offers.require_offered(session, gpu_type=req.gpu_type, region=req.region)
                quotas.admit(
                    session,
                    tenant_id,
                    gpu_type=req.gpu_type,
                    region=req.region,
                    node_count=req.node_count or 0,  # the validator fills it in (from nvl72_trays)
                )
                alloc = Allocation(tenant_id=tenant_id, idempotency_key=idempotency_tag, **req.model_dump())
                service.reserve_gang(session, alloc, deadline_scale=settings.reconciler.deadline_scale)
                op = Operation(
                    tenant_id=tenant_id,
                    kind="create_allocation",
                    resource_id=alloc.id,
                    workflow_id=allocation_workflow_id(alloc.id),
                    actor=actor,
                )
                session.add(alloc)
                session.add(op)
                service.record_event(session, alloc, "requested", reason=f"created by {actor}", actor=actor)
                return alloc, op
        except service.ReservationConflict:
            continue
        except service.InsufficientCapacity as exc:
            raise Problem(
                409,
                "insufficient-capacity",
                "Not enough capacity",
                str(exc),
                available_in_largest_domain=exc.largest_domain,
                available_in_region=exc.total,
            ) from exc
        except offers.NotOffered as exc:
            title = "Unknown region" if exc.field == "region" else "GPU type not offered"
            raise invalid(exc.field, exc.message, "not-offered", title=title) from exc
        except quotas.NoQuotaGranted as exc:
            granted = [vars(limit) for limit in exc.granted]
            raise Problem(409, "quota-not-granted", "No quota granted", str(exc), granted=granted) from exc
        except quotas.QuotaExceeded as exc:
            raise Problem(
                409,
                "quota-exceeded",
                "Quota exceeded",
                str(exc),
                quota=vars(exc.limit),
                gpus_per_node=exc.gpus_per_node,
                usage_gpus=exc.usage_gpus,
                requested_gpus=exc.requested_gpus,
                left_gpus=exc.left_gpus,
            ) from exc
        except quotas.TenantNotActive as exc:
            raise Problem(409, "tenant-not-active", "Tenant is not active", str(exc), tenant_status=exc.status) from exc
    raise Problem(503, "busy", "Too much contention", "too many concurrent reservations; retry")


def _undo_reservation(settings: Settings, alloc: Allocation, reason: str) -> None:
    """The workflow could not be started: give the nodes back and fail the allocation."""
    with session_scope(settings.database_url) as session:
        for node_id in alloc.node_ids:
            try:
                node_service.transition(
                    session,
                    node_id,
                    NodeEvent.UNRESERVE,
                    from_state=NodeState.RESERVED,
                    cause=reason,
                    actor="api",
                    deadline_scale=settings.reconciler.deadline_scale,
                )
            except node_service.StaleNode:
                log.warning("node %s moved before its reservation could be undone", node_id)
        service.set_status(session, alloc.id, AllocationStatus.FAILED, failure_reason=reason)


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
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        tag = f"{tenant.id}:{idempotency_key}" if idempotency_key else None
        alloc, op = await run_in_threadpool(
            functools.partial(_create_in_db, settings, tenant.tenant_id, req, actor=tenant.actor, idempotency_tag=tag)
        )
        if alloc.status in TERMINAL_ALLOCATION:  # an earlier try's allocation, already over
            return accepted(
                AllocationAccepted(allocation=_public(alloc), operation=_op_public(op)), f"/v1/allocations/{alloc.id}"
            )
        try:
            # Started again on a re-run too: USE_EXISTING leaves a running workflow alone and
            # starts one an earlier try committed but never started.
            await start_allocation_workflow(temporal, settings, alloc)
        except RPCError as exc:
            await run_in_threadpool(_undo_reservation, settings, alloc, f"could not start provisioning: {exc}")
            raise engine_problem(exc, what="the allocation", left="nothing was kept") from exc
        body = AllocationAccepted(allocation=_public(alloc), operation=_op_public(op))
        return accepted(body, f"/v1/allocations/{alloc.id}")

    return await idempotent(request, settings.database_url, tenant.id, idempotency_key, handler)


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
        nodes = session.exec(select(Node).where(col(Node.id).in_(list(alloc.node_ids)))).all()
        by_id = {n.id: n for n in nodes}
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


def _record_cancel(settings: Settings, caller: Caller, allocation_id: str) -> tuple[Allocation, Operation | None]:
    with session_scope(settings.database_url) as session:
        alloc = _visible(session, caller, allocation_id)
        op = service.record_cancel_intent(session, alloc, tenant_id=alloc.tenant_id, actor=caller.actor)
        return alloc, op


@router.post(
    "/allocations/{allocation_id}/cancel",
    response_model=AllocationAccepted,
    responses={
        202: {"description": "cancellation recorded; the allocation shows `cancelling`", "model": AllocationAccepted}
    },
)
async def cancel_allocation(
    allocation_id: str, caller: CallerOrFleetOperatorDep, settings: SettingsDep, temporal: TemporalDep
):
    alloc, op = await run_in_threadpool(_record_cancel, settings, caller, allocation_id)
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
