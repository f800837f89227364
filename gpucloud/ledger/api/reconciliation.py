"""Reconciliation of metered usage against allocated time, per tenant per day."""

from __future__ import annotations

from datetime import date

from fastapi import APIRouter

from gpucloud.ledger.api.deps import LedgerDep
from gpucloud.ledger.models import ReconciliationReport
from gpucloud.ledger.reconciliation import reconcile

router = APIRouter(prefix="/v1/reconciliation", tags=["reconciliation"])


@router.get("", response_model=ReconciliationReport)
def get_reconciliation(ledger: LedgerDep, tenant_id: str, day: date) -> ReconciliationReport:
    with ledger.database.read() as connection:
        return reconcile(connection, tenant_id=tenant_id, day=day, now_ms=ledger.clock_ms())
