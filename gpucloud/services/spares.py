"""Spare capacity per pool: what each pool (GPU type and region) needs so that drain-and-replace
finds a spare for a pulled node, beside what it holds now, and an operator alert while it holds
too few.

Per pool, over the window (`health.spares_window_s`, 30 days):

- **nodes**: those in the fleet now (neither retired nor RMA, as the catalogue counts them);
- **failures**: the node incidents detected within the window (`services/incidents.py`: every
  health pull opens one), attributed to the node's pool, less those abandoned before the node
  was ever pulled (`health.reliability`, the same count as the MTBF's);
- **node-hours**: each node's hours in the fleet within the window, from its enrolment to now
  (to when it entered its state, for one that has left the fleet);
- **rate**: with at least `health.spares_min_node_hours` observed, the pool's own record's
  Garwood upper bound (`health.spares.estimate_failure_rate`; `rate_source` "measured"),
  else the Llama 3 405B run's ("llama3_default");
- **spares needed**: `health.spares.plan_spares` at `health.spares_probability`, with the
  turnaround (`health.spares_repair_s`) less the replacement target
  (`health.spares_replacement_target_s`): a node back from repair within the target serves as
  well as a spare, so only the failures of the last (turnaround − target) hours need one;
- **spares held**: the nodes a reservation could take now (`catalog.allocatable`: available,
  healthy, neither reserved, cordoned nor in maintenance).

`pool_spares` is the read (the API and CLI); `check_spares` is the periodic check the
reconciler's full sweep runs every `health.spares_check_interval_s`: it sets the
`gpucloud_spares{pool,kind}` gauges, and from the same record (`services/reliability.py`, read
once) the MTBF, MTTR and MTTS gauges per rack and pool, and keeps one open `spares_shortfall`
operator alert per pool short of spares. The alert table has no "resolved" column: a pool that
recovers (or has no nodes left) gets a `spares_recovered` record, and a pool's alert is open
while its latest record of the two kinds is a shortfall.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, func, select

from gpucloud.config import Settings
from gpucloud.health.spares import LLAMA3_405B_FAILURES_PER_NODE_HOUR, estimate_failure_rate, plan_spares
from gpucloud.models.api_schemas import FleetSpares, PoolSpares, RateSource
from gpucloud.models.health_tables import OperatorAlertRecord
from gpucloud.models.tables import Node, utcnow
from gpucloud.services import reliability
from gpucloud.services.catalog import fleet_offers
from gpucloud.services.health import pool_of
from gpucloud.web import metrics

SHORTFALL = "spares_shortfall"
RECOVERED = "spares_recovered"
MEASURED: RateSource = "measured"
LLAMA3_DEFAULT: RateSource = "llama3_default"
_HOUR = 3600.0
# Two checks (two workers' sweeps) take turns on Postgres, so a pool gets one open alert.
_CHECK_LOCK = int.from_bytes(hashlib.blake2b(b"spares-check", digest_size=8).digest(), "big", signed=True)


@dataclass(frozen=True)
class SparesPolicy:
    window: timedelta = timedelta(days=30)
    repair_hours: float = 72.0
    replacement_target_hours: float = 0.0
    probability: float = 0.99
    min_node_hours: float = 20_000.0
    confidence: float = 0.95  # of the measured rate's upper bound

    @classmethod
    def of(cls, settings: Settings) -> SparesPolicy:
        health = settings.health
        return cls(
            window=timedelta(seconds=health.spares_window_s),
            repair_hours=health.spares_repair_s / _HOUR,
            replacement_target_hours=health.spares_replacement_target_s / _HOUR,
            probability=health.spares_probability,
            min_node_hours=health.spares_min_node_hours,
        )

    @property
    def uncovered_hours(self) -> float:
        """The part of a node's turnaround a spare must stand in for."""
        return max(self.repair_hours - self.replacement_target_hours, 0.0)


DEFAULT_POLICY = SparesPolicy()


def pool_name(gpu_type: str, region: str) -> str:
    """The pool as the circuit breaker names it (`services.health.pool_of`, of a transient node
    that has only the two fields it reads), so the alerts of both kinds name pools alike."""
    return pool_of(Node(gpu_type=gpu_type, region=region))  # type: ignore[call-arg]


def pool_spares(session: Session, *, now: datetime | None = None, policy: SparesPolicy = DEFAULT_POLICY) -> FleetSpares:
    """Every pool with nodes in the fleet: its record over the window, the rate planned on, the
    spares it needs and holds. Reads only: aggregates over the node table and the window's
    incidents."""
    now = now or utcnow()
    record = reliability.read_record(session, start=now - policy.window, now=now)
    return _pools(session, record, policy)


def _pools(session: Session, record: reliability.Record, policy: SparesPolicy) -> FleetSpares:
    offers = fleet_offers(session)
    hours = record.pool_node_hours()
    failures = record.pool_failures()
    pools = []
    for offer in offers:
        key = (offer.gpu_type, offer.region)
        pools.append(
            _plan(
                offer.gpu_type,
                offer.region,
                nodes=offer.nodes,
                held=offer.available_nodes,
                failures=failures.get(key, 0),
                node_hours=hours.get(key, 0.0),
                policy=policy,
            )
        )
    return FleetSpares(at=record.now, window_s=policy.window.total_seconds(), pools=pools)


def _plan(
    gpu_type: str, region: str, *, nodes: int, held: int, failures: int, node_hours: float, policy: SparesPolicy
) -> PoolSpares:
    if node_hours >= policy.min_node_hours:
        rate = estimate_failure_rate(failures=failures, node_hours=node_hours, confidence=policy.confidence)
        per_node_hour, source = rate.upper_per_node_hour, MEASURED
    else:
        per_node_hour, source = LLAMA3_405B_FAILURES_PER_NODE_HOUR, LLAMA3_DEFAULT
    plan = plan_spares(
        pool=pool_name(gpu_type, region),
        nodes=nodes,
        spares_held=held,
        repair_hours=policy.uncovered_hours,
        probability=policy.probability,
        failures_per_node_hour=per_node_hour,
    )
    return PoolSpares(
        pool=plan.pool,
        gpu_type=gpu_type,
        region=region,
        nodes=nodes,
        spares_held=held,
        spares_needed=plan.spares_needed,
        shortfall=plan.shortfall,
        failures=failures,
        node_hours=node_hours,
        measured_per_node_hour=failures / node_hours if node_hours > 0 else None,
        failures_per_node_hour=per_node_hour,
        rate_source=source,
        repair_hours=policy.repair_hours,
        replacement_target_hours=policy.replacement_target_hours,
        probability=policy.probability,
        expected_out=plan.expected_out,
        coverage_held=plan.coverage_held,
        spare_on_failure=plan.spare_on_failure,
    )


@dataclass
class SparesCheck:
    spares: FleetSpares
    raised: list[str] = field(default_factory=list)  # pools whose shortfall alert this check opened
    recovered: list[str] = field(default_factory=list)  # pools whose open alert this check closed


def check_spares(
    session: Session, *, now: datetime | None = None, policy: SparesPolicy = DEFAULT_POLICY
) -> SparesCheck:
    """The periodic check: the gauges (spares, and MTBF, MTTR and MTTS from the same record),
    an alert for each pool newly short of spares, and a recovery record for each whose alert is
    open and that holds enough again (or has no nodes left). A pool already alerted and still
    short gets nothing new."""
    now = now or utcnow()
    if session.get_bind().dialect.name == "postgresql":
        session.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CHECK_LOCK})
    record = reliability.read_record(session, start=now - policy.window, now=now)
    spares = _pools(session, record, policy)
    reliability.set_gauges(record.reliability())
    check = SparesCheck(spares=spares)
    open_alerts = open_shortfalls(session)
    by_pool = {p.pool: p for p in spares.pools}
    for pool in spares.pools:
        metrics.SPARES.labels(pool.pool, "needed").set(pool.spares_needed)
        metrics.SPARES.labels(pool.pool, "held").set(pool.spares_held)
        if pool.shortfall > 0 and pool.pool not in open_alerts:
            session.add(OperatorAlertRecord(kind=SHORTFALL, pool=pool.pool, reason=_short_reason(pool), at=now))
            check.raised.append(pool.pool)
        elif pool.shortfall == 0 and pool.pool in open_alerts:
            reason = f"pool {pool.pool} holds {pool.spares_held} spare nodes of {pool.spares_needed} needed"
            session.add(OperatorAlertRecord(kind=RECOVERED, pool=pool.pool, reason=reason, at=now))
            check.recovered.append(pool.pool)
    for gone in sorted(open_alerts - by_pool.keys()):
        session.add(
            OperatorAlertRecord(kind=RECOVERED, pool=gone, reason=f"pool {gone} has no nodes in the fleet", at=now)
        )
        check.recovered.append(gone)
    return check


def open_shortfalls(session: Session) -> set[str]:
    """The pools whose latest spares record is a shortfall alert (not yet recovered)."""
    latest = (
        select(col(OperatorAlertRecord.pool).label("pool"), func.max(col(OperatorAlertRecord.seq)).label("seq"))
        .where(col(OperatorAlertRecord.kind).in_([SHORTFALL, RECOVERED]), col(OperatorAlertRecord.pool).is_not(None))
        .group_by(col(OperatorAlertRecord.pool))
        .subquery()
    )
    rows = session.exec(
        select(col(OperatorAlertRecord.pool))
        .join(latest, col(OperatorAlertRecord.seq) == latest.c.seq)
        .where(col(OperatorAlertRecord.kind) == SHORTFALL)
    ).all()
    return {pool for pool in rows if pool is not None}


def _short_reason(pool: PoolSpares) -> str:
    target = "at once" if pool.replacement_target_hours == 0 else f"within {pool.replacement_target_hours:g} h"
    return (
        f"pool {pool.pool} holds {pool.spares_held} spare nodes, needs {pool.spares_needed} "
        f"(short {pool.shortfall}) for a pulled node's replacement to start {target} with probability "
        f"{pool.probability:g}: {pool.nodes} nodes, {pool.failures_per_node_hour:.3g} failures per node-hour "
        f"({pool.rate_source.replace('_', ' ')}), {pool.repair_hours:g} h turnaround"
    )
