"""Closing a billing period: aggregated usage in, one reproducible invoice per tenant out.

Pure: the database hands over rows already aggregated with GROUP BY (see ``invoicing.py``)
and the price book; this module decides the lines, rates them, and writes the invoice as
canonical JSON (sorted keys, no whitespace, integers only, no clock), so closing the same
period again yields the same bytes, and so does closing it in a fresh ledger fed the same
usage in any order or batching.

Lines, one per (allocation, GPU type, usage period, price version, kind):

- ``usage``: usage that started in the period being closed.
- ``adjustment``: usage that started in an earlier period but reached the ledger after that
  period closed; it lands on the first invoice still open.
- ``held``: the true-up to held time (``held.py``): what the allocation's events say it held,
  less what its nodes metered, for this period's usage and any earlier period's it changed;
  either sign.
- ``reversal``: reversal postings booked into this period (negative amounts).

A usage or adjustment line's amount is recomputed here from its GPU-ms with the rounding rule
of ``pricing.py``; it must equal the sum the ledger posted sample by sample (the steps
telescope to the same total), otherwise the close refuses to produce an invoice.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from gpucloud.ledger.periods import period_bounds
from gpucloud.ledger.pricing import PriceBookHistory

INVOICE_SCHEMA = "gpucloud.invoice/v1"
_KIND_ORDER = {"usage": 0, "adjustment": 1, "held": 2, "reversal": 3}


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


@dataclass(frozen=True, slots=True)
class InvoiceLine:
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
            _KIND_ORDER[self.kind],
            self.usage_period,
            self.price_version_id,
        )


@dataclass(frozen=True, slots=True)
class Invoice:
    period_id: str
    tenant_id: str
    lines: tuple[InvoiceLine, ...]
    total_micro: int
    body: bytes
    sha256: str


def canonical_json(value: object) -> bytes:
    """One byte string per value: sorted keys, no whitespace, UTF-8, no floats allowed."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def build_invoices(
    period_id: str,
    *,
    usage: Iterable[LineAggregate],
    reversals: Iterable[LineAggregate],
    prices: PriceBookHistory,
    held: Iterable[LineAggregate] = (),
) -> list[Invoice]:
    """The period's invoices, one per tenant with any line, sorted by tenant."""
    lines_by_tenant: dict[str, list[InvoiceLine]] = defaultdict(list)
    for row in usage:
        kind = "usage" if row.usage_period == period_id else "adjustment"
        lines_by_tenant[row.tenant_id].append(_rated_line(kind, row, prices))
    for row in held:
        lines_by_tenant[row.tenant_id].append(_line("held", row, prices, row.amount_micro))
    for row in reversals:
        lines_by_tenant[row.tenant_id].append(_line("reversal", row, prices, row.amount_micro))
    return [
        _invoice(period_id, tenant_id, sorted(lines, key=InvoiceLine.sort_key))
        for tenant_id, lines in sorted(lines_by_tenant.items())
    ]


def empty_invoice(period_id: str, tenant_id: str) -> Invoice:
    """The invoice of a tenant with no line in the period (a draft shows it; a close stores none)."""
    return _invoice(period_id, tenant_id, [])


def _rated_line(kind: str, row: LineAggregate, prices: PriceBookHistory) -> InvoiceLine:
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


def _line(kind: str, row: LineAggregate, prices: PriceBookHistory, amount: int) -> InvoiceLine:
    version = prices.by_id(row.price_version_id)
    return InvoiceLine(
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
        "rounding": "floor of each line's cumulative GPU-ms x price x (1 - discount), per millisecond",
        "lines": [asdict(line) for line in lines],
        "total_micro": total,
    }
    body = canonical_json(document)
    return Invoice(
        period_id=period_id,
        tenant_id=tenant_id,
        lines=tuple(lines),
        total_micro=total,
        body=body,
        sha256=hashlib.sha256(body).hexdigest(),
    )
