"""What a tenant asks of its allocations through the API: create one (offer, quota, gang
reservation, its operation and first event, then its workflow) and cancel one (intent).

A create is idempotent under a tag (the caller and its Idempotency-Key): a re-run finds the
allocation an earlier try committed by the tag and answers with it instead of reserving again.
Refusals are domain errors (`services/errors.py`).
"""

from __future__ import annotations

import functools
import logging

from anyio import to_thread
from sqlmodel import Session, col, select
from temporalio.client import Client
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import start_allocation_workflow
from gpucloud.config import SchedulerSettings, Settings
from gpucloud.db import Database
from gpucloud.models.api_schemas import AllocationRequest
from gpucloud.models.node_states import NodeEvent, NodeState
from gpucloud.models.tables import TERMINAL_ALLOCATION, Allocation, AllocationStatus, Operation
from gpucloud.models.workflow_ids import allocation_workflow_id
from gpucloud.services import allocations as service
from gpucloud.services import catalog as offers
from gpucloud.services import nodes as node_service
from gpucloud.services import quotas, scheduling
from gpucloud.services.errors import Conflict, Unavailable
from gpucloud.services.visibility import visible
from gpucloud.services.workflow_engine import engine_error

log = logging.getLogger(__name__)

RESERVE_ATTEMPTS = 8


def _created_under(session: Session, tag: str) -> tuple[Allocation, Operation] | None:
    """The allocation an earlier try of this create (same caller and Idempotency-Key) committed."""
    alloc = session.exec(select(Allocation).where(col(Allocation.idempotency_key) == tag)).first()
    if alloc is None:
        return None
    op = session.exec(
        select(Operation).where(col(Operation.resource_id) == alloc.id, col(Operation.kind) == "create_allocation")
    ).one()
    return alloc, op


def reserve_and_record(
    db: Database,
    tenant_id: str,
    req: AllocationRequest,
    *,
    actor: str,
    deadline_scale: float,
    scheduler: SchedulerSettings | None = None,
    idempotency_tag: str | None = None,
) -> tuple[Allocation, Operation]:
    """Reserve the gang and record the allocation, its operation and its first event (naming the
    caller), in one transaction; under an `idempotency_tag`, an allocation already created under
    it is returned instead. With `capacity.wait = queue` and no room, it is recorded `queued`
    (`services/scheduling.py`)."""
    scheduler = scheduler or SchedulerSettings()
    for _ in range(RESERVE_ATTEMPTS):
        try:
            with db.session() as session:
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
                alloc = Allocation(
                    tenant_id=tenant_id,
                    idempotency_key=idempotency_tag,
                    max_wait_s=req.capacity.max_wait_s,
                    **req.model_dump(exclude={"capacity"}),
                )
                queued_because = scheduling.admit(
                    session, alloc, wait=req.capacity.wait, settings=scheduler, deadline_scale=deadline_scale
                )
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
                if queued_because is not None:
                    service.record_event(session, alloc, "queued", reason=queued_because, actor=actor)
                return alloc, op
        except service.ReservationConflict:
            continue
        except service.InsufficientCapacity as exc:
            raise Conflict(
                str(exc),
                type_="insufficient-capacity",
                title="Not enough capacity",
                available_in_largest_domain=exc.largest_domain,
                available_in_region=exc.total,
                queued_in_pool=exc.queued,
            ) from exc
        except offers.NotOffered as exc:
            raise offers.refusal(exc) from exc
        except quotas.REFUSED as exc:
            raise quotas.refusal(exc) from exc
    raise Unavailable("too many concurrent reservations; retry", type_="busy", title="Too much contention")


def undo_reservation(db: Database, alloc: Allocation, reason: str, *, deadline_scale: float) -> None:
    """The workflow could not be started: give the nodes back and fail the allocation."""
    with db.session() as session:
        for node_id in alloc.node_ids:
            try:
                node_service.transition(
                    session,
                    node_id,
                    NodeEvent.UNRESERVE,
                    from_state=NodeState.RESERVED,
                    cause=reason,
                    actor="api",
                    deadline_scale=deadline_scale,
                )
            except node_service.StaleNode:
                log.warning("node %s moved before its reservation could be undone", node_id)
        service.set_status(session, alloc.id, AllocationStatus.FAILED, failure_reason=reason)


async def create(
    db: Database,
    temporal: Client,
    settings: Settings,
    tenant_id: str,
    req: AllocationRequest,
    *,
    actor: str,
    idempotency_tag: str | None = None,
) -> tuple[Allocation, Operation]:
    """Reserve and record the allocation (`reserve_and_record`, on a worker thread), then start
    its workflow; if the engine refuses, the reservation is undone and the refusal raised."""
    scale = settings.reconciler.deadline_scale
    alloc, op = await to_thread.run_sync(
        functools.partial(
            reserve_and_record,
            db,
            tenant_id,
            req,
            actor=actor,
            deadline_scale=scale,
            scheduler=settings.scheduler,
            idempotency_tag=idempotency_tag,
        )
    )
    if alloc.status in TERMINAL_ALLOCATION:  # an earlier try's allocation, already over
        return alloc, op
    try:
        # Started again on a re-run too: USE_EXISTING leaves a running workflow alone and
        # starts one an earlier try committed but never started.
        await start_allocation_workflow(temporal, settings, alloc)
    except RPCError as exc:
        reason = f"could not start provisioning: {exc}"
        await to_thread.run_sync(functools.partial(undo_reservation, db, alloc, reason, deadline_scale=scale))
        raise engine_error(exc, what="the allocation", left="nothing was kept") from exc
    return alloc, op


def record_cancel(
    db: Database, allocation_id: str, *, tenant_id: str | None, operator: bool, actor: str
) -> tuple[Allocation, Operation | None]:
    """Record the intent to cancel an allocation the caller sees; no operation when it is over
    already (released or failed: nothing to cancel)."""
    with db.session() as session:
        alloc = visible(session, Allocation, "allocation", allocation_id, tenant_id=tenant_id, operator=operator)
        op = service.record_cancel_intent(session, alloc, tenant_id=alloc.tenant_id, actor=actor)
        return alloc, op
