"""The price book in the ledger database: versions, their prices and discounts.

A version is a complete book in force from ``effective_from_ms`` until the next version;
usage is rated with the version in force at the sample's start. A version prices each GPU
type on demand and, optionally, once per other price class (reserved, preemptible); a class
without a price for a GPU type is charged its on-demand price (``pricing.py``). Versions are immutable, and
a version may not take effect at or before the start of usage already rated: that usage's
amounts are posted, and changing its price would need reversals, not a new book.
"""

from __future__ import annotations

import threading

from sqlalchemy import Connection, func, insert, select

from gpucloud.ledger import problems
from gpucloud.ledger.pricing import ON_DEMAND, PriceBookHistory, PriceBookVersion, percent_to_basis_points
from gpucloud.ledger.schemas import DiscountOut, PriceBookVersionIn, PriceBookVersionOut, PriceIn
from gpucloud.ledger.tables import (
    price_book_class_prices,
    price_book_discounts,
    price_book_prices,
    price_book_versions,
    rating_accumulators,
)

# List defaults for the classes other than on-demand, as a share of the on-demand list price
# (basis points): no contract or market sets them; an operator's price book version replaces them.
LIST_CLASS_SHARE_BP = {"reserved": 7_000, "preemptible": 4_000}


def list_price_book() -> PriceBookVersionIn:
    """The price book a ledger without one starts from, from the epoch on (`gpucloud prepare`
    and `gpucloud up` seed it; an operator adds versions after): the catalogue's list prices
    (`LIST_PRICE_PER_GPU_HOUR_MICRO`) on demand, and list defaults for the other classes,
    reserved at 70 % and preemptible at 40 % of the on-demand price (`LIST_CLASS_SHARE_BP`,
    rounded down to the micro-unit)."""
    from gpucloud.models.catalog import LIST_PRICE_PER_GPU_HOUR_MICRO

    prices = []
    for gpu, price in LIST_PRICE_PER_GPU_HOUR_MICRO.items():
        prices.append(PriceIn(gpu_type=gpu, price_per_hour_micro=price))
        for price_class, share_bp in LIST_CLASS_SHARE_BP.items():
            prices.append(
                PriceIn(gpu_type=gpu, price_class=price_class, price_per_hour_micro=price * share_bp // 10_000)
            )
    return PriceBookVersionIn(effective_from_ms=0, prices=prices, note="list prices")


def create_version(connection: Connection, version: PriceBookVersionIn, *, now_ms: int) -> PriceBookVersionOut:
    """Add a version; call inside the ledger's write transaction."""
    priced = [(price.gpu_type, price.price_class) for price in version.prices]
    if len(set(priced)) != len(priced):
        raise problems.LedgerProblem(
            problems.REQUEST_INVALID("a GPU type is priced twice in one price class", field="prices")
        )
    on_demand = {gpu for gpu, price_class in priced if price_class == ON_DEMAND}
    if unpriced := sorted({gpu for gpu, _ in priced} - on_demand):
        # The on-demand price is what every other class falls back to, and what meters are rated at.
        raise problems.LedgerProblem(
            problems.REQUEST_INVALID(f"{', '.join(unpriced)} has class prices but no on_demand price", field="prices")
        )
    discount_keys = [(d.tenant_id, d.gpu_type) for d in version.discounts]
    if len(set(discount_keys)) != len(discount_keys):
        raise problems.LedgerProblem(
            problems.REQUEST_INVALID("a (tenant, GPU type) has two discounts", field="discounts")
        )
    rated_until = connection.execute(select(func.max(rating_accumulators.c.max_start_ms))).scalar()
    if rated_until is not None and version.effective_from_ms <= rated_until:
        raise problems.LedgerProblem(
            problems.STATE_CONFLICT(
                f"usage starting at {rated_until} is already rated; a new version must take effect after it",
                field="effective_from_ms",
            )
        )
    taken = connection.execute(
        select(price_book_versions.c.id).where(price_book_versions.c.effective_from_ms == version.effective_from_ms)
    ).scalar_one_or_none()
    if taken is not None:
        raise problems.LedgerProblem(
            problems.STATE_CONFLICT(
                f"version {taken} already takes effect at {version.effective_from_ms}", field="effective_from_ms"
            )
        )
    version_id = connection.execute(
        insert(price_book_versions).returning(price_book_versions.c.id),
        {"effective_from_ms": version.effective_from_ms, "note": version.note, "created_ms": now_ms},
    ).scalar_one()
    connection.execute(
        insert(price_book_prices),
        [
            {"version_id": version_id, "gpu_type": price.gpu_type, "price_per_hour_micro": price.price_per_hour_micro}
            for price in version.prices
            if price.price_class == ON_DEMAND
        ],
    )
    class_prices = [price.model_dump() for price in version.prices if price.price_class != ON_DEMAND]
    if class_prices:
        connection.execute(
            insert(price_book_class_prices), [{"version_id": version_id, **price} for price in class_prices]
        )
    if version.discounts:
        connection.execute(
            insert(price_book_discounts),
            [
                {
                    "version_id": version_id,
                    "tenant_id": d.tenant_id,
                    "gpu_type": d.gpu_type,
                    "discount_bp": percent_to_basis_points(d.percent),
                }
                for d in version.discounts
            ],
        )
    return next(v for v in list_versions(connection) if v.id == version_id)


def has_price_book(connection: Connection) -> bool:
    """Whether any version exists (without one, every usage sample is rejected as unpriced)."""
    return connection.execute(select(price_book_versions.c.id).limit(1)).first() is not None


def list_versions(connection: Connection) -> list[PriceBookVersionOut]:
    prices: dict[int, list[PriceIn]] = {}
    for row in connection.execute(select(price_book_prices).order_by(price_book_prices.c.gpu_type)):
        prices.setdefault(row.version_id, []).append(
            PriceIn(gpu_type=row.gpu_type, price_per_hour_micro=row.price_per_hour_micro)
        )
    # Apart from `prices` (on demand), so readers that know only one price per GPU type keep reading it.
    class_prices: dict[int, list[PriceIn]] = {}
    class_rows = connection.execute(
        select(price_book_class_prices).order_by(
            price_book_class_prices.c.gpu_type, price_book_class_prices.c.price_class
        )
    )
    for row in class_rows:
        class_prices.setdefault(row.version_id, []).append(
            PriceIn(gpu_type=row.gpu_type, price_class=row.price_class, price_per_hour_micro=row.price_per_hour_micro)
        )
    discounts: dict[int, list[DiscountOut]] = {}
    for row in connection.execute(
        select(price_book_discounts).order_by(price_book_discounts.c.tenant_id, price_book_discounts.c.gpu_type)
    ):
        discounts.setdefault(row.version_id, []).append(
            DiscountOut(tenant_id=row.tenant_id, gpu_type=row.gpu_type, discount_bp=row.discount_bp)
        )
    return [
        PriceBookVersionOut(
            **row._mapping,
            prices=prices.get(row.id, []),
            class_prices=class_prices.get(row.id, []),
            discounts=discounts.get(row.id, []),
        )
        for row in connection.execute(select(price_book_versions).order_by(price_book_versions.c.effective_from_ms))
    ]


class PriceBookCache:
    """The price book history, reloaded only when a version was added (versions never change)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._history = PriceBookHistory([])
        self._loaded_max_id: int | None = None

    def get(self, connection: Connection) -> PriceBookHistory:
        max_id = connection.execute(select(func.max(price_book_versions.c.id))).scalar()
        with self._lock:
            if max_id != self._loaded_max_id:
                self._history = _load_history(connection)
                self._loaded_max_id = max_id
            return self._history


def _load_history(connection: Connection) -> PriceBookHistory:
    return PriceBookHistory(
        [
            PriceBookVersion(
                version_id=version.id,
                effective_from_ms=version.effective_from_ms,
                prices={p.gpu_type: p.price_per_hour_micro for p in version.prices},
                class_prices={(p.gpu_type, p.price_class): p.price_per_hour_micro for p in version.class_prices},
                discounts_bp={(d.tenant_id, d.gpu_type): d.discount_bp for d in version.discounts},
            )
            for version in list_versions(connection)
        ]
    )
