"""Capacity reservations (`services/reservations.py`, docs/scheduling.md): a tenant books N nodes
of a pool for a future window (accepted only if the pool can honour it beside the other
reservations), reads its reservations and cancels one before its window begins."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import poke_pool_scheduler
from gpucloud.api import pagination
from gpucloud.api.deps import CallerDep, CallerOrFleetOperatorDep, DbDep, ReadsDep, SettingsDep, TemporalDep, TenantDep
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.models.api_schemas import ReservationPage, ReservationPublic, ReservationRequest
from gpucloud.models.scheduling_tables import CapacityReservation, ReservationStatus
from gpucloud.services import reservations

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["reservations"])


def _public(r: CapacityReservation) -> ReservationPublic:
    return ReservationPublic.model_validate(r, from_attributes=True)


@router.post(
    "/reservations",
    status_code=201,
    response_model=ReservationPublic,
    responses={
        409: {"description": "the pool cannot honour it beside the other reservations, or no quota for it"},
        422: {"description": "invalid window, or a GPU type or region the fleet has no nodes of"},
    },
)
async def create_reservation(
    request: Request,
    req: ReservationRequest,
    tenant: TenantDep,
    settings: SettingsDep,
    db: DbDep,
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    """Book the window. The pool's scheduler holds the nodes ahead of it, takes them back from
    preemptible work, and has the reservation's allocation ready at `start_at`."""

    async def handler() -> JSONResponse:
        tag = f"{tenant.id}:{idempotency_key}" if idempotency_key else None
        ask = reservations.ReservationAsk(req.gpu_type, req.region, req.node_count, req.start_at, req.end_at)

        def write() -> ReservationPublic:
            with db.session() as session:
                row = reservations.create(
                    session, tenant.tenant_id, ask, settings=settings.scheduler, idempotency_tag=tag
                )
                return _public(row)

        made = await run_in_threadpool(write)
        try:  # the sweep starts it too: a scheduler not started here only starts later
            await poke_pool_scheduler(temporal, settings, made.gpu_type, made.region)
        except RPCError as exc:
            log.warning("the scheduler of %s/%s was not poked: %s", made.gpu_type, made.region, exc)
        return JSONResponse(
            made.model_dump(mode="json"), status_code=201, headers={"Location": f"/v1/reservations/{made.id}"}
        )

    return await idempotent(request, db, tenant.id, idempotency_key, handler)


@router.get("/reservations", response_model=ReservationPage)
def list_reservations(
    caller: CallerDep,
    reads: ReadsDep,
    page: pagination.PageDep,
    status: Annotated[ReservationStatus | None, Query(description="only reservations in this status")] = None,
) -> ReservationPage:
    """The caller's reservations (an operator: everyone's), in the order they were booked, a page
    at a time (`next_page_token`)."""
    with reads() as session:
        scope = None if caller.is_operator else caller.tenant_id
        rows, token = pagination.fetch(
            session, CapacityReservation, "seq", page=page, equal={"tenant_id": scope, "status": status}
        )
        return ReservationPage(items=[_public(r) for r in rows], next_page_token=token)


@router.get("/reservations/{reservation_id}", response_model=ReservationPublic)
def get_reservation(reservation_id: str, caller: CallerDep, reads: ReadsDep) -> ReservationPublic:
    with reads() as session:
        scope = None if caller.is_operator else caller.tenant_id
        return _public(reservations.get(session, reservation_id, tenant_id=scope))


@router.post("/reservations/{reservation_id}/cancel", response_model=ReservationPublic)
async def cancel_reservation(reservation_id: str, caller: CallerOrFleetOperatorDep, db: DbDep) -> ReservationPublic:
    """Cancel before the window begins (nothing is billed); a window under way ends by cancelling
    its allocation."""

    def write() -> ReservationPublic:
        with db.session() as session:
            scope = None if caller.is_operator else caller.tenant_id
            return _public(reservations.cancel(session, reservation_id, tenant_id=scope, actor=caller.actor))

    return await run_in_threadpool(write)
