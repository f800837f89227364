"""Spare capacity: the Poisson count of nodes out for repair, and the failure rate's upper bound."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from gpucloud.health.spares import (
    LLAMA3_405B_FAILURES_PER_NODE_HOUR,
    estimate_failure_rate,
    plan_spares,
    poisson_cdf,
    poisson_mean_upper_bound,
    poisson_quantile,
    spares_needed,
)
from gpucloud.sim.faults import INTERRUPTIONS_PER_NODE_DAY

pytestmark = pytest.mark.unit


def test_poisson_cdf_against_known_values() -> None:
    assert poisson_cdf(5, 2.0) == pytest.approx(0.9834363915, abs=1e-9)
    assert poisson_cdf(0, 2.0) == pytest.approx(math.exp(-2))
    assert poisson_cdf(10, 10.0) == pytest.approx(0.5830397502, abs=1e-9)
    assert poisson_cdf(-1, 2.0) == 0.0
    assert poisson_cdf(0, 0.0) == 1.0


def test_poisson_cdf_holds_for_a_large_mean() -> None:
    # Summed naively, e^-5000 underflows to zero and 5000^k overflows.
    assert poisson_cdf(5_000, 5_000.0) == pytest.approx(0.5 + 0.0056, abs=2e-3)


def test_poisson_quantile_against_known_values() -> None:
    assert poisson_quantile(0.98, 2.0) == 5  # P(N ≤ 4) = 0.947, P(N ≤ 5) = 0.983
    assert poisson_quantile(0.99, 2.0) == 6
    assert poisson_quantile(0.5, 10.0) == 10
    assert poisson_quantile(0.999999, 0.001) == 1


def test_zero_rate_needs_no_spares() -> None:
    assert spares_needed(nodes=1_000, failures_per_node_hour=0.0, repair_hours=72, probability=0.99) == 0
    assert spares_needed(nodes=0, failures_per_node_hour=1e-3, repair_hours=72, probability=0.99) == 0


def test_spares_grow_with_probability_and_pool_size() -> None:
    rate = LLAMA3_405B_FAILURES_PER_NODE_HOUR
    by_probability = [
        spares_needed(nodes=1_000, failures_per_node_hour=rate, repair_hours=72, probability=p)
        for p in (0.5, 0.9, 0.99, 0.999, 0.9999)
    ]
    assert by_probability == sorted(by_probability) and by_probability[0] < by_probability[-1]
    by_size = [
        spares_needed(nodes=n, failures_per_node_hour=rate, repair_hours=72, probability=0.99)
        for n in (10, 100, 1_000, 10_000)
    ]
    assert by_size == sorted(by_size) and by_size[0] < by_size[-1]


def test_the_default_rate_is_the_llama3_runs() -> None:
    assert pytest.approx(INTERRUPTIONS_PER_NODE_DAY / 24) == LLAMA3_405B_FAILURES_PER_NODE_HOUR
    assert pytest.approx(419 / (2_048 * 54 * 24)) == LLAMA3_405B_FAILURES_PER_NODE_HOUR


def test_the_worked_example() -> None:
    plan = plan_spares(pool="h100/us-east", nodes=1_000, spares_held=10, repair_hours=72)
    assert plan.expected_out == pytest.approx(11.37, abs=0.01)
    assert plan.spares_needed == 20
    assert plan.shortfall == 10
    assert poisson_cdf(19, plan.expected_out) < 0.99 <= poisson_cdf(20, plan.expected_out)
    assert plan.coverage_held == pytest.approx(poisson_cdf(10, plan.expected_out))
    assert plan.spare_on_failure == pytest.approx(poisson_cdf(9, plan.expected_out))
    assert plan_spares(pool="p", nodes=1_000, spares_held=30, repair_hours=24).spares_needed == 9


def test_a_pool_holding_enough_has_no_shortfall() -> None:
    plan = plan_spares(pool="p", nodes=1_000, spares_held=25, repair_hours=72)
    assert plan.shortfall == 0 and plan.coverage_held >= 0.99


@pytest.mark.parametrize(
    ("failures", "upper"),
    # One-sided 95 % Poisson upper limits (Garwood; χ²(0.95; 2n + 2) / 2).
    [(0, 2.9957), (1, 4.7439), (2, 6.2958), (5, 10.5130), (10, 16.9622)],
)
def test_the_upper_bound_against_tabulated_values(failures: int, upper: float) -> None:
    assert poisson_mean_upper_bound(failures, confidence=0.95) == pytest.approx(upper, abs=1e-3)


def test_the_upper_bound_is_above_the_estimate_and_shrinks_with_exposure() -> None:
    estimates = [estimate_failure_rate(failures=10 * k, node_hours=10_000.0 * k) for k in (1, 10, 100)]
    for estimate in estimates:
        assert estimate.per_node_hour == pytest.approx(1e-3)
        assert estimate.upper_per_node_hour > estimate.per_node_hour
    margins = [e.upper_per_node_hour - e.per_node_hour for e in estimates]
    assert margins == sorted(margins, reverse=True)
    assert estimates[-1].upper_per_node_hour < 1.2e-3


def test_no_failures_yet_is_not_a_zero_rate() -> None:
    estimate = estimate_failure_rate(failures=0, node_hours=1_000.0)
    assert estimate.per_node_hour == 0
    assert estimate.upper_per_node_hour == pytest.approx(-math.log(0.05) / 1_000.0)


def test_a_higher_confidence_gives_a_higher_bound() -> None:
    assert poisson_mean_upper_bound(5, confidence=0.99) > poisson_mean_upper_bound(5, confidence=0.95)


@pytest.mark.parametrize(
    "call",
    [
        lambda: poisson_quantile(1.0, 2.0),
        lambda: poisson_quantile(0.0, 2.0),
        lambda: poisson_cdf(3, -1.0),
        lambda: spares_needed(nodes=-1, failures_per_node_hour=1e-4, repair_hours=1, probability=0.9),
        lambda: estimate_failure_rate(failures=1, node_hours=0.0),
        lambda: poisson_mean_upper_bound(1, confidence=1.0),
    ],
)
def test_nonsense_is_refused(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()
