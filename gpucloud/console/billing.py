"""The operator's billing page, asked of the billing ledger (its own service) through the one
client the API's billing router uses (`ledger/client.LedgerClient`, `app.state.ledger`):

- the billing periods (`LedgerClient.periods`): open, ended and waiting for its close, or closed;
- a period's invoices (`LedgerClient.invoices`, as `GET /v1/invoices?period=`): tenant, GPU-hours,
  total, and the total by price class, read from each stored invoice document
  (`LedgerClient.invoice`, as `GET /v1/invoices/{id}`; `InvoiceDocument.totals_by_price_class`);
- the reconciliation of one tenant on one UTC day (`LedgerClient.reconciliation`, as
  `GET /v1/billing/reconciliation`): per allocation what was held (billed) against what its nodes'
  agents metered, with the gaps and unallocated usage flagged.

A control plane without a ledger says so; a ledger that does not answer, or refuses, too.
"""

from __future__ import annotations

import asyncio
import re
import time
from datetime import UTC, date, datetime, timedelta

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError
from sqlmodel import col, select

from gpucloud.api.deps import ReadOperatorDep as ReadOperator
from gpucloud.api.deps import ReadsDep
from gpucloud.console import web
from gpucloud.ledger.client import LedgerClient, LedgerRefused, LedgerUnavailable
from gpucloud.ledger.periods import PERIOD_PATTERN, period_of
from gpucloud.ledger.pricing import PRICE_CLASSES
from gpucloud.ledger.schemas import InvoiceDocument, PeriodOut, ReconciliationReport
from gpucloud.models.billing_messages import InvoiceOut
from gpucloud.models.tables import Tenant
from gpucloud.models.tenant_messages import TENANT_ID_PATTERN

router = web.pages_router()
# A period's invoices whose documents the page reads for their totals by price class.
DOCUMENTS_READ = 100
DOCUMENT_READS_AT_ONCE = 8
TENANTS_LISTED = 500


def from_ms(ms: int | None) -> str:
    """An epoch-milliseconds instant as the pages show one (UTC, to the second)."""
    return web.when(datetime.fromtimestamp(ms / 1000, UTC) if ms is not None else None)


web.TEMPLATES.filters.update(from_ms=from_ms)


def _period_state(period: PeriodOut) -> str:
    if period.closed_ms is not None:
        return "closed"
    return "ended, not closed yet" if period.ended else "open"


async def _by_class(ledger: LedgerClient, invoices: list[InvoiceOut]) -> dict[int, dict[str, int]]:
    """Each invoice's totals by price class, from its stored document (the first
    `DOCUMENTS_READ`, a few at a time); an invoice whose document does not read is left out."""
    gate = asyncio.Semaphore(DOCUMENT_READS_AT_ONCE)

    async def one(invoice: InvoiceOut) -> tuple[int, dict[str, int] | None]:
        async with gate:
            answer = await ledger.invoice(invoice.id)
        try:
            return invoice.id, InvoiceDocument.model_validate_json(answer.content).totals_by_price_class()
        except ValidationError:  # an invoice of an older schema: no price classes
            return invoice.id, None

    found = await asyncio.gather(*(one(i) for i in invoices[:DOCUMENTS_READ]))
    return {invoice_id: totals for invoice_id, totals in found if totals is not None}


def _day(raw: str, errors: dict[str, str]) -> date:
    yesterday = (datetime.now(UTC) - timedelta(days=1)).date()
    if not raw:
        return yesterday
    try:
        return date.fromisoformat(raw)
    except ValueError:
        errors["day"] = f"{raw!r} is not a day as YYYY-MM-DD"
        return yesterday


@router.get("/billing")
async def billing_page(
    request: Request, operator: ReadOperator, reads: ReadsDep, period: str = "", tenant: str = "", day: str = ""
) -> Response:
    errors: dict[str, str] = {}
    period, tenant, day = period.strip(), tenant.strip(), day.strip()
    if period and not re.fullmatch(PERIOD_PATTERN, period):
        errors["period"] = f"{period!r} is not a month as YYYY-MM"
        period = ""
    if tenant and not re.fullmatch(TENANT_ID_PATTERN, tenant):
        errors["tenant"] = f"{tenant!r} is not a tenant id"
        tenant = ""
    the_day = _day(day, errors)

    def tenant_ids() -> list[str]:
        with reads() as session:
            return list(session.exec(select(Tenant.id).order_by(col(Tenant.seq)).limit(TENANTS_LISTED)).all())

    tenants = await run_in_threadpool(tenant_ids)
    ledger: LedgerClient | None = getattr(request.app.state, "ledger", None)
    periods: list[PeriodOut] = []
    invoices: list[InvoiceOut] = []
    by_class: dict[int, dict[str, int]] = {}
    report: ReconciliationReport | None = None
    unavailable = None
    if ledger is None:
        unavailable = "Billing is not configured on this control plane (no ledger): there is nothing to show."
    else:
        try:
            periods = sorted(await ledger.periods(), key=lambda p: p.period_id, reverse=True)
            closed = [p.period_id for p in periods if p.closed_ms is not None]
            period = period or (closed[0] if closed else period_of(time.time_ns() // 1_000_000))
            invoices = await ledger.invoices(period_id=period)
            by_class = await _by_class(ledger, invoices)
            if tenant:
                report = await ledger.reconciliation(tenant_id=tenant, day=the_day.isoformat())
        except LedgerUnavailable:
            unavailable = "The billing ledger does not answer; try again later."
        except LedgerRefused as exc:
            unavailable = f"The billing ledger refused: {exc}"
    selected = next((p for p in periods if p.period_id == period), None)
    return web.page(
        request,
        "billing.html",
        periods=[(p, _period_state(p)) for p in periods],
        period=period,
        period_state=_period_state(selected) if selected else "no usage recorded",
        invoices=invoices,
        by_class=by_class,
        documents_read=DOCUMENTS_READ,
        price_classes=PRICE_CLASSES,
        tenants=tenants,
        tenant=tenant,
        day=the_day.isoformat(),
        report=report,
        unavailable=unavailable,
        errors=errors,
        status=422 if errors else 200,
    )
