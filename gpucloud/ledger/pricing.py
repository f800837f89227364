"""Pure rating: turn GPU-milliseconds into integer micro-units of currency.

Prices are quoted per GPU per hour in micro-units and billed per millisecond, so one
millisecond costs ``price / 3,600,000`` micro-units, almost never a whole number. The rule
that keeps every micro-unit:

    amount(total_gpu_ms) = floor(total_gpu_ms * price * (10,000 - discount_bp)
                                 / (3,600,000 * 10,000))

is applied to the *cumulative* total of one rating key (one invoice line), never to a sample
on its own. A sample's amount is the step it adds to that cumulative amount,
``amount(before + gpu_ms) - amount(before)``. The steps telescope: however the usage is split
into samples and batches, the amounts add up to the floor of the exact total, so the invoice
line is at most one micro-unit below the exact value and never drifts by one per split.

Prices come in price classes: ``on_demand`` (the default), ``reserved`` (a capacity
reservation's window) and ``preemptible``. A version may price each GPU type once per class;
a class with no price for a GPU type in the version in force is charged that GPU type's
on-demand price (``rate_for`` falls back). Meters' usage is rated on-demand while a period is
open; the close bills held time at the allocation's class (``held.py``).

Committed-use discounts are percentages per tenant and GPU type, kept as integer basis points
(1 bp = 0.01 %) so the whole computation stays in integers.

No I/O here: the ledger's ingest and the period close both call these functions.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from itertools import accumulate, repeat
from operator import floordiv, mul, sub

MS_PER_HOUR = 3_600_000
BASIS_POINTS = 10_000
_DENOMINATOR = MS_PER_HOUR * BASIS_POINTS
_FOREVER = 2**63

ON_DEMAND = "on_demand"
RESERVED = "reserved"
PREEMPTIBLE = "preemptible"
PRICE_CLASSES = (ON_DEMAND, RESERVED, PREEMPTIBLE)


def percent_to_basis_points(percent: Decimal | str | int) -> int:
    """``12.5`` -> ``1250``; more than two decimals or outside [0, 100] is refused."""
    value = Decimal(str(percent))
    basis_points = value * 100
    if basis_points != basis_points.to_integral_value():
        raise ValueError(f"discount {percent}% has more than two decimals")
    if not 0 <= basis_points <= BASIS_POINTS:
        raise ValueError(f"discount {percent}% is outside [0, 100]")
    return int(basis_points)


@dataclass(frozen=True, slots=True)
class Rate:
    """What one GPU-hour costs one tenant: list price and committed-use discount."""

    price_per_hour_micro: int
    discount_bp: int = 0

    def __post_init__(self) -> None:
        if self.price_per_hour_micro < 0:
            raise ValueError("price_per_hour_micro must be >= 0")
        if not 0 <= self.discount_bp <= BASIS_POINTS:
            raise ValueError("discount_bp must be within [0, 10000]")

    def amount_for(self, total_gpu_ms: int) -> int:
        """The amount owed for a cumulative total, rounded down to the micro-unit."""
        if total_gpu_ms < 0:
            raise ValueError("total_gpu_ms must be >= 0")
        return total_gpu_ms * self.price_per_hour_micro * (BASIS_POINTS - self.discount_bp) // _DENOMINATOR

    def step(self, total_before_ms: int, gpu_ms: int) -> int:
        """What ``gpu_ms`` more usage adds on top of ``total_before_ms`` already rated."""
        return self.amount_for(total_before_ms + gpu_ms) - self.amount_for(total_before_ms)

    def split(self, total_before_ms: int, parts_gpu_ms: Sequence[int]) -> list[int]:
        """Amounts for consecutive parts rated on top of ``total_before_ms``: the steps
        ``amount_for`` takes as the running total grows, so they add up to its total."""
        if parts_gpu_ms and min(parts_gpu_ms) < 0:
            raise ValueError("gpu_ms must be >= 0")
        factor = self.price_per_hour_micro * (BASIS_POINTS - self.discount_bp)
        # Whole-list map/accumulate run in C: ingest rates 8,000 samples per batch with this.
        running_totals = accumulate(parts_gpu_ms, initial=total_before_ms)
        amounts_so_far = list(map(floordiv, map(mul, running_totals, repeat(factor)), repeat(_DENOMINATOR)))
        return list(map(sub, amounts_so_far[1:], amounts_so_far[:-1]))


@dataclass(frozen=True, slots=True)
class PriceBookVersion:
    """One complete price book, in force from ``effective_from_ms`` until the next one."""

    version_id: int
    effective_from_ms: int
    prices: Mapping[str, int]
    """GPU type -> on-demand price per GPU-hour in micro-units."""
    discounts_bp: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(tenant_id, GPU type) -> committed-use discount in basis points (every class)."""
    class_prices: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(GPU type, price class) -> price per GPU-hour, for the classes other than on_demand."""

    def price_for(self, gpu_type: str, price_class: str = ON_DEMAND) -> int | None:
        """The class's price per GPU-hour; the on-demand price where the class has none."""
        if price_class != ON_DEMAND:
            price = self.class_prices.get((gpu_type, price_class))
            if price is not None:
                return price
        return self.prices.get(gpu_type)

    def rate_for(self, tenant_id: str, gpu_type: str, price_class: str = ON_DEMAND) -> Rate | None:
        """The tenant's rate for a GPU type in a price class (falling back to on-demand), or None
        when this book does not price the GPU type at all."""
        price = self.price_for(gpu_type, price_class)
        if price is None:
            return None
        return Rate(price, self.discounts_bp.get((tenant_id, gpu_type), 0))


class PriceBookHistory:
    """All price book versions; finds the one in force at an instant."""

    def __init__(self, versions: Sequence[PriceBookVersion]) -> None:
        self._versions = sorted(versions, key=lambda v: v.effective_from_ms)
        self._starts = [v.effective_from_ms for v in self._versions]
        self._by_id = {v.version_id: v for v in self._versions}

    def version_at(self, instant_ms: int) -> PriceBookVersion | None:
        """The version in force at ``instant_ms`` (a sample is rated at its start)."""
        index = bisect.bisect_right(self._starts, instant_ms) - 1
        return self._versions[index] if index >= 0 else None

    def version_span(self, instant_ms: int) -> tuple[PriceBookVersion | None, int, int]:
        """The version in force at ``instant_ms`` and the [from, until) it stays in force."""
        index = bisect.bisect_right(self._starts, instant_ms) - 1
        until = self._starts[index + 1] if index + 1 < len(self._starts) else _FOREVER
        if index < 0:
            return None, -_FOREVER, until
        return self._versions[index], self._starts[index], until

    def by_id(self, version_id: int) -> PriceBookVersion:
        return self._by_id[version_id]

    def __len__(self) -> int:
        return len(self._versions)
