"""The health judgement for one node: XID events and readings in, a `HealthVerdict` out.

`evaluate_node` is pure: the caller passes the node's recent XID events (30 days covers every
rule), its readings history, `now`, and `cleared_at`, the moment the node last passed a verified
repair (burn-in). What happened before `cleared_at` has been dealt with: it no longer makes the
node unhealthy, but it still counts for the lemon rule.

The rules, in the order they protect tenants and the fleet:

- Burst grouping: events of one XID on one node within `burst_window` of the first are one
  incident. A single fault logs the same XID on all eight GPUs, often many times; counted
  one by one it would look like a dozen faults.
- XID table (`health/xid.py`): each incident gets its XID's health and action. Drain-level
  incidents stay until `cleared_at` passes them (only a verified repair clears them); watch-level
  ones expire after `trend_window`.
- Application XIDs (13, 31, 43, 45, 68) are the workload's faults: one tenant's crashes, however
  many, never drain a node. Only when incidents come from several tenants (or allocations when
  the tenant is unknown) does the node become suspect and drain into burn-in, which tells a bad
  GPU from bad luck.
- Counter trends (`health/trends.py`) and the probe's own findings: fatal probe errors, GPUs
  missing from the bus.
- Signals beyond XIDs (`health/signals.py`: kernel log, InfiniBand sysfs): each signal's row in
  the signal table, after `cleared_at` as XIDs are; application signals never drain. They do not
  count toward the lemon rule.
- Lemon rule: a current fatal episode that is the node's `lemon_fatal_episodes`-th within
  `lemon_window` turns the action into `rma`: another reset would only hand a tenant the same
  broken GPU again. Fatal XIDs and fatal probe readings close together form one episode, since a
  GPU falling off the bus logs XID 79 and reads as lost at the same moment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpucloud.health.signals import judge_signals
from gpucloud.health.trends import trend_conditions
from gpucloud.health.verdict import (
    DEFAULT_POLICY,
    Action,
    Condition,
    Health,
    HealthPolicy,
    HealthVerdict,
    action_rank,
)
from gpucloud.health.xid import classify_xid, is_application_xid
from gpucloud.protocol.reports import FatalKind, NodeReading, SignalObservation, XidEvent

# Probe failures that are the hardware's doing; a driver that is missing or mismatched is a
# software fault and no reason to replace a GPU.
_HARDWARE_FATAL_KINDS = frozenset({FatalKind.GPU_LOST, FatalKind.RESET_REQUIRED})


@dataclass(frozen=True)
class Incident:
    """Events of one XID on one node, from `first` to within the burst window of it."""

    xid: int
    events: tuple[XidEvent, ...]

    @property
    def first(self) -> datetime:
        return self.events[0].timestamp

    @property
    def last(self) -> datetime:
        return self.events[-1].timestamp

    @property
    def gpu_indices(self) -> list[int]:
        return sorted({e.gpu_index for e in self.events if e.gpu_index is not None})

    @property
    def workloads(self) -> set[str]:
        return {workload_key(e) for e in self.events}


def workload_key(event: XidEvent) -> str:
    """Whose work was on the node: the tenant, else the allocation, else nobody's."""
    if event.tenant_id is not None:
        return f"tenant:{event.tenant_id}"
    if event.allocation_id is not None:
        return f"allocation:{event.allocation_id}"
    return "unallocated"


def group_incidents(events: Iterable[XidEvent], *, window: timedelta) -> list[Incident]:
    """Burst grouping: per XID, an event within `window` of the open incident's first event
    joins it. Measured from the first event, not the last, so a steady trickle cannot merge
    into one endless incident."""
    by_xid: dict[int, list[XidEvent]] = {}
    for event in sorted(events, key=lambda e: e.timestamp):
        by_xid.setdefault(event.xid, []).append(event)
    incidents = []
    for xid, xid_events in by_xid.items():
        current: list[XidEvent] = []
        for event in xid_events:
            if current and event.timestamp - current[0].timestamp > window:
                incidents.append(Incident(xid, tuple(current)))
                current = []
            current.append(event)
        incidents.append(Incident(xid, tuple(current)))
    return sorted(incidents, key=lambda i: (i.first, i.xid))


def evaluate_node(
    *,
    events: Sequence[XidEvent],
    readings: Sequence[NodeReading],
    now: datetime,
    policy: HealthPolicy = DEFAULT_POLICY,
    cleared_at: datetime | None = None,
    expected_gpu_count: int | None = None,
    signals: Sequence[SignalObservation] = (),
) -> HealthVerdict:
    """The node's health, the conditions behind it, and the action to take (see module doc);
    `signals` (those beyond XIDs) are judged by their own table (`health/signals.py`)."""
    horizon = now - policy.lemon_window
    events = [e for e in events if horizon <= e.timestamp <= now]
    readings = sorted((r for r in readings if horizon <= r.timestamp <= now), key=lambda r: r.timestamp)
    incidents = group_incidents(events, window=policy.burst_window)
    # What came before a verified repair was dealt with: an event after it starts a new episode,
    # however close to the last one before it (its incident is a new one).
    active = group_incidents([e for e in events if _after(e.timestamp, cleared_at)], window=policy.burst_window)
    active_readings = [r for r in readings if _after(r.timestamp, cleared_at)]

    conditions = [
        *_xid_conditions([i for i in active if not is_application_xid(i.xid)], now=now, policy=policy),
        *_application_conditions([i for i in active if is_application_xid(i.xid)], now=now, policy=policy),
        *_probe_conditions(active_readings, expected_gpu_count=expected_gpu_count),
        *trend_conditions(readings, now=now, policy=policy, cleared_at=cleared_at),
        *judge_signals(signals, now=now, policy=policy, cleared_at=cleared_at),
    ]
    conditions += _lemon_conditions(incidents, readings, policy=policy, cleared_at=cleared_at)
    return HealthVerdict.of(conditions)


def _after(timestamp: datetime, cleared_at: datetime | None) -> bool:
    return cleared_at is None or timestamp > cleared_at


def _xid_conditions(incidents: list[Incident], *, now: datetime, policy: HealthPolicy) -> list[Condition]:
    """One condition per XID, dated from its earliest incident that still applies."""
    by_xid: dict[int, list[Incident]] = {}
    for incident in incidents:
        xid_policy = classify_xid(incident.xid)
        expired = action_rank(xid_policy.action) < action_rank(Action.DRAIN) and (
            now - incident.last > policy.trend_window
        )
        if not expired:
            by_xid.setdefault(incident.xid, []).append(incident)
    conditions = []
    for xid, xid_incidents in by_xid.items():
        xid_policy = classify_xid(xid)
        gpus = sorted({g for i in xid_incidents for g in i.gpu_indices})
        count = sum(len(i.events) for i in xid_incidents)
        conditions.append(
            Condition(
                name=f"xid_{xid}",
                reason=(
                    f"XID {xid} ({xid_policy.meaning}) on GPU(s) {gpus}: {len(xid_incidents)} incident(s), "
                    f"{count} event(s); {xid_policy.recovery}"
                ),
                since=xid_incidents[0].first,
                health=xid_policy.health,
                action=xid_policy.action,
                gpu_index=gpus[0] if len(gpus) == 1 else None,
                xid=xid,
            )
        )
    return conditions


def _application_conditions(incidents: list[Incident], *, now: datetime, policy: HealthPolicy) -> list[Condition]:
    recent = [i for i in incidents if now - i.last <= policy.application_window]
    if not recent:
        return []
    workloads = set().union(*(i.workloads for i in recent))
    xids = sorted({i.xid for i in recent})
    summary = f"{len(recent)} application XID incident(s) {xids} from {len(workloads)} workload(s)"
    across_tenants = (
        len(workloads) >= policy.application_escalation_tenants
        and len(recent) >= policy.application_escalation_incidents
    )
    name, meaning, health, action = (
        (
            "application_xids_across_tenants",
            "faults follow the node, not the workload; drain and verify in burn-in",
            Health.SUSPECT,
            Action.DRAIN,
        )
        if across_tenants
        else ("application_xids", "counted, not acted on", Health.OK, Action.NONE)
    )
    return [Condition(name=name, reason=f"{summary}: {meaning}", since=recent[0].first, health=health, action=action)]


def _probe_conditions(readings: list[NodeReading], *, expected_gpu_count: int | None) -> list[Condition]:
    """Fatal probe readings and GPUs missing from the bus.

    A lost GPU stays a condition until a verified repair, like a fatal XID. A driver that is not
    loaded or mismatched is a state, not an event: it counts while the latest reading shows it,
    so a node whose agent started a moment before its driver is not drained for it.
    """
    if not readings:
        return []
    latest = readings[-1]
    fatal = [
        r
        for r in readings
        if r.fatal_error is not None and (r.fatal_error.kind in _HARDWARE_FATAL_KINDS or r is latest)
    ]
    conditions = []
    first = fatal[0].fatal_error if fatal else None
    if first is not None:
        conditions.append(
            Condition(
                name="probe_fatal",
                reason=f"the probe reported {first.kind} ({first.detail or 'no detail'}); "
                f"{len(fatal)} fatal reading(s) since",
                since=fatal[0].timestamp,
                health=Health.FAILED,
                action=Action.DRAIN_NOW,
                gpu_index=first.gpu_index,
            )
        )
    if expected_gpu_count is not None and latest.fatal_error is None and len(latest.gpus) < expected_gpu_count:
        conditions.append(
            Condition(
                name="gpu_missing",
                reason=f"{len(latest.gpus)} of {expected_gpu_count} GPUs visible"
                + ("" if latest.is_gpu_node else " (no GPU library)"),
                since=_run_start(readings, lambda r: len(r.gpus) < expected_gpu_count),
                health=Health.FAILED,
                action=Action.DRAIN_NOW,
            )
        )
    return conditions


def _run_start(readings: list[NodeReading], holds: Callable[[NodeReading], bool]) -> datetime:
    since = readings[-1].timestamp
    for reading in reversed(readings):
        if not holds(reading):
            break
        since = reading.timestamp
    return since


def fatal_episodes(
    incidents: Iterable[Incident], readings: Sequence[NodeReading], *, window: timedelta
) -> list[tuple[datetime, datetime]]:
    """Fatal XID incidents and runs of hardware-fatal readings, merged when within `window`."""
    spans = [(i.first, i.last) for i in incidents if classify_xid(i.xid).counts_as_fatal]
    run: list[datetime] = []
    for reading in sorted(readings, key=lambda r: r.timestamp):
        if reading.fatal_error is not None and reading.fatal_error.kind in _HARDWARE_FATAL_KINDS:
            run.append(reading.timestamp)
        elif run:
            spans.append((run[0], run[-1]))
            run = []
    if run:
        spans.append((run[0], run[-1]))
    merged: list[tuple[datetime, datetime]] = []
    for start, end in sorted(spans):
        if merged and start - merged[-1][1] <= window:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _lemon_conditions(
    incidents: list[Incident], readings: list[NodeReading], *, policy: HealthPolicy, cleared_at: datetime | None
) -> list[Condition]:
    episodes = fatal_episodes(incidents, readings, window=policy.burst_window)
    if len(episodes) < policy.lemon_fatal_episodes or not _after(episodes[-1][1], cleared_at):
        return []
    days = policy.lemon_window / timedelta(days=1)
    return [
        Condition(
            name="lemon",
            reason=f"{len(episodes)} fatal episodes in {days:g} days: RMA instead of another reset",
            since=episodes[-1][0],
            health=Health.FAILED,
            action=Action.RMA,
        )
    ]
