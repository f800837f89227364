"""Timestamps a caller sends the ledger are bounded (the year 9999): a moment past what the
database's 64-bit columns hold is a 422 naming the field, not a 500 from the database (the
OpenAPI fuzz run sent `effective_from_ms` ≈ 2e31 to the price book)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpucloud.ledger.schemas import MAX_TIMESTAMP_MS, AllocationEventIn, PriceBookVersionIn

pytestmark = pytest.mark.unit

PRICES = [{"gpu_type": "H100", "price_per_hour_micro": 2_000_000}]
EVENT = {"event_id": "e1", "allocation_id": "a1", "tenant_id": "t1", "kind": "start"}


def test_the_bound_fits_a_64_bit_column_and_is_far_off() -> None:
    assert MAX_TIMESTAMP_MS < 2**63 - 1
    assert MAX_TIMESTAMP_MS > 4_102_444_800_000  # 2100-01-01


@pytest.mark.parametrize("moment", [MAX_TIMESTAMP_MS + 1, 2 * 10**31])
def test_a_moment_past_the_bound_is_refused_by_name(moment: int) -> None:
    with pytest.raises(ValidationError, match="effective_from_ms"):
        PriceBookVersionIn(effective_from_ms=moment, prices=PRICES)
    with pytest.raises(ValidationError, match="at_ms"):
        AllocationEventIn(**EVENT, at_ms=moment)


def test_the_last_moment_is_taken() -> None:
    assert PriceBookVersionIn(effective_from_ms=MAX_TIMESTAMP_MS, prices=PRICES).effective_from_ms == MAX_TIMESTAMP_MS
    assert AllocationEventIn(**EVENT, at_ms=MAX_TIMESTAMP_MS).at_ms == MAX_TIMESTAMP_MS
