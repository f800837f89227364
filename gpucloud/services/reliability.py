"""The fleet's record over a window, per GPU type, region and rack: each place's node-hours in the
fleet and the node incidents that touch the window; from them its MTBF, MTTR and MTTS
(`health.reliability`) and the `gpucloud_mtbf_hours`, `gpucloud_mttr_seconds` and
`gpucloud_mtts_seconds` gauges.

`read_record` is the reads (two aggregates over the node table, one read of the window's
incidents); `services/spares.py` reads it once per spares check, plans the pools' spares on its
failures and sets the gauges here (`set_gauges`), so the gauges cost nothing per scrape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Session, col, func, or_, select

from gpucloud.health.reliability import IncidentTimes, Place, Reliability, failed_within, reliability
from gpucloud.models.health_tables import Incident
from gpucloud.models.tables import Node
from gpucloud.services.catalog import OUT_OF_FLEET
from gpucloud.web import metrics

_HOUR = 3600.0


@dataclass(frozen=True)
class Record:
    """The fleet's record over (start, now]."""

    start: datetime
    now: datetime
    node_hours: dict[Place, float]
    incidents: list[IncidentTimes]

    def reliability(self) -> list[Reliability]:
        return reliability(self.node_hours, self.incidents, start=self.start, now=self.now)

    def pool_node_hours(self) -> dict[tuple[str, str], float]:
        hours: dict[tuple[str, str], float] = {}
        for (gpu_type, region, _), value in self.node_hours.items():
            hours[(gpu_type, region)] = hours.get((gpu_type, region), 0.0) + value
        return hours

    def pool_failures(self) -> dict[tuple[str, str], int]:
        """Per pool (GPU type and region), the node failures detected within the window."""
        failures: dict[tuple[str, str], int] = {}
        for incident in self.incidents:
            if failed_within(incident, self.start, self.now):
                key = (incident.gpu_type, incident.region)
                failures[key] = failures.get(key, 0) + 1
        return failures


def read_record(session: Session, *, start: datetime, now: datetime) -> Record:
    return Record(
        start=start,
        now=now,
        node_hours=node_hours(session, start=start, now=now),
        incidents=window_incidents(session, start=start, now=now),
    )


def node_hours(session: Session, *, start: datetime, now: datetime) -> dict[Place, float]:
    """Per GPU type, region and rack, its nodes' hours in the fleet within [start, now]: from
    enrolment to now (to when it entered its state, for one that has left the fleet). The nodes
    in the fleet the whole window are counted in SQL; only those enrolled within it or gone since
    its start (few) are read one by one."""
    window_hours = (now - start).total_seconds() / _HOUR
    hours: dict[Place, float] = {}
    whole = session.exec(
        select(col(Node.gpu_type), col(Node.region), col(Node.rack), func.count())
        .where(col(Node.state).not_in(OUT_OF_FLEET), col(Node.created_at) <= start)
        .group_by(col(Node.gpu_type), col(Node.region), col(Node.rack))
    ).all()
    for gpu_type, region, rack, count in whole:
        hours[(gpu_type, region, rack)] = count * window_hours
    partial = session.execute(
        sa.select(
            col(Node.gpu_type),
            col(Node.region),
            col(Node.rack),
            col(Node.state),
            col(Node.created_at),
            col(Node.state_entered_at),
        ).where(
            or_(
                col(Node.created_at) > start,
                sa.and_(col(Node.state).in_(OUT_OF_FLEET), col(Node.state_entered_at) > start),
            )
        )
    ).all()
    for gpu_type, region, rack, state, created_at, left_at in partial:
        begin = max(created_at, start)
        end = min(left_at, now) if state in OUT_OF_FLEET else now
        if end > begin:
            key = (gpu_type, region, rack)
            hours[key] = hours.get(key, 0.0) + (end - begin).total_seconds() / _HOUR
    return hours


def window_incidents(session: Session, *, start: datetime, now: datetime) -> list[IncidentTimes]:
    """The node incidents detected, stabilized or gated within (start, now], each with its node's
    GPU type, region and rack (an incident whose node is gone from the table has no place)."""
    rows = session.execute(
        sa.select(
            col(Node.gpu_type),
            col(Node.region),
            col(Node.rack),
            col(Incident.kind),
            col(Incident.status),
            col(Incident.detected_at),
            col(Incident.pulled_at),
            col(Incident.stabilized_at),
            col(Incident.gated_at),
        )
        .join(Node, col(Node.id) == col(Incident.node_id))
        .where(
            col(Incident.kind) == "node",
            or_(
                sa.and_(col(Incident.detected_at) > start, col(Incident.detected_at) <= now),
                sa.and_(col(Incident.stabilized_at) > start, col(Incident.stabilized_at) <= now),
                sa.and_(col(Incident.gated_at) > start, col(Incident.gated_at) <= now),
            ),
        )
    ).all()
    return [
        IncidentTimes(
            gpu_type=gpu_type,
            region=region,
            rack=rack,
            kind=kind,
            status=status,
            detected_at=detected_at,
            pulled_at=pulled_at,
            stabilized_at=stabilized_at,
            gated_at=gated_at,
        )
        for gpu_type, region, rack, kind, status, detected_at, pulled_at, stabilized_at, gated_at in rows
    ]


def fleet_reliability(session: Session, *, start: datetime, now: datetime) -> list[Reliability]:
    return read_record(session, start=start, now=now).reliability()


# The label sets each gauge showed at the last check: a place that no longer has a value (no
# failure, no repair in the window, or gone) loses its series rather than keep a stale one.
_SHOWN: dict[str, set[Place]] = {}


def set_gauges(rows: list[Reliability]) -> None:
    """Set each place's MTBF, MTTR and MTTS (rack `ROLLUP_RACK` for a pool's rollup), and remove
    the series of a place without a value now."""
    families = (
        ("mtbf", metrics.MTBF_HOURS, lambda r: r.mtbf_h),
        ("mttr", metrics.MTTR_SECONDS, lambda r: r.mttr_s),
        ("mtts", metrics.MTTS_SECONDS, lambda r: r.mtts_s),
    )
    for name, gauge, value_of in families:
        shown: set[Place] = set()
        for row in rows:
            value = value_of(row)
            if value is not None:
                place = (row.gpu_type, row.region, row.rack)
                gauge.labels(*place).set(value)
                shown.add(place)
        for stale in _SHOWN.get(name, set()) - shown:
            with contextlib.suppress(KeyError):  # already gone
                gauge.remove(*stale)
        _SHOWN[name] = shown
