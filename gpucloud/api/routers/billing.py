"""Billing, as the ledger (its own service) keeps it: usage and invoices for tenants, the price
book and the reconciliation report for operators.

The control plane stores no billing data. Each handler asks the ledger over HTTP, naming the
tenant: a tenant's key only ever asks for its own tenant, so another tenant's allocation or
invoice is a 404 like a missing one. Operators name the tenant (`tenant_id`) or, for invoice
listings, see every tenant's. Invoices are passed on byte for byte as the ledger stored them,
their SHA-256 as the ETag. A ledger that does not answer is a 503; its refusals keep their status.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from datetime import date
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Path, Query, Response
from fastapi.concurrency import run_in_threadpool

from gpucloud.api.auth import Caller
from gpucloud.api.deps import BillingOperatorDep, CallerDep, LedgerDep, ReadOperatorDep, Reads, ReadsDep
from gpucloud.ledger.client import LedgerRefused, LedgerUnavailable
from gpucloud.ledger.periods import PERIOD_PATTERN, period_bounds, period_of
from gpucloud.ledger.schemas import (
    InvoiceDocument,
    PriceBookVersionIn,
    PriceBookVersionOut,
    ReconciliationReport,
)
from gpucloud.models.api_schemas import (
    InvoiceList,
    UsageReport,
)
from gpucloud.models.tables import Allocation
from gpucloud.models.tenant_messages import TENANT_ID_PATTERN
from gpucloud.services.visibility import visible
from gpucloud.web.problems import Problem, invalid, not_found

router = APIRouter(
    prefix="/v1",
    tags=["billing"],
    responses={501: {"description": "this control plane has no ledger (billing is not configured)"}},
)

PeriodQuery = Annotated[str | None, Query(pattern=PERIOD_PATTERN, description="billing period, YYYY-MM (UTC)")]
# A tenant id goes into the ledger's paths: anything but an id's characters would name another path.
TenantQuery = Annotated[
    str | None,
    Query(pattern=TENANT_ID_PATTERN, description="operators: the tenant (tenants: always their own)"),
]
INVOICE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"model": InvoiceDocument, "description": "the invoice document, canonical JSON (sorted keys, integers only)"}
}

T = TypeVar("T")


async def _ask(call: Awaitable[T], *, kind: str = "", ident: str = "") -> T:
    try:
        return await call
    except LedgerUnavailable as exc:
        raise Problem(
            503, "ledger-unavailable", "Billing ledger unavailable", "the billing ledger does not answer; retry later"
        ) from exc
    except LedgerRefused as exc:
        if exc.status == 404 and kind:
            raise not_found(kind, ident) from exc
        raise Problem(
            exc.status,
            "ledger-refused",
            exc.problem.get("title", "The ledger refused the request"),
            str(exc),
            **({"field": exc.problem["field"]} if exc.problem.get("field") else {}),
        ) from exc


def _tenant(caller: Caller, tenant_id: str | None) -> str:
    if not caller.is_operator:
        assert caller.tenant_id is not None  # billing answers tenants and operators only
        return caller.tenant_id
    if tenant_id is None:
        raise invalid("tenant_id", "required for operators", detail="tenant_id: operators name the tenant")
    return tenant_id


def _owned(reads: Reads, tenant_id: str, allocation_id: str) -> None:
    """The tenant's allocation, or NotFound (an operator too sees only the tenant it named)."""
    with reads() as session:
        visible(session, Allocation, "allocation", allocation_id, tenant_id=tenant_id, operator=False)


@router.get(
    "/usage",
    response_model=UsageReport,
    responses={404: {"description": "`allocation_id` names no allocation visible to the caller"}},
)
async def get_usage(
    caller: CallerDep,
    reads: ReadsDep,
    ledger: LedgerDep,
    allocation_id: str | None = None,
    period: PeriodQuery = None,
    tenant_id: TenantQuery = None,
):
    """Metered GPU time and its amount (integer GPU-ms and micro-units), by allocation and period."""
    tenant = _tenant(caller, tenant_id)
    if allocation_id is not None:
        await run_in_threadpool(_owned, reads, tenant, allocation_id)
    start_ms, end_ms = period_bounds(period) if period else (None, None)
    summary = await _ask(ledger.usage(tenant_id=tenant, allocation_id=allocation_id, start_ms=start_ms, end_ms=end_ms))
    return UsageReport(**summary.model_dump(), period=period)


@router.get("/invoices", response_model=InvoiceList)
async def list_invoices(
    caller: CallerDep, ledger: LedgerDep, period: PeriodQuery = None, tenant_id: TenantQuery = None
):
    """Invoices of closed periods (operators without `tenant_id`: every tenant's)."""
    tenant = caller.tenant_id if not caller.is_operator else tenant_id
    return InvoiceList(items=await _ask(ledger.invoices(tenant_id=tenant, period_id=period)))


@router.get("/invoices:draft", response_class=Response, responses=INVOICE_RESPONSE)
async def draft_invoice(
    caller: CallerDep, ledger: LedgerDep, period: PeriodQuery = None, tenant_id: TenantQuery = None
):
    """The open period's invoice so far (default: the current period): what closing it now would bill."""
    tenant = _tenant(caller, tenant_id)
    period = period or period_of(time.time_ns() // 1_000_000)
    answer = await _ask(ledger.draft_invoice(period, tenant))
    return Response(
        answer.content,
        media_type="application/json",
        headers={"ETag": answer.headers.get("etag", ""), "Invoice-Status": "draft"},
    )


@router.get("/invoices/{invoice_id}", response_class=Response, responses=INVOICE_RESPONSE)
async def get_invoice(invoice_id: Annotated[int, Path(ge=1, le=2**63 - 1)], caller: CallerDep, ledger: LedgerDep):
    """A closed period's invoice exactly as stored: the same bytes every time (SHA-256 in the ETag)."""
    answer = await _ask(
        ledger.invoice(invoice_id, tenant_id=None if caller.is_operator else caller.tenant_id),
        kind="invoice",
        ident=str(invoice_id),
    )
    headers = {
        name: answer.headers[name] for name in ("etag", "invoice-id", "invoice-period") if name in answer.headers
    }
    return Response(answer.content, media_type="application/json", headers={**headers, "Invoice-Status": "final"})


@router.get("/billing/price-book/versions", response_model=list[PriceBookVersionOut])
async def price_book_versions(operator: ReadOperatorDep, ledger: LedgerDep):
    """Every price book version; usage is rated by the one in force at its start."""
    return await _ask(ledger.price_book_versions())


@router.post(
    "/billing/price-book/versions",
    status_code=201,
    response_model=PriceBookVersionOut,
    responses={409: {"description": "a version already takes effect at or after `effective_from_ms`"}},
)
async def create_price_book_version(version: PriceBookVersionIn, operator: BillingOperatorDep, ledger: LedgerDep):
    """A new version from `effective_from_ms` on (after any usage already rated: no retroactive prices)."""
    return await _ask(ledger.create_price_book_version(version))


@router.get("/billing/reconciliation", response_model=ReconciliationReport)
async def reconciliation(operator: ReadOperatorDep, ledger: LedgerDep, tenant_id: str, day: date):
    """Metered vs allocated time of one tenant on one UTC day; gaps and unallocated usage flagged."""
    return await _ask(ledger.reconciliation(tenant_id=tenant_id, day=day.isoformat()))
