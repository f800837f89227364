"""Stored invoices across periods: list them (by tenant, by period), fetch one by id."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from gpucloud.ledger import problems
from gpucloud.ledger.api.deps import LedgerDep
from gpucloud.ledger.invoicing import find_invoices, invoice_by_id
from gpucloud.ledger.periods import PERIOD_PATTERN
from gpucloud.models.billing_messages import InvoiceOut

router = APIRouter(prefix="/v1/invoices", tags=["invoices"])

# Invoice ids are the database's 64-bit integers: a larger one is no id (and overflows a query).
InvoiceId = Annotated[int, Path(ge=1, le=2**63 - 1)]


@router.get("", response_model=list[InvoiceOut])
def list_invoices(
    ledger: LedgerDep,
    tenant_id: str | None = None,
    period_id: Annotated[str | None, Query(pattern=PERIOD_PATTERN)] = None,
) -> list[InvoiceOut]:
    with ledger.database.read() as connection:
        return find_invoices(connection, tenant_id=tenant_id, period_id=period_id)


@router.get("/{invoice_id:int}", response_class=Response)
def get_invoice(invoice_id: InvoiceId, ledger: LedgerDep, tenant_id: str | None = None) -> Response:
    """The invoice exactly as stored; with ``tenant_id``, another tenant's invoice is not found."""
    with ledger.database.read() as connection:
        found = invoice_by_id(connection, invoice_id, tenant_id=tenant_id)
    if found is None:
        raise problems.LedgerProblem(problems.NOT_FOUND(f"no invoice {invoice_id}"))
    summary, body = found
    return Response(content=body, media_type="application/json", headers=invoice_headers(summary))


def invoice_headers(invoice: InvoiceOut) -> dict[str, str]:
    return {"ETag": f'"{invoice.sha256}"', "Invoice-Id": str(invoice.id), "Invoice-Period": invoice.period_id}
