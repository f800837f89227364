"""The signal table: faults that show no XID, what each means, and what to do about it.

About a third of the interruptions in Meta's Llama 3 405B run (the categories in `health/categories.py`)
never reach the GPU driver as an XID: a switch or cable, the host's maintenance, a NIC, an NCCL
watchdog timeout, silent data corruption, a thermal interface. The host still sees them, in the
kernel log, in InfiniBand sysfs counters, in the workload's own reports. This table is the one
place that says what each such signal means; `judge_signals` applies it the way `health/rules.py`
applies the XID table, and returns the same `Condition`s. The signals themselves (`Signal`,
`SignalObservation`) are what a node reports, so they live in `protocol/reports.py` beside `XidEvent`.

A row with a threshold counts occurrences (or a counter's growth) within its window: at or below
the threshold the signal is observed (`ok`, `watch`), above it the row's health and action apply.
A row without a threshold acts on one occurrence. Application signals (the `application` flag)
are the workload's faults, like application XIDs: counted, never a reason to drain.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpucloud.health.categories import FaultCategory
from gpucloud.health.verdict import DEFAULT_POLICY, Action, Condition, Health, HealthPolicy, action_rank
from gpucloud.protocol.reports import Signal, SignalObservation


@dataclass(frozen=True)
class SignalPolicy:
    signal: Signal
    # The Llama 3 interruption category the signal belongs to.
    category: FaultCategory
    health: Health
    action: Action
    meaning: str
    threshold: int | None = None
    window: timedelta | None = None
    application: bool = False


# One row per signal: category, health, action, threshold per window (`-`: one occurrence acts),
# flags (`application`: the workload's fault, never drains), and on the next line what it means.
_TABLE = """
ib_link_down           | network                | failed  | drain | -      |
    | an InfiniBand port that was active is not
ib_link_downed         | network                | suspect | drain | 2/1h   |
    | the port's link went down and retrained (link_downed)
ib_symbol_errors       | network                | suspect | drain | 100/1h |
    | physical-layer symbol errors: a cable or transceiver going bad
ib_rcv_errors          | network                | suspect | watch | 100/1h |
    | malformed packets received on the port (port_rcv_errors)
nic_error              | nic                    | failed  | drain | -      |
    | the NIC's firmware reported a fatal or module error
pcie_aer_uncorrectable | other                  | failed  | drain | -      |
    | a PCIe uncorrectable error (AER): the link or device lost data
pcie_aer_correctable   | other                  | suspect | watch | 480/1h |
    | PCIe correctable errors (AER); the bar is DCGM's for PCIe replays
nvrm_error             | faulty_gpu             | suspect | watch | -      |
    | the NVIDIA driver logged an error that is not an XID
gpu_row_remap_failure  | hbm3                   | failed  | rma   | -      |
    | row remapping failed: spare rows exhausted, a reset cannot help
gpu_row_remap_pending  | hbm3                   | suspect | watch | -      |
    | a row remap is pending: it takes effect at the next GPU reset
ecc_dbe                | hbm3                   | failed  | drain | -      |
    | a double-bit (uncorrectable) ECC error
ecc_sbe_rate           | hbm3                   | suspect | watch | 100/1h |
    | single-bit (corrected) ECC errors at a high rate
workload_hang          | software               | ok      | none  | -      | application
    | the workload stopped making progress
nccl_timeout           | nccl_watchdog          | ok      | none  | -      | application
    | the NCCL watchdog timed out a collective
thermal                | other                  | suspect | drain | 3/1h   |
    | thermal throttling or a sensor fault: check the thermal interface
sdc_suspect            | silent_data_corruption | failed  | drain | -      |
    | a check found wrong results: verify in burn-in, RMA if it repeats
host_maintenance       | host_maintenance       | suspect | drain | -      |
    | the host is due for maintenance: move the tenant off first
diag_failure           | faulty_gpu             | failed  | drain | -      |
    | a scheduled diagnostic of the idle node (dcgmi diag -r 1) failed
nccl_allreduce_slow    | other                  | suspect | watch | -      |
    | a scheduled single-node NCCL all-reduce ran below the GPU type's bus bandwidth floor
nvbandwidth_low        | other                  | suspect | watch | -      |
    | a scheduled nvbandwidth run measured a GPU's host link below the GPU type's floor
"""


def _parse(table: str) -> dict[Signal, SignalPolicy]:
    lines = table.strip().splitlines()
    policies = {}
    for head, tail in zip(lines[::2], lines[1::2], strict=True):
        signal, category, health, action, limit, flags = (cell.strip() for cell in head.split("|"))
        threshold, window = None, None
        if limit != "-":
            count, hours = limit.removesuffix("h").split("/")
            threshold, window = int(count), timedelta(hours=int(hours))
        policies[Signal(signal)] = SignalPolicy(
            signal=Signal(signal),
            category=FaultCategory(category),
            health=Health(health),
            action=Action(action),
            meaning=tail.split("|", 1)[1].strip(),
            threshold=threshold,
            window=window,
            application="application" in flags.split(),
        )
    return policies


SIGNAL_TABLE: dict[Signal, SignalPolicy] = _parse(_TABLE)
APPLICATION_SIGNALS = frozenset(s for s, p in SIGNAL_TABLE.items() if p.application)


def judge_signals(
    observations: Sequence[SignalObservation],
    *,
    now: datetime,
    policy: HealthPolicy = DEFAULT_POLICY,
    cleared_at: datetime | None = None,
) -> list[Condition]:
    """One condition per signal seen since `cleared_at`, the worst over its sources.

    As with XIDs, a drain-level condition stays until a verified repair (`cleared_at`) passes
    it; a watch-level one expires after `trend_window`. Combine with the XID conditions through
    `HealthVerdict.of`.
    """
    horizon = now - policy.lemon_window
    by_signal: dict[Signal, dict[str, list[SignalObservation]]] = defaultdict(lambda: defaultdict(list))
    for observation in sorted(observations, key=lambda o: o.at):
        if horizon <= observation.at <= now and (cleared_at is None or observation.at > cleared_at):
            by_signal[observation.signal][observation.source].append(observation)
    conditions = []
    for signal, by_source in by_signal.items():
        condition = _signal_condition(SIGNAL_TABLE[signal], by_source, now=now, policy=policy)
        if condition is not None:
            conditions.append(condition)
    return conditions


def _signal_condition(
    row: SignalPolicy, by_source: dict[str, list[SignalObservation]], *, now: datetime, policy: HealthPolicy
) -> Condition | None:
    if action_rank(row.action) < action_rank(Action.DRAIN):
        by_source = {
            source: recent
            for source, seen in by_source.items()
            if (recent := [o for o in seen if now - o.at <= policy.trend_window])
        }
    breaches = {source: at for source, seen in by_source.items() if (at := _first_breach(row, seen)) is not None}
    live = {
        source: seen
        for source, seen in by_source.items()
        if source in breaches or now - seen[-1].at <= policy.trend_window
    }
    if not live:
        return None
    sources = sorted(s or "node" for s in live)
    total = sum(o.count for seen in live.values() for o in seen)
    summary = f"{row.meaning}: {total} on {', '.join(sources)}"
    live_breaches = {s: at for s, at in breaches.items() if s in live}
    if live_breaches:
        limit = "" if row.threshold is None else f", above {row.threshold} per {_hours(row.window)}"
        return Condition(
            name=row.signal.value,
            reason=f"{summary}{limit}" + ("; the workload's fault, counted, not acted on" if row.application else ""),
            since=min(live_breaches.values()),
            health=row.health,
            action=row.action,
        )
    return Condition(
        name=row.signal.value,
        reason=f"{summary}, within {row.threshold} per {_hours(row.window)}: observed",
        since=min(seen[0].at for seen in live.values()),
        health=Health.OK,
        action=Action.WATCH,
    )


def _first_breach(row: SignalPolicy, seen: list[SignalObservation]) -> datetime | None:
    """When the count within the row's window, ending at some observation, first exceeded the
    threshold. A counter delta spread over a span longer than the window counts pro rata: 200
    symbol errors read a day apart are not 200 in one hour."""
    if row.threshold is None or row.window is None:
        return seen[0].at if seen else None
    window = row.window
    counts = [_within(o, window) for o in seen]
    start, running = 0, 0.0
    for end, observation in enumerate(seen):
        running += counts[end]
        while observation.at - seen[start].at > window:
            running -= counts[start]
            start += 1
        if running > row.threshold:
            return observation.at
    return None


def _within(observation: SignalObservation, window: timedelta) -> float:
    if observation.span is None or observation.span <= window:
        return float(observation.count)
    return observation.count * (window / observation.span)


def _hours(window: timedelta | None) -> str:
    hours = (window or timedelta(hours=1)) / timedelta(hours=1)
    return "hour" if hours == 1 else f"{hours:g} hours"
