"""Rating in integer micro-units: exact totals however usage is split, discounts, price book lookup."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpucloud.ledger.periods import next_period, period_bounds, period_of, periods_between
from gpucloud.ledger.pricing import (
    MS_PER_HOUR,
    PriceBookHistory,
    PriceBookVersion,
    Rate,
    percent_to_basis_points,
)

pytestmark = pytest.mark.unit

H100 = 2_490_000  # $2.49 per GPU-hour


def exact_amount(rate: Rate, gpu_ms: int) -> Fraction:
    return Fraction(gpu_ms * rate.price_per_hour_micro * (10_000 - rate.discount_bp), MS_PER_HOUR * 10_000)


def test_one_gpu_hour_costs_the_list_price() -> None:
    assert Rate(H100).amount_for(MS_PER_HOUR) == H100
    assert Rate(H100).amount_for(8 * MS_PER_HOUR) == 8 * H100


def test_discount_is_applied_in_basis_points() -> None:
    assert Rate(H100, discount_bp=1250).amount_for(MS_PER_HOUR) == 2_178_750


def test_amounts_round_down_to_the_micro_unit() -> None:
    # 2.49e6 / 3.6e6 = 0.6916... micro-units per GPU-ms
    assert Rate(H100).amount_for(1) == 0
    assert Rate(H100).amount_for(2) == 1
    assert Rate(H100).amount_for(3) == 2


def test_per_sample_rounding_would_lose_what_cumulative_rating_keeps() -> None:
    rate = Rate(H100)
    one_minute = 60_000
    naive = 60 * rate.amount_for(one_minute)
    assert sum(rate.split(0, [one_minute] * 60)) == rate.amount_for(60 * one_minute) == H100
    assert naive <= H100


@given(
    price=st.integers(min_value=0, max_value=10**10),
    discount_bp=st.integers(min_value=0, max_value=10_000),
    before=st.integers(min_value=0, max_value=10**13),
    parts=st.lists(st.integers(min_value=0, max_value=10**10), max_size=50),
)
def test_split_amounts_add_up_to_the_rated_total(price: int, discount_bp: int, before: int, parts: list[int]) -> None:
    rate = Rate(price, discount_bp)
    amounts = rate.split(before, parts)
    assert all(amount >= 0 for amount in amounts)
    assert sum(amounts) == rate.amount_for(before + sum(parts)) - rate.amount_for(before)
    assert amounts == [rate.step(before + sum(parts[:i]), part) for i, part in enumerate(parts)]


@given(
    price=st.integers(min_value=0, max_value=10**10),
    discount_bp=st.integers(min_value=0, max_value=10_000),
    gpu_ms=st.integers(min_value=0, max_value=10**15),
)
def test_a_total_is_at_most_one_micro_unit_below_exact(price: int, discount_bp: int, gpu_ms: int) -> None:
    rate = Rate(price, discount_bp)
    exact = exact_amount(rate, gpu_ms)
    assert rate.amount_for(gpu_ms) <= exact < rate.amount_for(gpu_ms) + 1


@given(parts=st.lists(st.integers(min_value=1, max_value=10**9), min_size=1, max_size=40), cut=st.integers(min_value=0))
def test_batching_does_not_change_the_total(parts: list[int], cut: int) -> None:
    rate = Rate(H100, discount_bp=333)
    cut = cut % (len(parts) + 1)
    first = rate.split(0, parts[:cut])
    second = rate.split(sum(parts[:cut]), parts[cut:])
    assert sum(first) + sum(second) == sum(rate.split(0, parts)) == rate.amount_for(sum(parts))


def test_invalid_rates_are_refused() -> None:
    with pytest.raises(ValueError):
        Rate(-1)
    with pytest.raises(ValueError):
        Rate(1, discount_bp=10_001)
    with pytest.raises(ValueError):
        Rate(1).amount_for(-1)
    with pytest.raises(ValueError):
        Rate(1).split(0, [5, -1])


@pytest.mark.parametrize(("percent", "basis_points"), [("0", 0), ("12.5", 1250), (Decimal("7.25"), 725), (100, 10_000)])
def test_percent_to_basis_points(percent: object, basis_points: int) -> None:
    assert percent_to_basis_points(percent) == basis_points


@pytest.mark.parametrize("percent", ["12.345", "-1", "100.01"])
def test_percent_out_of_range_or_too_precise_is_refused(percent: str) -> None:
    with pytest.raises(ValueError):
        percent_to_basis_points(percent)


def test_price_book_version_in_force_at_an_instant() -> None:
    january = PriceBookVersion(1, 1_000, {"h100": 100}, {("t1", "h100"): 500})
    february = PriceBookVersion(2, 2_000, {"h100": 200, "b200": 400})
    history = PriceBookHistory([february, january])
    assert history.version_at(999) is None
    assert history.version_at(1_000) is january
    assert history.version_at(1_999) is january
    assert history.version_at(2_000) is february
    assert history.version_span(1_500) == (january, 1_000, 2_000)
    assert history.version_span(5)[0] is None
    assert january.rate_for("t1", "h100") == Rate(100, 500)
    assert january.rate_for("t2", "h100") == Rate(100, 0)
    assert january.rate_for("t1", "b200") is None
    assert history.by_id(2) is february


def test_periods_are_utc_calendar_months() -> None:
    assert period_of(1_704_067_200_000) == "2024-01"  # 2024-01-01T00:00Z
    assert period_of(1_704_067_199_999) == "2023-12"
    assert period_bounds("2024-02") == (1_706_745_600_000, 1_709_251_200_000)  # leap February
    assert next_period("2024-12") == "2025-01"
    assert periods_between("2024-11", "2025-02") == ["2024-11", "2024-12", "2025-01", "2025-02"]
    assert periods_between("2025-02", "2024-11") == []
    with pytest.raises(ValueError):
        period_bounds("2024-13")


def test_the_price_classes_are_one_list_the_ledgers_schemas_and_console_read() -> None:
    from typing import get_args

    from gpucloud.console import billing
    from gpucloud.ledger.pricing import PRICE_CLASSES
    from gpucloud.ledger.schemas import PriceClass

    assert set(get_args(PriceClass)) == set(PRICE_CLASSES)
    assert billing.PRICE_CLASSES is PRICE_CLASSES
