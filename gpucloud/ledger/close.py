"""Closing a billing period: aggregated usage in, one reproducible invoice per tenant out.

Pure: the database hands over rows already aggregated with GROUP BY (see ``invoicing.py``)
and the price book; this module decides the lines, rates them, and writes the invoice as
canonical JSON (sorted keys, no whitespace, integers only, no clock), so closing the same
period again yields the same bytes, and so does closing it in a fresh ledger fed the same
usage in any order or batching.

The bill says what was bought (``gpucloud.invoice/v2``). Lines, one per (allocation or
reservation, GPU type, price class, usage period, price version), each with its ``quantity``
(GPU-ms), unit ``price`` (micro-units per GPU-hour), discount and amount:

- ``allocation``: the time the allocation held (``held.py``) at its price class (on_demand or
  preemptible; a reserved-class allocation's time is covered by its reservation and adds no
  line). It is the sum of the line's postings in the period: the meters' on-demand postings
  plus the close's true-up to held time at the class price, so what the nodes metered does
  not show here (it is in the reconciliation report).
- ``reservation``: a capacity reservation's window within the usage period, x its nodes x
  GPUs per node, at the reserved price, used or not.
- ``reversal``: reversal postings booked into this period (negative amounts).

A line of the period's own usage has amount ``rate.amount_for(quantity)`` (``pricing.py``),
checked here; a line for an earlier usage period (time or a reservation that reached the
ledger after that period closed) is the step it adds to that usage's cumulative amount.
Periods closed as ``gpucloud.invoice/v1`` (meter lines and ``held`` corrections) are
recomputed in that shape when closed again (``build_invoices_v1``), so their bytes hold.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from gpucloud.ledger.periods import period_bounds
from gpucloud.ledger.pricing import PriceBookHistory

INVOICE_SCHEMA = "gpucloud.invoice/v2"
INVOICE_SCHEMA_V1 = "gpucloud.invoice/v1"
_KIND_ORDER_V1 = {"usage": 0, "adjustment": 1, "held": 2, "reversal": 3}
_KIND_ORDER = {"reservation": 0, "allocation": 1, "reversal": 2}


class CloseIntegrityError(Exception):
    """The aggregated usage does not agree with what the ledger posted."""


@dataclass(frozen=True, slots=True)
class LineAggregate:
    """One GROUP BY row: usage or reversals of one invoice line."""

    tenant_id: str
    allocation_id: str
    gpu_type: str
    usage_period: str
    price_version_id: int
    count: int
    gpu_ms: int
    amount_micro: int
    # What a close posts (`held.py`): `held` (a true-up) or `reserved` (a reservation's window),
    # at this price class. Rows aggregated from the meters' samples leave both alone.
    source: str = "meter"
    price_class: str | None = None


@dataclass(frozen=True, slots=True)
class ItemAggregate:
    """One GROUP BY row of a billing period's postings: one invoice line's GPU-ms and amount."""

    tenant_id: str
    kind: str  # `allocation`, `reservation` or `reversal`
    item_id: str  # the allocation's id, or the reservation's
    reservation: bool
    gpu_type: str
    price_class: str
    usage_period: str
    price_version_id: int
    gpu_ms: int
    amount_micro: int


@dataclass(frozen=True, slots=True)
class InvoiceLine:
    """A line of a `gpucloud.invoice/v2`: held time (or a reservation's window) of one price class."""

    kind: str  # `allocation`, `reservation`, or `reversal` (an operator's correction, negative)
    allocation_id: str | None
    reservation_id: str | None
    gpu_type: str
    price_class: str  # on_demand, reserved or preemptible
    usage_period: str
    price_version_id: int
    quantity: int  # GPU-ms
    price: int  # micro-units per GPU-hour, before the discount
    discount_bp: int
    amount_micro: int

    def sort_key(self) -> tuple:
        return (
            _KIND_ORDER[self.kind],
            self.reservation_id or self.allocation_id or "",
            self.gpu_type,
            self.price_class,
            self.usage_period,
            self.price_version_id,
        )


@dataclass(frozen=True, slots=True)
class InvoiceLineV1:
    kind: str  # `usage` (metered), `held` (the true-up to held time), or a credit's kind
    allocation_id: str
    gpu_type: str
    usage_period: str
    price_version_id: int
    price_per_hour_micro: int
    discount_bp: int
    count: int
    gpu_ms: int
    amount_micro: int

    def sort_key(self) -> tuple:
        return (
            self.allocation_id,
            self.gpu_type,
            _KIND_ORDER_V1[self.kind],
            self.usage_period,
            self.price_version_id,
        )


@dataclass(frozen=True, slots=True)
class Invoice:
    period_id: str
    tenant_id: str
    lines: tuple[InvoiceLine | InvoiceLineV1, ...]
    total_micro: int
    body: bytes
    sha256: str


def canonical_json(value: object) -> bytes:
    """One byte string per value: sorted keys, no whitespace, UTF-8, no floats allowed."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def build_invoices(
    period_id: str,
    *,
    items: Iterable[ItemAggregate],
    meter_usage: Iterable[LineAggregate],
    prices: PriceBookHistory,
) -> list[Invoice]:
    """The period's `gpucloud.invoice/v2` invoices, one per tenant with any line, by tenant.

    ``items`` are the period's postings (and a draft's pending true-ups) grouped by line: held
    time of an allocation at its price class, a reservation's window at the reserved price, or
    reversals. A line whose GPU-ms and amount are both zero (a reserved-class allocation, whose
    meters' postings the close credited in full) is left out. ``meter_usage`` (the meters'
    samples by line) is checked against the on-demand rating ingest did, not invoiced."""
    for row in meter_usage:
        _rated_line("usage", row, prices)
    lines_by_tenant: dict[str, list[InvoiceLine]] = defaultdict(list)
    for item in items:
        if item.kind != "reversal" and item.gpu_ms == 0 and item.amount_micro == 0:
            continue
        version = prices.by_id(item.price_version_id)
        rate = version.rate_for(item.tenant_id, item.gpu_type, item.price_class)
        if rate is None:
            raise CloseIntegrityError(f"price version {item.price_version_id} does not price {item.gpu_type}")
        if (
            item.kind != "reversal"
            and item.usage_period == period_id
            and rate.amount_for(item.gpu_ms) != item.amount_micro
        ):
            # Every posting of a line of this period's usage is billed in this period: the line
            # must be the price book's amount for its GPU-ms (earlier usage's lines are steps).
            raise CloseIntegrityError(
                f"{item.tenant_id}/{item.item_id}/{item.gpu_type}/{item.price_class}/{item.usage_period}: posted "
                f"{item.amount_micro} micro-units for {item.gpu_ms} GPU-ms, the price book says "
                f"{rate.amount_for(item.gpu_ms)}"
            )
        lines_by_tenant[item.tenant_id].append(
            InvoiceLine(
                kind=item.kind,
                allocation_id=None if item.reservation else item.item_id,
                reservation_id=item.item_id if item.reservation else None,
                gpu_type=item.gpu_type,
                price_class=item.price_class,
                usage_period=item.usage_period,
                price_version_id=item.price_version_id,
                quantity=item.gpu_ms,
                price=rate.price_per_hour_micro,
                discount_bp=rate.discount_bp,
                amount_micro=item.amount_micro,
            )
        )
    return [
        _invoice(period_id, tenant_id, sorted(lines, key=InvoiceLine.sort_key))
        for tenant_id, lines in sorted(lines_by_tenant.items())
    ]


def build_invoices_v1(
    period_id: str,
    *,
    usage: Iterable[LineAggregate],
    reversals: Iterable[LineAggregate],
    prices: PriceBookHistory,
    held: Iterable[LineAggregate] = (),
) -> list[Invoice]:
    """A period's `gpucloud.invoice/v1` invoices (meter lines, then held true-ups), as periods
    closed before price classes were invoiced; a re-close of such a period recomputes these."""
    lines_by_tenant: dict[str, list[InvoiceLineV1]] = defaultdict(list)
    for row in usage:
        kind = "usage" if row.usage_period == period_id else "adjustment"
        lines_by_tenant[row.tenant_id].append(_rated_line(kind, row, prices))
    for row in held:
        lines_by_tenant[row.tenant_id].append(_line("held", row, prices, row.amount_micro))
    for row in reversals:
        lines_by_tenant[row.tenant_id].append(_line("reversal", row, prices, row.amount_micro))
    return [
        _invoice_v1(period_id, tenant_id, sorted(lines, key=InvoiceLineV1.sort_key))
        for tenant_id, lines in sorted(lines_by_tenant.items())
    ]


def empty_invoice(period_id: str, tenant_id: str) -> Invoice:
    """The invoice of a tenant with no line in the period (a draft shows it; a close stores none)."""
    return _invoice(period_id, tenant_id, [])


def _rated_line(kind: str, row: LineAggregate, prices: PriceBookHistory) -> InvoiceLineV1:
    rate = prices.by_id(row.price_version_id).rate_for(row.tenant_id, row.gpu_type)
    if rate is None:
        raise CloseIntegrityError(f"price version {row.price_version_id} does not price {row.gpu_type}")
    amount = rate.amount_for(row.gpu_ms)
    if amount != row.amount_micro:
        raise CloseIntegrityError(
            f"{row.tenant_id}/{row.allocation_id}/{row.gpu_type}/{row.usage_period}: posted "
            f"{row.amount_micro} micro-units for {row.gpu_ms} GPU-ms, the price book says {amount}"
        )
    return _line(kind, row, prices, amount)


def _line(kind: str, row: LineAggregate, prices: PriceBookHistory, amount: int) -> InvoiceLineV1:
    version = prices.by_id(row.price_version_id)
    return InvoiceLineV1(
        kind=kind,
        allocation_id=row.allocation_id,
        gpu_type=row.gpu_type,
        usage_period=row.usage_period,
        price_version_id=row.price_version_id,
        price_per_hour_micro=version.prices.get(row.gpu_type, 0),
        discount_bp=version.discounts_bp.get((row.tenant_id, row.gpu_type), 0),
        count=row.count,
        gpu_ms=row.gpu_ms,
        amount_micro=amount,
    )


def _invoice(period_id: str, tenant_id: str, lines: list[InvoiceLine]) -> Invoice:
    start_ms, end_ms = period_bounds(period_id)
    total = sum(line.amount_micro for line in lines)
    document = {
        "schema": INVOICE_SCHEMA,
        "period": {"id": period_id, "start_ms": start_ms, "end_ms": end_ms},
        "tenant_id": tenant_id,
        "amount_unit": "micro-currency",
        "quantity_unit": "GPU-ms",
        "price_unit": "micro-currency per GPU-hour",
        "rounding": "floor of each line's cumulative quantity x price x (1 - discount) / 3,600,000",
        "lines": [asdict(line) for line in lines],
        "total_micro": total,
    }
    return _sealed(period_id, tenant_id, lines, total, document)


def _invoice_v1(period_id: str, tenant_id: str, lines: list[InvoiceLineV1]) -> Invoice:
    start_ms, end_ms = period_bounds(period_id)
    total = sum(line.amount_micro for line in lines)
    document = {
        "schema": INVOICE_SCHEMA_V1,
        "period": {"id": period_id, "start_ms": start_ms, "end_ms": end_ms},
        "tenant_id": tenant_id,
        "amount_unit": "micro-currency",
        "rounding": "floor of each line's cumulative GPU-ms x price x (1 - discount), per millisecond",
        "lines": [asdict(line) for line in lines],
        "total_micro": total,
    }
    return _sealed(period_id, tenant_id, lines, total, document)


def _sealed(period_id: str, tenant_id: str, lines: list, total: int, document: dict) -> Invoice:
    body = canonical_json(document)
    return Invoice(
        period_id=period_id,
        tenant_id=tenant_id,
        lines=tuple(lines),
        total_micro=total,
        body=body,
        sha256=hashlib.sha256(body).hexdigest(),
    )
