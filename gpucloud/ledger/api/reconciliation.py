"""Reconciliation of metered usage against allocated time, per tenant per day."""

from __future__ import annotations

from datetime import date
from typing import Annotated

from fastapi import APIRouter, Query

from gpucloud.ledger.api.deps import LedgerDep
from gpucloud.ledger.reconciliation import EDGE_TOLERANCE_MS, reconcile
from gpucloud.ledger.schemas import ReconciliationReport

router = APIRouter(prefix="/v1/reconciliation", tags=["reconciliation"])


@router.get("", response_model=ReconciliationReport)
def get_reconciliation(
    ledger: LedgerDep,
    tenant_id: str,
    day: date,
    edge_tolerance_ms: Annotated[
        int,
        Query(
            ge=0,
            le=3_600_000,
            description=(
                "gaps and unallocated spans shorter than this at an allocated interval's edge are not flagged"
            ),
        ),
    ] = EDGE_TOLERANCE_MS,
) -> ReconciliationReport:
    with ledger.database.read() as connection:
        return reconcile(
            connection, tenant_id=tenant_id, day=day, now_ms=ledger.clock_ms(), edge_tolerance_ms=edge_tolerance_ms
        )
