"""Spare capacity: how many spare nodes a pool needs so that a failed node is replaced at once.

A node that fails leaves its pool for repair (drain, reset ladder, burn-in, or an RMA) and comes
back after a turnaround time. Failures arrive at `nodes × rate` per hour and each stays out for
`repair_hours` on average, so the count of nodes out at a moment, N, is that of an M/G/∞ queue:
Poisson with mean

    μ = nodes × failures_per_node_hour × repair_hours

whatever the shape of the repair time (only its mean matters). With `s` spares, every node out
has a spare standing in for it at a random moment with probability P(N ≤ s); the pool needs the
smallest `s` with P(N ≤ s) ≥ p. A node that fails sees the *others* out with the same law (Poisson
arrivals see time averages), so it finds a spare on hand, and its replacement starts as soon as
it is pulled rather than after someone's repair, with probability P(N ≤ s − 1):
`SparePlan.spare_on_failure` reports it.

The rate is measured per GPU type (`estimate_failure_rate`: failures over node-hours, with a
Garwood upper confidence bound, since a young fleet's few failures say little) or, before there
is a record, the Llama 3 405B pre-training run's (the same figures as `sim/faults.py`).

Worked example. The paper: 16,384 H100s (2,048 nodes of eight) over 54 days, 419 unexpected
interruptions: 419 / (2,048 × 54 × 24 node-hours) = 1.58 × 10⁻⁴ failures per node-hour
(3.79 × 10⁻³ per node-day). A 1,000-node pool whose failed nodes come back in 72 hours has
μ = 1,000 × 1.58 × 10⁻⁴ × 72 = 11.4 nodes out on average; P(N ≤ s) ≥ 0.99 first holds at
s = 20 spares (2 % of the pool). With a 24-hour turnaround, μ = 3.8 and s = 9. All 419 count
here, software interruptions included, though some of those never take a node out: the default
errs towards more spares.

Pure: no I/O and no scipy (not a dependency); the Poisson CDF sums terms in log space with
`math.lgamma`, and the upper bound is found by bisection on it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

LLAMA3_405B_GPUS = 16_384
LLAMA3_405B_DAYS = 54
LLAMA3_405B_INTERRUPTIONS = 419
GPUS_PER_NODE = 8
# 419 / (2,048 nodes × 54 days × 24 h) = 1.58e-4 per node-hour; `sim/faults.py`'s
# INTERRUPTIONS_PER_NODE_DAY / 24 (the sim sits above this floor, so the figure is repeated here).
LLAMA3_405B_FAILURES_PER_NODE_HOUR = LLAMA3_405B_INTERRUPTIONS / (
    LLAMA3_405B_GPUS / GPUS_PER_NODE * LLAMA3_405B_DAYS * 24
)

# Bisection stops when the bracket is this narrow relative to its top.
_RELATIVE_TOLERANCE = 1e-12


def poisson_cdf(k: int, mean: float) -> float:
    """P(N ≤ k) for N ~ Poisson(mean).

    Each term is exp(i·ln μ − μ − ln i!) computed in log space, so a large mean neither
    overflows μ^i nor underflows e^−μ before the product; terms far below the mode underflow to
    zero, which is what they are worth.
    """
    if mean < 0:
        raise ValueError("mean must be non-negative")
    if k < 0:
        return 0.0
    if mean == 0:
        return 1.0
    log_mean = math.log(mean)
    total = math.fsum(math.exp(i * log_mean - mean - math.lgamma(i + 1)) for i in range(k + 1))
    return min(total, 1.0)


def poisson_quantile(probability: float, mean: float) -> int:
    """The smallest k with P(N ≤ k) ≥ probability, for N ~ Poisson(mean)."""
    if not 0 < probability < 1:
        raise ValueError("probability must be in (0, 1)")
    if mean < 0:
        raise ValueError("mean must be non-negative")
    if mean == 0:
        return 0
    log_mean = math.log(mean)
    cdf = 0.0
    k = 0
    while True:
        term = math.exp(k * log_mean - mean - math.lgamma(k + 1))
        cdf += term
        # Past the mode, a term too small to move the sum means the sum is as close to 1 as
        # floating point gets: a probability a hair under 1 is met here rather than never.
        if cdf >= probability or (k > mean and term <= cdf * 1e-17):
            return k
        k += 1


class FailureRate(BaseModel):
    """Failures per node-hour measured over an exposure, with a one-sided upper bound."""

    model_config = ConfigDict(frozen=True)

    failures: int = Field(ge=0)
    node_hours: float = Field(gt=0)
    confidence: float = Field(gt=0, lt=1)
    per_node_hour: float  # the point estimate, failures / node_hours
    upper_per_node_hour: float  # the rate is below this with probability `confidence`


def poisson_mean_upper_bound(failures: int, *, confidence: float) -> float:
    """Garwood's exact one-sided upper bound on a Poisson mean after observing `failures`.

    The mean μ_U with P(N ≤ failures; μ_U) = 1 − confidence, i.e. χ²(confidence; 2n + 2) / 2:
    any larger mean would make so few failures less likely than 1 − confidence. Zero failures
    give −ln(1 − confidence) (3.0 at 95 %), not zero: no failures yet is not a zero rate.
    """
    if failures < 0:
        raise ValueError("failures must be non-negative")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    target = 1 - confidence
    low, high = float(failures), float(failures) + 1.0
    while poisson_cdf(failures, high) > target:
        low, high = high, high * 2
    # poisson_cdf falls as the mean rises: keep the bound between a mean too small and one big enough.
    while high - low > _RELATIVE_TOLERANCE * high:
        middle = (low + high) / 2
        if poisson_cdf(failures, middle) > target:
            low = middle
        else:
            high = middle
    return high


def estimate_failure_rate(*, failures: int, node_hours: float, confidence: float = 0.95) -> FailureRate:
    """The measured rate and its conservative upper bound; plan spares on the upper one."""
    if node_hours <= 0:
        raise ValueError("node_hours must be positive")
    return FailureRate(
        failures=failures,
        node_hours=node_hours,
        confidence=confidence,
        per_node_hour=failures / node_hours,
        upper_per_node_hour=poisson_mean_upper_bound(failures, confidence=confidence) / node_hours,
    )


def spares_needed(*, nodes: int, failures_per_node_hour: float, repair_hours: float, probability: float) -> int:
    """The smallest s with P(N ≤ s) ≥ probability, N ~ Poisson(nodes × rate × repair_hours)."""
    return poisson_quantile(probability, _nodes_out_mean(nodes, failures_per_node_hour, repair_hours))


class SparePlan(BaseModel):
    """What a pool needs beside what it holds."""

    model_config = ConfigDict(frozen=True)

    pool: str
    nodes: int
    spares_held: int
    failures_per_node_hour: float
    repair_hours: float
    probability: float
    expected_out: float  # μ, the mean count of nodes out for repair
    spares_needed: int
    coverage_held: float  # P(N ≤ spares_held): every node out has a spare, at a random moment
    spare_on_failure: float  # P(N ≤ spares_held − 1): a failing node finds a spare on hand

    @property
    def shortfall(self) -> int:
        return max(self.spares_needed - self.spares_held, 0)


def plan_spares(
    *,
    pool: str,
    nodes: int,
    spares_held: int,
    repair_hours: float,
    probability: float = 0.99,
    failures_per_node_hour: float = LLAMA3_405B_FAILURES_PER_NODE_HOUR,
) -> SparePlan:
    """The pool's spares needed at `probability`, and how well the spares it holds cover it.

    Pass a measured rate's `upper_per_node_hour` for `failures_per_node_hour` once the GPU type
    has a record; the default is the Llama 3 405B run's.
    """
    if spares_held < 0:
        raise ValueError("spares_held must be non-negative")
    mean = _nodes_out_mean(nodes, failures_per_node_hour, repair_hours)
    return SparePlan(
        pool=pool,
        nodes=nodes,
        spares_held=spares_held,
        failures_per_node_hour=failures_per_node_hour,
        repair_hours=repair_hours,
        probability=probability,
        expected_out=mean,
        spares_needed=poisson_quantile(probability, mean),
        coverage_held=poisson_cdf(spares_held, mean),
        spare_on_failure=poisson_cdf(spares_held - 1, mean),
    )


def _nodes_out_mean(nodes: int, failures_per_node_hour: float, repair_hours: float) -> float:
    if nodes < 0:
        raise ValueError("nodes must be non-negative")
    if failures_per_node_hour < 0:
        raise ValueError("failures_per_node_hour must be non-negative")
    if repair_hours < 0:
        raise ValueError("repair_hours must be non-negative")
    return nodes * failures_per_node_hour * repair_hours
