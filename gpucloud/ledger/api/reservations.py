"""Capacity reservations sent by the control plane."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from gpucloud.ledger.api.deps import LedgerDep
from gpucloud.ledger.reservations import list_reservations, record_reservation
from gpucloud.ledger.schemas import ReservationIn, ReservationOut

router = APIRouter(prefix="/v1/reservations", tags=["reservations"])


@router.post("", response_model=ReservationOut, status_code=status.HTTP_201_CREATED)
def post_reservation(reservation: ReservationIn, ledger: LedgerDep, response: Response) -> ReservationOut:
    """Idempotent on ``reservation_id``: the same body again answers 200 with the stored one,
    another body under the same id 409."""
    with ledger.database.write() as connection:
        stored = record_reservation(connection, reservation, now_ms=ledger.clock_ms())
    if stored.replayed:
        response.status_code = status.HTTP_200_OK
    return stored


@router.get("", response_model=list[ReservationOut])
def get_reservations(ledger: LedgerDep, tenant_id: str) -> list[ReservationOut]:
    with ledger.database.read() as connection:
        return list_reservations(connection, tenant_id=tenant_id)
