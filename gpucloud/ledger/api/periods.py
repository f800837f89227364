"""Billing periods: list them, close one (idempotent), read its invoices or a tenant's draft."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from gpucloud.ledger import problems
from gpucloud.ledger.api.deps import LedgerDep
from gpucloud.ledger.invoicing import close_period, draft_invoice, invoice_body, list_invoices, list_periods
from gpucloud.ledger.periods import PERIOD_PATTERN
from gpucloud.ledger.schemas import PeriodCloseOut, PeriodOut
from gpucloud.models.billing_messages import InvoiceSummary

router = APIRouter(prefix="/v1/periods", tags=["periods"])

PeriodId = Annotated[str, Path(pattern=PERIOD_PATTERN, description="YYYY-MM (UTC)")]


@router.get("", response_model=list[PeriodOut])
def periods(ledger: LedgerDep) -> list[PeriodOut]:
    """From the first period with postings through the current one: which ended, which closed."""
    with ledger.database.read() as connection:
        return list_periods(connection, now_ms=ledger.clock_ms())


@router.post("/{period_id}:close", response_model=PeriodCloseOut)
def close(period_id: PeriodId, ledger: LedgerDep) -> PeriodCloseOut:
    """Close a ``YYYY-MM`` period once it has ended; closing it again returns the same result."""
    return close_period(ledger.database, period_id, now_ms=ledger.clock_ms(), prices=ledger.prices)


@router.get("/{period_id}/invoices", response_model=list[InvoiceSummary])
def invoices(period_id: PeriodId, ledger: LedgerDep) -> list[InvoiceSummary]:
    with ledger.database.read() as connection:
        return list_invoices(connection, period_id)


@router.get("/{period_id}/invoices/{tenant_id}", response_class=Response)
def invoice(period_id: PeriodId, tenant_id: str, ledger: LedgerDep) -> Response:
    """The invoice exactly as stored: canonical JSON bytes, reproducible byte for byte."""
    with ledger.database.read() as connection:
        body = invoice_body(connection, period_id, tenant_id)
    if body is None:
        raise problems.LedgerProblem(problems.NOT_FOUND(f"no invoice for {tenant_id} in {period_id}"))
    return Response(content=body, media_type="application/json")


@router.get("/{period_id}/draft-invoices/{tenant_id}", response_class=Response)
def draft(period_id: PeriodId, tenant_id: str, ledger: LedgerDep) -> Response:
    """An open period's invoice as closing it now would produce it; stored nowhere (409 once closed)."""
    with ledger.database.read() as connection:
        invoice = draft_invoice(connection, period_id, tenant_id, ledger.prices, now_ms=ledger.clock_ms())
    return Response(content=invoice.body, media_type="application/json", headers={"ETag": f'"{invoice.sha256}"'})
