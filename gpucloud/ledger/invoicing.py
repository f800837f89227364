"""Closing a period in the database: freeze it, aggregate it in SQL, store its invoices.

1. Under the ledger's writer lock, true every line of this period and the ones before it up
   to held time (``held.py``: the allocations' events, not the nodes' meters, decide what is
   billed) and record the period as closed, in one transaction. From that commit on, ingest
   and reversals book into later periods only, so the set of rows billed to this period is
   frozen (this is why the close needs no isolation level beyond read committed).
   Capacity reservations' windows (``reservations.py``) are posted in the same transaction.
2. Outside the lock (ingest keeps flowing), aggregate the period's postings by invoice line
   (allocation or reservation, GPU type, price class, usage period, price version) and its
   samples with one GROUP BY each, then build the invoices with the pure
   ``close.build_invoices``: held time by price class; the meters' samples only checked.
3. Cross-check each tenant's invoice total against its postings, and each line against the
   running totals ingest kept; store the invoices.

Closing a closed period again recomputes everything and compares it byte for byte with the
stored invoices, so a retried close (the billing-close workflow retries activities) is
idempotent, and doubles as a reproducibility check.

The read side: the periods the ledger knows (what the scheduled close has to catch up on),
stored invoices by tenant or id, and a draft of an open period's invoice (what closing it now
would produce, computed the same way, stored nowhere).
"""

from __future__ import annotations

import json
from collections import defaultdict

from sqlalchemy import Connection, func, insert, select

from gpucloud.ledger import problems
from gpucloud.ledger.close import (
    INVOICE_SCHEMA_V1,
    CloseIntegrityError,
    Invoice,
    ItemAggregate,
    LineAggregate,
    build_invoices,
    build_invoices_v1,
    empty_invoice,
)
from gpucloud.ledger.db import LedgerDatabase
from gpucloud.ledger.held import true_up
from gpucloud.ledger.periods import parse_period, period_bounds, period_of, periods_between
from gpucloud.ledger.postings import insert_held
from gpucloud.ledger.pricebook import PriceBookCache
from gpucloud.ledger.pricing import ON_DEMAND, RESERVED
from gpucloud.ledger.reservations import reservation_true_up
from gpucloud.ledger.schemas import PeriodCloseOut, PeriodOut
from gpucloud.ledger.tables import billing_periods, invoices, postings, rating_accumulators, usage_samples
from gpucloud.models.billing_messages import InvoiceOut, InvoiceSummary

_LINE_COLUMNS = ("tenant_id", "allocation_id", "gpu_type", "usage_period", "price_version_id")


def close_period(
    database: LedgerDatabase, period_id: str, *, now_ms: int, prices: PriceBookCache | None = None
) -> PeriodCloseOut:
    """Close a period (idempotent) and return its invoices."""
    _check_period_id(period_id)
    start_ms, end_ms = period_bounds(period_id)
    if now_ms < end_ms:
        raise problems.LedgerProblem(
            problems.STATE_CONFLICT(f"period {period_id} ends at {end_ms}; it cannot close before it ends")
        )
    prices = prices or PriceBookCache()
    with database.write() as connection:
        closed_ms = connection.execute(
            select(billing_periods.c.closed_ms).where(billing_periods.c.period_id == period_id)
        ).scalar_one_or_none()
        if closed_ms is None:
            closed_ms = now_ms
            history = prices.get(connection)
            for line in true_up(connection, period_id, horizon_ms=end_ms, history=history):
                insert_held(connection, period_id, line, now_ms)
            for line in reservation_true_up(connection, period_id, history=history):
                insert_held(connection, period_id, line, now_ms)
            connection.execute(
                insert(billing_periods),
                {"period_id": period_id, "start_ms": start_ms, "end_ms": end_ms, "closed_ms": closed_ms},
            )
    with database.read() as connection:
        computed = _compute_invoices(connection, period_id, prices)
    with database.write() as connection:
        _store(connection, period_id, computed, now_ms)
    return PeriodCloseOut(
        period_id=period_id,
        start_ms=start_ms,
        end_ms=end_ms,
        closed_ms=closed_ms,
        invoices=[_summary(invoice) for invoice in computed],
    )


def _check_period_id(period_id: str) -> None:
    try:
        parse_period(period_id)
    except ValueError as error:
        raise problems.LedgerProblem(problems.REQUEST_INVALID(str(error), field="period_id")) from None


def _summary(invoice: Invoice) -> InvoiceSummary:
    return InvoiceSummary(
        tenant_id=invoice.tenant_id,
        total_micro=invoice.total_micro,
        line_count=len(invoice.lines),
        sha256=invoice.sha256,
    )


def _compute_invoices(connection: Connection, period_id: str, prices: PriceBookCache) -> list[Invoice]:
    stored = connection.execute(select(invoices.c.body).where(invoices.c.period_id == period_id).limit(1)).scalar()
    if stored is not None and json.loads(bytes(stored))["schema"] == INVOICE_SCHEMA_V1:
        # Closed before price classes were invoiced: recomputed in its own shape, byte for byte.
        computed, usage = _invoices_v1(connection, period_id, prices)
    else:
        computed, usage = _invoices(connection, period_id, prices)
    _cross_check(connection, period_id, computed, usage)
    return computed


def _invoices(
    connection: Connection,
    period_id: str,
    prices: PriceBookCache,
    tenant_id: str | None = None,
    *,
    pending: list[LineAggregate] | None = None,
) -> tuple[list[Invoice], list[LineAggregate]]:
    """The period's invoices (every tenant's, or one's) from the postings billed to it (plus
    ``pending``, the true-ups a draft shows but nothing posted); and the meters' usage, which
    the invoice does not show but the close checks."""
    usage_where = [usage_samples.c.billing_period == period_id]
    posting_where = [postings.c.billing_period == period_id]
    if tenant_id is not None:
        usage_where.append(usage_samples.c.tenant_id == tenant_id)
        posting_where.append(postings.c.tenant_id == tenant_id)
    usage = _aggregate(connection, usage_samples, func.count(), *usage_where)
    pending = pending or []
    classes = _allocation_classes(connection, period_id, tenant_id)
    classes.update(
        {line.allocation_id: line.price_class for line in pending if line.source == "held" and line.price_class}
    )
    items: dict[tuple[str, str, str, bool, str, str, str, int], list[int]] = defaultdict(lambda: [0, 0])
    keys = [postings.c[name] for name in _LINE_COLUMNS]
    rows = connection.execute(
        select(
            *keys,
            postings.c.kind,
            postings.c.source,
            postings.c.price_class,
            func.sum(postings.c.gpu_ms),
            func.sum(postings.c.amount_micro),
        )
        .where(*posting_where)
        .group_by(*keys, postings.c.kind, postings.c.source, postings.c.price_class)
    )
    entries = [(tuple(row[:5]), row[5], row[6], row[7], int(row[8]), int(row[9])) for row in rows]
    entries += [
        (
            (line.tenant_id, line.allocation_id, line.gpu_type, line.usage_period, line.price_version_id),
            "usage",
            line.source,
            line.price_class,
            line.gpu_ms,
            line.amount_micro,
        )
        for line in pending
    ]
    for key, kind, source, price_class, gpu_ms, amount in entries:
        tenant, item_id, gpu_type, usage_period, version_id = key
        reservation = source == "reserved"
        if kind == "reversal":
            item_kind, item_class = "reversal", price_class or ON_DEMAND
        elif reservation:
            item_kind, item_class = "reservation", RESERVED
        else:
            item_kind, item_class = "allocation", classes.get(item_id, ON_DEMAND)
        totals = items[(tenant, item_kind, item_id, reservation, gpu_type, item_class, usage_period, version_id)]
        totals[0] += gpu_ms
        totals[1] += amount
    aggregates = [ItemAggregate(*key, gpu_ms, amount) for key, (gpu_ms, amount) in sorted(items.items())]
    try:
        history = prices.get(connection)
        return build_invoices(period_id, items=aggregates, meter_usage=usage, prices=history), usage
    except CloseIntegrityError as error:
        raise problems.LedgerProblem(problems.INTEGRITY_FAILURE(str(error))) from error


def _allocation_classes(connection: Connection, period_id: str, tenant_id: str | None) -> dict[str, str]:
    """The price class each allocation's lines are billed at, as its latest true-up up to this
    period recorded it (append-only rows, so a re-close reads the same); none: on_demand."""
    query = (
        select(postings.c.allocation_id, postings.c.price_class)
        .where(
            postings.c.source == "held",
            postings.c.kind == "usage",
            postings.c.price_class.is_not(None),
            postings.c.billing_period <= period_id,
        )
        .order_by(postings.c.id)
    )
    if tenant_id is not None:
        query = query.where(postings.c.tenant_id == tenant_id)
    return dict(connection.execute(query).all())


def _invoices_v1(
    connection: Connection,
    period_id: str,
    prices: PriceBookCache,
    tenant_id: str | None = None,
    *,
    pending_held: list[LineAggregate] | None = None,
) -> tuple[list[Invoice], list[LineAggregate]]:
    """The period's invoices (every tenant's, or one's) from its usage, held-time true-ups and
    reversals (plus ``pending_held``, true-ups a draft shows but nothing posted); and the usage."""
    usage_where = [usage_samples.c.billing_period == period_id]
    reversal_where = [postings.c.billing_period == period_id, postings.c.kind == "reversal"]
    held_where = [postings.c.billing_period == period_id, postings.c.kind == "usage", postings.c.source == "held"]
    if tenant_id is not None:
        usage_where.append(usage_samples.c.tenant_id == tenant_id)
        reversal_where.append(postings.c.tenant_id == tenant_id)
        held_where.append(postings.c.tenant_id == tenant_id)
    usage = _aggregate(connection, usage_samples, func.count(), *usage_where)
    reversals = _aggregate(connection, postings, func.sum(postings.c.sample_count), *reversal_where)
    held = _aggregate(connection, postings, func.count(), *held_where) + (pending_held or [])
    try:
        history = prices.get(connection)
        return build_invoices_v1(period_id, usage=usage, reversals=reversals, held=held, prices=history), usage
    except CloseIntegrityError as error:
        raise problems.LedgerProblem(problems.INTEGRITY_FAILURE(str(error))) from error


def _aggregate(connection: Connection, table, count, *conditions) -> list[LineAggregate]:
    keys = [table.c[name] for name in _LINE_COLUMNS]
    query = (
        select(*keys, count, func.sum(table.c.gpu_ms), func.sum(table.c.amount_micro))
        .where(*conditions)
        .group_by(*keys)
        .order_by(*keys)
    )
    return [
        LineAggregate(
            tenant_id=row[0],
            allocation_id=row[1],
            gpu_type=row[2],
            usage_period=row[3],
            price_version_id=row[4],
            count=int(row[5]),
            gpu_ms=int(row[6]),
            amount_micro=int(row[7]),
        )
        for row in connection.execute(query)
    ]


def _cross_check(connection: Connection, period_id: str, computed: list[Invoice], usage: list[LineAggregate]) -> None:
    posted = dict(
        connection.execute(
            select(postings.c.tenant_id, func.sum(postings.c.amount_micro))
            .where(postings.c.billing_period == period_id)
            .group_by(postings.c.tenant_id)
        ).all()
    )
    invoiced = {invoice.tenant_id: invoice.total_micro for invoice in computed}
    if {tenant: int(total) for tenant, total in posted.items()} != invoiced:
        raise problems.LedgerProblem(
            problems.INTEGRITY_FAILURE(f"period {period_id}: invoice totals {invoiced} differ from postings {posted}")
        )
    running = {
        tuple(row[:5]): (row.gpu_ms_total, row.amount_total_micro)
        for row in connection.execute(
            select(
                *(rating_accumulators.c[name] for name in _LINE_COLUMNS),
                rating_accumulators.c.gpu_ms_total,
                rating_accumulators.c.amount_total_micro,
            ).where(rating_accumulators.c.billing_period == period_id)
        )
    }
    aggregated = {
        (row.tenant_id, row.allocation_id, row.gpu_type, row.usage_period, row.price_version_id): (
            row.gpu_ms,
            row.amount_micro,
        )
        for row in usage
    }
    if running != aggregated:
        raise problems.LedgerProblem(
            problems.INTEGRITY_FAILURE(f"period {period_id}: usage samples disagree with the running totals")
        )


def _store(connection: Connection, period_id: str, computed: list[Invoice], now_ms: int) -> None:
    stored = dict(
        connection.execute(select(invoices.c.tenant_id, invoices.c.body).where(invoices.c.period_id == period_id)).all()
    )
    for invoice in computed:
        if invoice.tenant_id not in stored:
            connection.execute(
                insert(invoices),
                {
                    "period_id": period_id,
                    "tenant_id": invoice.tenant_id,
                    "total_micro": invoice.total_micro,
                    "line_count": len(invoice.lines),
                    "sha256": invoice.sha256,
                    "body": invoice.body,
                    "created_ms": now_ms,
                },
            )
        elif bytes(stored[invoice.tenant_id]) != invoice.body:
            raise problems.LedgerProblem(
                problems.INTEGRITY_FAILURE(
                    f"invoice {period_id}/{invoice.tenant_id} recomputed differs from the stored one"
                )
            )
    if set(stored) - {invoice.tenant_id for invoice in computed}:
        raise problems.LedgerProblem(
            problems.INTEGRITY_FAILURE(f"period {period_id} has stored invoices the recomputation lacks")
        )


def list_invoices(connection: Connection, period_id: str) -> list[InvoiceSummary]:
    rows = connection.execute(
        select(invoices.c.tenant_id, invoices.c.total_micro, invoices.c.line_count, invoices.c.sha256)
        .where(invoices.c.period_id == period_id)
        .order_by(invoices.c.tenant_id)
    )
    return [InvoiceSummary(tenant_id=t, total_micro=total, line_count=n, sha256=digest) for t, total, n, digest in rows]


def invoice_body(connection: Connection, period_id: str, tenant_id: str) -> bytes | None:
    body = connection.execute(
        select(invoices.c.body).where(invoices.c.period_id == period_id, invoices.c.tenant_id == tenant_id)
    ).scalar_one_or_none()
    return None if body is None else bytes(body)


def list_periods(connection: Connection, *, now_ms: int) -> list[PeriodOut]:
    """Every period from the first that holds postings (or was closed) through the current one."""
    first_posted = connection.execute(select(func.min(postings.c.billing_period))).scalar()
    closed = dict(connection.execute(select(billing_periods.c.period_id, billing_periods.c.closed_ms)).all())
    known = [period for period in (first_posted, min(closed, default=None)) if period is not None]
    if not known:
        return []
    result = []
    for period_id in periods_between(min(known), max([period_of(now_ms), *closed])):
        start_ms, end_ms = period_bounds(period_id)
        result.append(
            PeriodOut(
                period_id=period_id,
                start_ms=start_ms,
                end_ms=end_ms,
                ended=end_ms <= now_ms,
                closed_ms=closed.get(period_id),
            )
        )
    return result


_INVOICE_COLUMNS = (
    invoices.c.id,
    invoices.c.period_id,
    invoices.c.tenant_id,
    invoices.c.total_micro,
    invoices.c.line_count,
    invoices.c.sha256,
    invoices.c.created_ms,
)


def find_invoices(connection: Connection, *, tenant_id: str | None, period_id: str | None) -> list[InvoiceOut]:
    query = select(*_INVOICE_COLUMNS).order_by(invoices.c.period_id, invoices.c.tenant_id)
    if tenant_id is not None:
        query = query.where(invoices.c.tenant_id == tenant_id)
    if period_id is not None:
        query = query.where(invoices.c.period_id == period_id)
    return [InvoiceOut(**row) for row in connection.execute(query).mappings()]


def invoice_by_id(connection: Connection, invoice_id: int, *, tenant_id: str | None) -> tuple[InvoiceOut, bytes] | None:
    """A stored invoice and its exact bytes; None when absent or (given a tenant) another tenant's."""
    query = select(*_INVOICE_COLUMNS, invoices.c.body).where(invoices.c.id == invoice_id)
    if tenant_id is not None:
        query = query.where(invoices.c.tenant_id == tenant_id)
    row = connection.execute(query).mappings().first()
    if row is None:
        return None
    return InvoiceOut(**{key: value for key, value in row.items() if key != "body"}), bytes(row["body"])


def draft_invoice(
    connection: Connection, period_id: str, tenant_id: str, prices: PriceBookCache, *, now_ms: int
) -> Invoice:
    """What closing the open period now would bill the tenant (also when that is nothing): its
    usage so far, trued up to the time its allocations held up to now."""
    _check_period_id(period_id)
    if (
        connection.execute(select(billing_periods.c.period_id).where(billing_periods.c.period_id == period_id)).first()
        is not None
    ):
        raise problems.LedgerProblem(
            problems.STATE_CONFLICT(f"period {period_id} is closed: its invoice is final", field="period_id")
        )
    horizon_ms = min(now_ms, period_bounds(period_id)[1])
    history = prices.get(connection)
    pending = true_up(connection, period_id, horizon_ms=horizon_ms, history=history, tenant_id=tenant_id)
    pending += reservation_true_up(connection, period_id, history=history, tenant_id=tenant_id)
    drafts, _ = _invoices(connection, period_id, prices, tenant_id, pending=pending)
    return drafts[0] if drafts else empty_invoice(period_id, tenant_id)
