"""`GET /v1/catalog`: what a tenant may ask for. The GPU types and regions the fleet has nodes of,
how many are available now, GPUs per node, and the price per GPU-hour now.

The fleet comes from the control plane's DB (`services/catalog.py`); prices from the ledger's
price book, the same versions invoices are rated with, asked through the one ledger client the
settings chose. The catalogue still answers without them (billing not configured, or the ledger
down): the prices are null and `prices_note` says why.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool

from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, Reads, ReadsDep
from gpucloud.ledger.client import LedgerClient, LedgerRefused, LedgerUnavailable
from gpucloud.ledger.pricing import PriceBookHistory, PriceBookVersion
from gpucloud.models.api_schemas import Catalog, CatalogEntry
from gpucloud.models.catalog import GPU_TYPES, known_gpu_type
from gpucloud.services import catalog as offers
from gpucloud.web.problems import invalid

router = APIRouter(prefix="/v1", tags=["catalog"])


async def price_book_now(ledger: LedgerClient | None) -> tuple[PriceBookVersion | None, str | None]:
    """The price book version in force now, or None and why there is none."""
    if ledger is None:
        return None, "billing is not configured (no ledger): no prices"
    try:
        versions = await ledger.price_book_versions()
    except LedgerUnavailable:
        return None, "the billing ledger does not answer: prices unknown for now, retry later"
    except LedgerRefused as exc:
        return None, f"the billing ledger refused the price book: {exc}"
    history = PriceBookHistory(
        [
            PriceBookVersion(
                version_id=v.id,
                effective_from_ms=v.effective_from_ms,
                prices={p.gpu_type: p.price_per_hour_micro for p in v.prices},
                discounts_bp={(d.tenant_id, d.gpu_type): d.discount_bp for d in v.discounts},
            )
            for v in versions
        ]
    )
    version = history.version_at(time.time_ns() // 1_000_000)
    return version, None if version is not None else "the price book has no version in force yet"


def _fleet(reads: Reads, gpu_type: str | None, region: str | None) -> list[offers.Offer]:
    with reads() as session:
        return offers.fleet_offers(session, gpu_type=gpu_type, region=region)


def _entry(offer: offers.Offer, book: PriceBookVersion | None, caller: Caller) -> CatalogEntry:
    rate = book.rate_for(caller.tenant_id or "", offer.gpu_type) if book is not None else None
    return CatalogEntry(
        gpu_type=offer.gpu_type,
        region=offer.region,
        nodes=offer.nodes,
        available_nodes=offer.available_nodes,
        gpus_per_node=offer.gpus_per_node,
        price_per_gpu_hour_micro=rate.price_per_hour_micro if rate else None,
        discount_bp=rate.discount_bp if rate and caller.is_tenant else 0,
    )


@router.get("/catalog", response_model=Catalog)
async def get_catalog(
    request: Request,
    caller: CallerDep,
    reads: ReadsDep,
    gpu_type: str | None = Query(None, description="only this GPU type (any case: `h100` is `H100`)"),
    region: str | None = Query(None, max_length=63, description="only this region"),
):
    """The GPU types and regions on offer, nodes available now, GPUs per node and the price per
    GPU-hour (for a tenant: with its discount, `discount_bp`)."""
    if gpu_type is not None and (gpu_type := known_gpu_type(gpu_type)) is None:
        raise invalid("gpu_type", f"unknown GPU type; known: {', '.join(sorted(GPU_TYPES))}")
    fleet = await run_in_threadpool(_fleet, reads, gpu_type, region)
    book, note = await price_book_now(getattr(request.app.state, "ledger", None))
    items = [_entry(offer, book, caller) for offer in fleet]
    if book is not None and any(item.price_per_gpu_hour_micro is None for item in items):
        note = "the price book prices not every GPU type on offer (null: not priced)"
    return Catalog(
        items=items,
        gpu_types=sorted({o.gpu_type for o in fleet}),
        regions=sorted({o.region for o in fleet}),
        price_book_version=book.version_id if book is not None else None,
        prices_note=note,
    )
