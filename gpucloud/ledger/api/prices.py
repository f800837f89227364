"""Price book versions: create one, list them all."""

from __future__ import annotations

from fastapi import APIRouter, status

from gpucloud.ledger import pricebook
from gpucloud.ledger.api.deps import LedgerDep
from gpucloud.ledger.schemas import PriceBookVersionIn, PriceBookVersionOut

router = APIRouter(prefix="/v1/price-book/versions", tags=["price book"])


@router.post("", response_model=PriceBookVersionOut, status_code=status.HTTP_201_CREATED)
def create_version(version: PriceBookVersionIn, ledger: LedgerDep) -> PriceBookVersionOut:
    with ledger.database.write() as connection:
        return pricebook.create_version(connection, version, now_ms=ledger.clock_ms())


@router.get("", response_model=list[PriceBookVersionOut])
def list_versions(ledger: LedgerDep) -> list[PriceBookVersionOut]:
    with ledger.database.read() as connection:
        return pricebook.list_versions(connection)
