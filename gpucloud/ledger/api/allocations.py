"""Allocation lifecycle events sent by the control plane."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from gpucloud.ledger.allocations import list_events, record_event
from gpucloud.ledger.api.deps import LedgerDep
from gpucloud.ledger.schemas import AllocationEventIn, AllocationEventOut

router = APIRouter(prefix="/v1/allocation-events", tags=["allocations"])


@router.post("", response_model=AllocationEventOut, status_code=status.HTTP_201_CREATED)
def post_event(event: AllocationEventIn, ledger: LedgerDep, response: Response) -> AllocationEventOut:
    """Idempotent on ``event_id``: a replay answers 200 with the stored event."""
    with ledger.database.write() as connection:
        stored = record_event(connection, event, now_ms=ledger.clock_ms())
    if stored.replayed:
        response.status_code = status.HTTP_200_OK
    return stored


@router.get("", response_model=list[AllocationEventOut])
def get_events(ledger: LedgerDep, tenant_id: str, allocation_id: str | None = None) -> list[AllocationEventOut]:
    with ledger.database.read() as connection:
        return list_events(connection, tenant_id=tenant_id, allocation_id=allocation_id)
