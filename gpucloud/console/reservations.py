"""Capacity reservations, as the API's `/v1/reservations` answers them (`services/reservations`):

- the list: a tenant's own, an operator's every tenant's (filtered by status and tenant), newest
  first, a page at a time with the API's keyset cursor (`api/pagination`, as `GET /v1/reservations`);
- one reservation: its pool, window, status, the allocation it runs as; another tenant's is a 404,
  as in the API;
- cancel before its window begins (its tenant, or an operator holding `fleet`, as the API's cancel),
  with a ticked confirmation, through `reservations.cancel`, which records who asked.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool

from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerOrFleetOperatorDep as Canceller
from gpucloud.api.deps import CallerOrReadOperatorDep as Reader
from gpucloud.api.deps import DbDep, ReadsDep
from gpucloud.console import web
from gpucloud.console.session import PREFIX
from gpucloud.models.scheduling_tables import CapacityReservation, ReservationStatus
from gpucloud.services import reservations
from gpucloud.services.errors import Conflict

router = web.pages_router()
STATUSES = tuple(s.value for s in ReservationStatus)
PAGE_SIZE = 50


def _scope(caller: Caller) -> str | None:
    return None if caller.is_operator else caller.tenant_id


@router.get("/reservations")
def reservations_page(
    request: Request, caller: Reader, reads: ReadsDep, status: str = "", tenant: str = "", page_token: str = ""
) -> Response:
    status = status.strip() if status.strip() in STATUSES else ""
    tenant = tenant.strip() if caller.is_operator else ""
    filters = {"status": status, "tenant": tenant}
    page = pagination.PageRequest(PAGE_SIZE, page_token.strip() or None)
    with reads() as session:
        scope = (tenant or None) if caller.is_operator else caller.tenant_id
        rows, token = pagination.fetch(
            session,
            CapacityReservation,
            "seq",
            page=page,
            equal={"tenant_id": scope, "status": status or None},
            newest_first=True,
        )
    return web.page(
        request,
        "reservations.html",
        reservations=rows,
        filters=filters,
        statuses=STATUSES,
        **web.pager("/reservations", filters, token, page_token),
    )


def _reservation_page(request: Request, caller: Caller, reads: Any, reservation_id: str, **context: Any) -> Response:
    with reads() as session:
        row = reservations.get(session, reservation_id, tenant_id=_scope(caller))
    return web.page(
        request,
        "reservation.html",
        reservation=row,
        errors=context.pop("errors", {}),
        form_error=context.pop("form_error", None),
        notice=context.pop("notice", None),
        status=context.pop("status", 200),
    )


@router.get("/reservations/{reservation_id}")
def reservation_page(
    request: Request, reservation_id: str, caller: Reader, reads: ReadsDep, done: str = ""
) -> Response:
    notice = "Reservation cancelled: nothing is billed for it." if done == "cancel" else None
    return _reservation_page(request, caller, reads, reservation_id, notice=notice)


@router.post("/reservations/{reservation_id}/cancel")
async def cancel_reservation(
    request: Request, reservation_id: str, caller: Canceller, reads: ReadsDep, db: DbDep
) -> Response:
    fields = await web.form(request)
    again = functools.partial(_reservation_page, request, caller, reads, reservation_id)
    if fields.get("confirm") != "yes":
        errors = {"confirm": "tick the box to confirm the cancel"}
        return await run_in_threadpool(functools.partial(again, errors=errors, status=422))

    def write() -> None:
        with db.session() as session:
            reservations.cancel(session, reservation_id, tenant_id=_scope(caller), actor=caller.actor)

    try:
        await run_in_threadpool(write)
    except Conflict as refused:
        form_error = f"{refused.title}: {refused.detail}"
        return await run_in_threadpool(functools.partial(again, form_error=form_error, status=409))
    return web.see_other(f"{PREFIX}/reservations/{reservation_id}?done=cancel")
