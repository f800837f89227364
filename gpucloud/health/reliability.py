"""Reliability per place: MTBF, MTTR and MTTS of the fleet's nodes, from their incidents (pure:
no I/O, no clock; `services/reliability.py` reads the rows).

Over a window (start, now], per GPU type, region and rack, and rolled up per GPU type and region
(`ROLLUP_RACK`, the empty string: a node's rack is never empty):

- **failures**: the node incidents (`kind` "node") detected within the window, less those
  `abandoned` before the node was ever pulled (the pull never happened: no node left service). A
  node incident that is still open counts: it was detected;
- **node-hours**: the place's nodes' hours in the fleet within the window (the caller's);
- **MTBF** (hours) = node-hours / failures; none while there are no failures;
- **MTTR** (seconds): the mean, over the node incidents gated within the window (`gated_at`:
  burn-in passed and the node is available again, status `resolved`), of `gated_at −
  detected_at`: fault to back in the pool, stabilization, diagnosis, repair and burn-in all in.
  An incident that ended in RMA never repaired its node and does not count (its node's failure
  does, in MTBF); none while no incident was gated in the window;
- **MTTS** (seconds): the mean, over the node incidents stabilized within the window, of
  `stabilized_at − detected_at`: fault to the node pulled and, for a held node, its allocation
  whole again.

An incident counts where its node is now. A fault's timestamp is the node's clock and may run a
few minutes ahead of the control plane's history (`health.incidents.CLOCK_SKEW`): a negative
duration counts as zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

# The rack label of a GPU type and region's rollup (every rack of the pool).
ROLLUP_RACK = ""
NODE = "node"
ABANDONED = "abandoned"
_HOUR = 3600.0

Place = tuple[str, str, str]  # (gpu_type, region, rack)


@dataclass(frozen=True)
class IncidentTimes:
    """What the reliability of a place reads of one incident, and where its node is."""

    gpu_type: str
    region: str
    rack: str
    kind: str
    status: str
    detected_at: datetime
    pulled_at: datetime | None = None
    stabilized_at: datetime | None = None
    gated_at: datetime | None = None

    @property
    def place(self) -> Place:
        return (self.gpu_type, self.region, self.rack)

    @property
    def failure(self) -> bool:
        """A node failure: a node incident, unless abandoned before its node was pulled."""
        return self.kind == NODE and not (self.status == ABANDONED and self.pulled_at is None)


def failed_within(incident: IncidentTimes, start: datetime, now: datetime) -> bool:
    return incident.failure and start < incident.detected_at <= now


@dataclass(frozen=True)
class Reliability:
    gpu_type: str
    region: str
    rack: str  # ROLLUP_RACK for the GPU type and region's rollup
    node_hours: float
    failures: int
    repairs: int  # node incidents gated within the window
    mttr_s: float | None
    stabilizations: int  # node incidents stabilized within the window
    mtts_s: float | None

    @property
    def mtbf_h(self) -> float | None:
        return self.node_hours / self.failures if self.failures else None


@dataclass
class _Tally:
    node_hours: float = 0.0
    failures: int = 0
    repairs: int = 0
    repair_s: float = 0.0
    stabilizations: int = 0
    stabilize_s: float = 0.0

    def add(self, other: _Tally) -> None:
        self.node_hours += other.node_hours
        self.failures += other.failures
        self.repairs += other.repairs
        self.repair_s += other.repair_s
        self.stabilizations += other.stabilizations
        self.stabilize_s += other.stabilize_s

    def result(self, place: Place) -> Reliability:
        return Reliability(
            gpu_type=place[0],
            region=place[1],
            rack=place[2],
            node_hours=self.node_hours,
            failures=self.failures,
            repairs=self.repairs,
            mttr_s=self.repair_s / self.repairs if self.repairs else None,
            stabilizations=self.stabilizations,
            mtts_s=self.stabilize_s / self.stabilizations if self.stabilizations else None,
        )


def _seconds(end: datetime, begin: datetime) -> float:
    return max((end - begin).total_seconds(), 0.0)


def reliability(
    node_hours: Mapping[Place, float], incidents: Iterable[IncidentTimes], *, start: datetime, now: datetime
) -> list[Reliability]:
    """Each rack's reliability over (start, now], then each GPU type and region's rollup (rack
    `ROLLUP_RACK`: its racks' node-hours and incidents summed, the means over all its incidents,
    not a mean of the racks' means), sorted by place. A place shows if it had node-hours or an
    incident counted in the window."""
    tallies: dict[Place, _Tally] = {}
    for place, hours in node_hours.items():
        tallies.setdefault(place, _Tally()).node_hours += hours
    for incident in incidents:
        if incident.kind != NODE:
            continue
        within = (
            failed_within(incident, start, now),
            incident.gated_at is not None and start < incident.gated_at <= now,
            incident.stabilized_at is not None and start < incident.stabilized_at <= now,
        )
        if not any(within):
            continue
        tally = tallies.setdefault(incident.place, _Tally())
        failed, gated, stabilized = within
        tally.failures += failed
        if gated and incident.gated_at is not None:
            tally.repairs += 1
            tally.repair_s += _seconds(incident.gated_at, incident.detected_at)
        if stabilized and incident.stabilized_at is not None:
            tally.stabilizations += 1
            tally.stabilize_s += _seconds(incident.stabilized_at, incident.detected_at)
    rollups: dict[Place, _Tally] = {}
    for (gpu_type, region, _), tally in tallies.items():
        rollups.setdefault((gpu_type, region, ROLLUP_RACK), _Tally()).add(tally)
    racks = [tallies[p].result(p) for p in sorted(tallies)]
    return racks + [rollups[p].result(p) for p in sorted(rollups)]
