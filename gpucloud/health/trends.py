"""Counter trends: conditions raised from a node's readings before the counters turn fatal.

A GPU rarely dies without warning in its counters: corrected ECC errors climb, rows get
remapped, NVLink CRC errors force replays, PCIe replays rise, the board slows itself down.
These rules look at the readings in the trend window and raise `suspect` conditions (mostly
`watch`), so the scheduler can prefer other nodes and an operator can act at the next idle
moment instead of during a tenant's run.

Counters are compared per GPU (keyed by UUID, since NVML indices shift when a GPU drops out)
and per link. A counter that goes down was reset (volatile ECC counts clear on driver reload,
NVLink counters on GPU reset): counting restarts from zero rather than reading as negative.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpucloud.health.verdict import Action, Condition, Health, HealthPolicy
from gpucloud.protocol.reports import HARDWARE_SLOWDOWN_REASONS, GpuReading, NodeReading, NvLinkReading

_MIN_RATE_SPAN = timedelta(hours=1)


@dataclass(frozen=True)
class Growth:
    """How much a counter rose over a series, and when it first rose."""

    total: int
    since: datetime | None


def counter_growth(points: Iterable[tuple[datetime, int | None]]) -> Growth:
    total, since, previous = 0, None, None
    for timestamp, value in points:
        if value is None:
            continue
        if previous is not None:
            step = value - previous if value >= previous else value
            if step > 0:
                total += step
                since = since or timestamp
        previous = value
    return Growth(total, since)


def _sum_growth(growths: Iterable[Growth]) -> Growth:
    growths = list(growths)
    starts = [g.since for g in growths if g.since is not None]
    return Growth(sum(g.total for g in growths), min(starts, default=None))


@dataclass(frozen=True)
class _GpuSeries:
    uuid: str
    points: list[tuple[datetime, GpuReading]]

    @property
    def latest(self) -> GpuReading:
        return self.points[-1][1]

    @property
    def rate_hours(self) -> float:
        span = self.points[-1][0] - self.points[0][0]
        return max(span, _MIN_RATE_SPAN) / timedelta(hours=1)

    def growth(self, metric: Callable[[GpuReading], int | None]) -> Growth:
        return counter_growth((ts, metric(gpu)) for ts, gpu in self.points)

    def link_growth(self, metric: Callable[[NvLinkReading], int | None]) -> Growth:
        links = {link.link for _, gpu in self.points for link in gpu.nvlinks}
        return _sum_growth(
            counter_growth((ts, _link_value(gpu, link, metric)) for ts, gpu in self.points) for link in links
        )


def _link_value(gpu: GpuReading, link: int, metric: Callable[[NvLinkReading], int | None]) -> int | None:
    for reading in gpu.nvlinks:
        if reading.link == link:
            return metric(reading)
    return None


def _gpu_series(readings: Sequence[NodeReading], *, start: datetime, end: datetime) -> list[_GpuSeries]:
    by_uuid: dict[str, list[tuple[datetime, GpuReading]]] = defaultdict(list)
    for reading in sorted(readings, key=lambda r: r.timestamp):
        if start <= reading.timestamp <= end:
            for gpu in reading.gpus:
                by_uuid[gpu.uuid or f"index-{gpu.index}"].append((reading.timestamp, gpu))
    return [_GpuSeries(uuid, points) for uuid, points in by_uuid.items()]


def trend_conditions(
    readings: Sequence[NodeReading], *, now: datetime, policy: HealthPolicy, cleared_at: datetime | None = None
) -> list[Condition]:
    """Every trend condition over the window that ends at `now` and starts no earlier than the
    last verified repair (`cleared_at`): growth from before a repair was already judged."""
    start = now - policy.trend_window
    if cleared_at is not None:
        start = max(start, cleared_at)
    conditions: list[Condition] = []
    for series in _gpu_series(readings, start=start, end=now):
        conditions += _rate_conditions(series, policy)
        conditions += _state_conditions(series, policy)
    return conditions


def _condition(
    series: _GpuSeries,
    name: str,
    reason: str,
    since: datetime,
    *,
    health: Health = Health.SUSPECT,
    action: Action = Action.WATCH,
) -> Condition:
    gpu = series.latest
    return Condition(
        name=name,
        reason=f"GPU {gpu.index} ({series.uuid}): {reason}",
        since=since,
        health=health,
        action=action,
        gpu_index=gpu.index,
    )


def _rate_conditions(series: _GpuSeries, policy: HealthPolicy) -> list[Condition]:
    hours = series.rate_hours
    checks = [
        (
            "ecc_corrected_rate",
            "corrected ECC errors",
            policy.ecc_corrected_per_hour,
            series.growth(lambda g: g.ecc.volatile_corrected),
        ),
        (
            "nvlink_error_rate",
            "NVLink CRC errors and replays",
            policy.nvlink_errors_per_hour,
            series.link_growth(lambda link: _sum_or_none(link.replay, link.crc_flit, link.crc_data)),
        ),
        (
            "nvlink_recovery_rate",
            "NVLink recoveries (link retrains)",
            policy.nvlink_recoveries_per_hour,
            series.link_growth(lambda link: link.recovery),
        ),
        ("pcie_replay_rate", "PCIe replays", policy.pcie_replays_per_hour, series.growth(lambda g: g.pcie_replay)),
    ]
    conditions = []
    for name, what, limit, growth in checks:
        rate = growth.total / hours
        if growth.since is not None and rate > limit:
            reason = f"{what} at {rate:.1f}/h ({growth.total} in {hours:.1f} h), above {limit:g}/h"
            conditions.append(_condition(series, name, reason, growth.since))
    events = [
        ("ecc_uncorrected", "uncorrected ECC errors", series.growth(lambda g: g.ecc.volatile_uncorrected)),
        (
            "remapped_rows_uncorrectable",
            "rows remapped after uncorrectable errors",
            series.growth(lambda g: g.remapped_rows.uncorrectable if g.remapped_rows else None),
        ),
    ]
    for name, what, growth in events:
        if growth.since is not None:
            conditions.append(_condition(series, name, f"{what} grew by {growth.total}", growth.since))
    return conditions


def _sum_or_none(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _state_conditions(series: _GpuSeries, policy: HealthPolicy) -> list[Condition]:
    conditions = []
    latest = series.latest
    rows = latest.remapped_rows
    if rows is not None and rows.failure:
        conditions.append(
            _condition(
                series,
                "row_remap_failure",
                "row remapping failed: spare rows exhausted, a reset cannot help",
                _run_start(series, lambda g: bool(g.remapped_rows and g.remapped_rows.failure)),
                health=Health.FAILED,
                action=Action.RMA,
            )
        )
    elif rows is not None and rows.pending:
        conditions.append(
            _condition(
                series,
                "row_remap_pending",
                "a row remap is pending: it takes effect at the next GPU reset",
                _run_start(series, lambda g: bool(g.remapped_rows and g.remapped_rows.pending)),
            )
        )
    conditions += _links_down(series)
    slowed = [set(gpu.clock_event_reason_names) & HARDWARE_SLOWDOWN_REASONS for _, gpu in series.points]
    recent = slowed[-policy.hardware_slowdown_readings :]
    if len(recent) == policy.hardware_slowdown_readings and all(recent):
        reasons = ", ".join(sorted(set().union(*recent)))
        conditions.append(
            _condition(
                series,
                "hardware_slowdown",
                f"the board has slowed its clocks ({reasons}) in the last {len(recent)} "
                "readings: check cooling and power",
                _run_start(series, lambda g: bool(set(g.clock_event_reason_names) & HARDWARE_SLOWDOWN_REASONS)),
            )
        )
    return conditions


def _links_down(series: _GpuSeries) -> list[Condition]:
    """Links that were up earlier in the window and are down now: a fabric fault, not a trend.

    A link that was never seen up (a board wired with fewer links) raises nothing.
    """
    latest = {link.link: link.active for link in series.latest.nvlinks}
    seen_up = {link.link for _, gpu in series.points for link in gpu.nvlinks if link.active}
    down = sorted(link for link in seen_up if latest.get(link) is False)
    if not down:
        return []
    since = _run_start(series, lambda g: any(link.link in down and not link.active for link in g.nvlinks))
    return [_condition(series, "nvlink_down", f"NVLink link(s) {down} went down", since, action=Action.DRAIN)]


def _run_start(series: _GpuSeries, holds: Callable[[GpuReading], bool]) -> datetime:
    """When the condition that holds in the latest reading started holding, without a break."""
    since = series.points[-1][0]
    for timestamp, gpu in reversed(series.points):
        if not holds(gpu):
            break
        since = timestamp
    return since
