"""The health service: XID events and counter readings in, a judged node and a decision to
pull it out.

`ingest_xids` stores events (stamped with the tenant and allocation the node's record shows),
`ingest_signals` the signals beyond XIDs (`SignalReport`s: kernel log, InfiniBand sysfs; stamped
the same way, pruned to what the signal table still looks at), `ingest_readings` the agents'
periodic readings (pruned to the trend window); each re-judges every node it touched with
`health.rules.evaluate_node` over its stored events, signals and readings, writes its health
and conditions, and decides what to do about a drain-level verdict: a drain-level
signal (a port down, a NIC, host maintenance, silent data corruption) pulls the node as a fatal
XID does; an application signal (an NCCL timeout, a hung workload) never does. A node of an
allocation (active, or still reserved or provisioning for it) is replaced inside the allocation
(the caller signals the allocation workflow); an idle one is drained by the reconciler. Every
automatic pull asks the pool's circuit breaker first, whose window is rebuilt from
`QuarantinePull` rows and whose check-and-record is a compare-and-swap on the pool's
`QuarantineBreaker` row; a refusal is an operator alert and no pull, and joins the incident of
the pool's trip (`services.fleet_kind_incidents`).

Before the breaker, topology (`services.fleet_incidents`): when the node's every recent fault
lies in a burst of faults behind one leaf switch, rack or PDU (`health.correlation`), it is not
pulled: the burst's nodes join one fleet incident that suspects the component (cordoned, one
operator alert, one incident record of kind `fleet`), and ask the breaker nothing. A node an
open incident holds is not pulled until an operator resolves it; resolving clears what came
before (`cleared_at`), as a burn-in does.

The breaker's budget is counted per owner within a pool (`budget_of`): a tenant's nodes (those
an allocation of its holds) spend the tenant's own budget, sized by its share of the pool, and
every other node the platform's. A tenant has root on its nodes and writes what their agents
report: fatal XIDs from its own nodes can use up only its own budget, never open the breaker on
another tenant's faulty node or on the platform's idle ones.

What is decided is carried out by `services.pulls`, through the workflow engine.

`repair_plan` picks the next rung of the repair ladder for a node in `repairing`, or none (the
lemon rule, or the ladder is exhausted: RMA).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, func, or_, select

from gpucloud.config import Settings
from gpucloud.db import rowcount
from gpucloud.health.breaker import BreakerState, CircuitBreaker, OperatorAlert, Pull
from gpucloud.health.correlation import DEFAULT_CORRELATION_POLICY, CorrelationPolicy
from gpucloud.health.pulls import HELD, PullDecision, PullKind, pulls, replace_at_once
from gpucloud.health.rules import evaluate_node
from gpucloud.health.signals import SIGNAL_TABLE
from gpucloud.health.verdict import Action, Condition, HealthPolicy, HealthVerdict, action_rank
from gpucloud.health.xid import RESET_PENDING
from gpucloud.models.health_tables import (
    NodeReadingRecord,
    OperatorAlertRecord,
    QuarantineBreaker,
    QuarantinePull,
    SignalObservationRecord,
    XidEventRecord,
)
from gpucloud.models.node_states import NodeEvent, NodeState
from gpucloud.models.tables import Node, NodeTransition, utcnow
from gpucloud.protocol.actions import REPAIR_LADDER
from gpucloud.protocol.reports import NodeReading, SignalObservation, SignalReport, XidEvent
from gpucloud.services import breaker_window, fleet_incidents, fleet_kind_incidents, node_conditions

# Who the health loop is in the node's history (its cordons are lifted by a passed burn-in).
HEALTH_ACTOR = "health"
# A node no allocation holds: drained by the reconciler.
_DRAINABLE = frozenset({NodeState.ACTIVE, NodeState.AVAILABLE})
# A compare-and-swap lost to a concurrent pull means a re-count; this many in a row means the
# pool is being pulled from faster than it can be counted, which is itself alarming.
BREAKER_CAS_ATTEMPTS = 50


@dataclass(frozen=True)
class BreakerSettings:
    max_pulled_share: float = 0.05
    window: timedelta = timedelta(hours=1)
    # What makes a burst behind a shared component (asked before the breaker).
    correlation: CorrelationPolicy = DEFAULT_CORRELATION_POLICY

    @classmethod
    def of(cls, settings: Settings) -> BreakerSettings:
        health = settings.health
        return cls(
            max_pulled_share=health.breaker_max_pulled_share,
            window=timedelta(seconds=health.breaker_window_s),
            correlation=CorrelationPolicy(
                window=timedelta(seconds=health.correlation_window_s),
                min_nodes=health.correlation_min_nodes,
                min_share=health.correlation_min_share,
            ),
        )


# Signals whose rows act below drain level: `judge_signals` looks at them for `trend_window` only.
_WATCH_SIGNALS = sorted(
    signal.value for signal, row in SIGNAL_TABLE.items() if action_rank(row.action) < action_rank(Action.DRAIN)
)

# Defaults shared by every call that passes none (neither is changed after it is made).
DEFAULT_POLICY = HealthPolicy()
DEFAULT_BREAKER = BreakerSettings()


@dataclass
class HealthOutcome:
    node_id: str
    verdict: HealthVerdict
    pull: PullKind = PullKind.NONE
    allocation_id: str | None = None
    immediate: bool = False  # the fault is already fatal to the job: no grace period
    reason: str = ""
    alert: str | None = None
    # The fleet-kind incident (a burst that holds the node, a breaker trip that refused it) whose
    # workflow the caller starts after the commit (`services.pulls.act_on`).
    incident: fleet_kind_incidents.IncidentStart | None = None

    def decision(self, *, fault_at: datetime | None = None) -> PullDecision:
        return PullDecision(
            node_id=self.node_id,
            kind=self.pull,
            allocation_id=self.allocation_id,
            reason=self.reason,
            immediate=self.immediate,
            fault_at=fault_at,
        )


def pool_of(node: Node) -> str:
    return f"{node.gpu_type}/{node.region}"


def budget_of(node: Node) -> tuple[str, str | None]:
    """The breaker budget a pull of this node spends (its key) and the tenant that owns it (None:
    the platform, for a node no tenant's allocation holds)."""
    tenant = node.tenant_id if node.allocation_id is not None else None
    return (pool_of(node) if tenant is None else f"{pool_of(node)} tenant {tenant}"), tenant


def cleared_at(session: Session, node_id: str) -> datetime | None:
    """When the node last passed burn-in, or left a fleet incident an operator resolved: what
    came before is dealt with (lemon rule aside)."""
    return session.exec(
        select(func.max(col(NodeTransition.at))).where(
            col(NodeTransition.node_id) == node_id,
            or_(
                sa.and_(
                    col(NodeTransition.from_state) == NodeState.BURN_IN.value,
                    col(NodeTransition.to_state) == NodeState.AVAILABLE.value,
                ),
                col(NodeTransition.event) == fleet_incidents.RESOLVED_EVENT,
            ),
        )
    ).one()


def judge(session: Session, node: Node, *, now: datetime, policy: HealthPolicy) -> HealthVerdict:
    rows = session.exec(
        select(XidEventRecord).where(
            col(XidEventRecord.node_id) == node.id, col(XidEventRecord.timestamp) >= now - policy.lemon_window
        )
    ).all()
    events = [XidEvent.model_validate(r, from_attributes=True) for r in rows]
    cleared = cleared_at(session, node.id)
    return evaluate_node(
        events=events,
        readings=stored_readings(session, node.id, now=now, policy=policy),
        now=now,
        cleared_at=cleared,
        policy=policy,
        expected_gpu_count=node.gpu_count,
        signals=stored_signals(session, node.id, now=now, policy=policy, since=cleared),
    )


def stored_signals(
    session: Session, node_id: str, *, now: datetime, policy: HealthPolicy, since: datetime | None = None
) -> list[SignalObservation]:
    """The node's signal observations the signal table looks at: the lemon window's, after `since`
    (the node's last passed burn-in: what came before is dealt with)."""
    query = select(SignalObservationRecord).where(
        col(SignalObservationRecord.node_id) == node_id,
        col(SignalObservationRecord.at) >= now - policy.lemon_window,
    )
    if since is not None:
        query = query.where(col(SignalObservationRecord.at) > since)
    rows = session.exec(query.order_by(col(SignalObservationRecord.at), col(SignalObservationRecord.seq))).all()
    return [
        SignalObservation(
            signal=r.signal,
            at=r.at,
            source=r.source,
            count=r.count,
            span=None if r.span_s is None else timedelta(seconds=r.span_s),
            detail=r.detail,
        )
        for r in rows
    ]


def stored_readings(session: Session, node_id: str, *, now: datetime, policy: HealthPolicy) -> list[NodeReading]:
    """The node's readings the rules look at: the trend window's, and fatal ones for the lemon rule."""
    rows = session.exec(
        select(col(NodeReadingRecord.reading))
        .where(
            col(NodeReadingRecord.node_id) == node_id,
            col(NodeReadingRecord.timestamp) >= now - policy.lemon_window,
            or_(col(NodeReadingRecord.fatal), col(NodeReadingRecord.timestamp) >= now - policy.trend_window),
        )
        .order_by(col(NodeReadingRecord.timestamp))
    ).all()
    return [NodeReading.model_validate(r) for r in rows]


def ingest_xids(
    session: Session,
    events: Iterable[XidEvent],
    *,
    source: str,
    now: datetime | None = None,
    policy: HealthPolicy = DEFAULT_POLICY,
    breaker: BreakerSettings = DEFAULT_BREAKER,
) -> tuple[list[HealthOutcome], list[str]]:
    """Store and judge; returns the outcome per known node and the ids of unknown nodes."""
    now = now or utcnow()
    by_node: dict[str, list[XidEvent]] = {}
    for event in events:
        by_node.setdefault(event.node_id, []).append(event)
    nodes = {n.id: n for n in session.exec(select(Node).where(col(Node.id).in_(list(by_node)))).all()}
    for node_id, node_events in by_node.items():
        node = nodes.get(node_id)
        if node is None:
            continue
        session.add_all(
            XidEventRecord(
                **e.model_dump(include={"gpu_index", "gpu_uuid", "xid", "timestamp", "message"}),
                node_id=node_id,
                source=source,
                # From the control plane's record: an agent (root for the tenant on the node)
                # could otherwise blame another tenant for an application XID.
                tenant_id=node.tenant_id,
                allocation_id=node.allocation_id,
            )
            for e in node_events
        )
    session.flush()
    outcomes = _judge_all(session, [nodes[n] for n in by_node if n in nodes], now=now, policy=policy, breaker=breaker)
    return outcomes, [n for n in by_node if n not in nodes]


def ingest_signals(
    session: Session,
    reports: Iterable[SignalReport],
    *,
    source: str,
    now: datetime | None = None,
    policy: HealthPolicy = DEFAULT_POLICY,
    breaker: BreakerSettings = DEFAULT_BREAKER,
) -> tuple[list[HealthOutcome], list[str]]:
    """Store and judge, as `ingest_xids` does; returns the outcome per known node and the ids of
    unknown nodes (whose reports are not stored). `source` says who sent them (`agent`, or the
    operator whose batch carried them), stored as `reported_by`.

    Observations the signal table no longer looks at are pruned on the way: past the lemon
    window all, past the trend window those of signals below drain level.
    """
    now = now or utcnow()
    by_node: dict[str, list[SignalObservation]] = {}
    for report in reports:
        by_node.setdefault(report.node_id, []).extend(report.observations)
    nodes = {n.id: n for n in session.exec(select(Node).where(col(Node.id).in_(list(by_node)))).all()}
    for node_id, observations in by_node.items():
        node = nodes.get(node_id)
        if node is None:
            continue
        session.add_all(
            SignalObservationRecord(
                node_id=node_id,
                signal=o.signal.value,
                source=o.source,
                count=o.count,
                span_s=None if o.span is None else o.span.total_seconds(),
                at=o.at,
                detail=o.detail,
                # From the control plane's record, as for XIDs: never what the agent claims.
                tenant_id=node.tenant_id,
                allocation_id=node.allocation_id,
                reported_by=source,
                received_at=now,
            )
            for o in observations
        )
        session.execute(
            sa.delete(SignalObservationRecord).where(
                col(SignalObservationRecord.node_id) == node_id,
                or_(
                    col(SignalObservationRecord.at) < now - policy.lemon_window,
                    sa.and_(
                        col(SignalObservationRecord.at) < now - policy.trend_window,
                        col(SignalObservationRecord.signal).in_(_WATCH_SIGNALS),
                    ),
                ),
            )
        )
    session.flush()
    outcomes = _judge_all(session, [nodes[n] for n in by_node if n in nodes], now=now, policy=policy, breaker=breaker)
    return outcomes, [n for n in by_node if n not in nodes]


def ingest_readings(
    session: Session,
    readings: Iterable[NodeReading],
    *,
    now: datetime | None = None,
    policy: HealthPolicy = DEFAULT_POLICY,
    breaker: BreakerSettings = DEFAULT_BREAKER,
) -> tuple[list[HealthOutcome], list[str]]:
    """Store and judge; returns the outcome per node and the ids of unknown nodes.

    All or nothing: when any reading names an unknown node, nothing is stored (the agent that
    sent it is misconfigured, and half a batch judged would hide that).
    """
    now = now or utcnow()
    by_node: dict[str, list[NodeReading]] = {}
    for reading in readings:
        by_node.setdefault(reading.node_id, []).append(reading)
    nodes = {n.id: n for n in session.exec(select(Node).where(col(Node.id).in_(list(by_node)))).all()}
    unknown = [n for n in by_node if n not in nodes]
    if unknown:
        return [], unknown
    for node_id, node_readings in by_node.items():
        session.add_all(
            NodeReadingRecord(
                node_id=node_id,
                timestamp=r.timestamp,
                fatal=r.fatal_error is not None,
                reading=r.model_dump(mode="json"),
                received_at=now,
            )
            for r in node_readings
        )
        # The trend rules look back `trend_window`; only fatal readings count for longer.
        session.execute(
            sa.delete(NodeReadingRecord).where(
                col(NodeReadingRecord.node_id) == node_id,
                col(NodeReadingRecord.timestamp) < now - policy.trend_window,
                or_(~col(NodeReadingRecord.fatal), col(NodeReadingRecord.timestamp) < now - policy.lemon_window),
            )
        )
    session.flush()
    return _judge_all(session, list(nodes.values()), now=now, policy=policy, breaker=breaker), []


def judge_again(
    session: Session,
    node_ids: Iterable[str],
    *,
    now: datetime | None = None,
    policy: HealthPolicy = DEFAULT_POLICY,
    breaker: BreakerSettings = DEFAULT_BREAKER,
) -> list[HealthOutcome]:
    """Judge nodes and decide again on what is stored (a resolved fleet incident's nodes)."""
    nodes = list(session.exec(select(Node).where(col(Node.id).in_(sorted(set(node_ids))))).all())
    return _judge_all(session, nodes, now=now or utcnow(), policy=policy, breaker=breaker)


def _judge_all(
    session: Session, nodes: list[Node], *, now: datetime, policy: HealthPolicy, breaker: BreakerSettings
) -> list[HealthOutcome]:
    # Pool by pool, node by node: two ingests lock the breaker and node rows in the same order,
    # so on Postgres they queue behind each other instead of deadlocking.
    decided = {
        n.id: _judge_and_decide(session, n, now=now, policy=policy, breaker=breaker)
        for n in sorted(nodes, key=lambda n: (budget_of(n)[0], n.id))
    }
    return [decided[n.id] for n in nodes]


def _judge_and_decide(
    session: Session, node: Node, *, now: datetime, policy: HealthPolicy, breaker: BreakerSettings
) -> HealthOutcome:
    verdict = judge(session, node, now=now, policy=policy)
    node_conditions.write(session, node.id, node_conditions.judged(node, verdict), now=now)
    outcome = HealthOutcome(node_id=node.id, verdict=verdict)
    replace = node.state in HELD and node.allocation_id is not None
    reset_first = None if pulls(verdict.action) else _reset_before_next_tenant(node, verdict)
    if not (pulls(verdict.action) or reset_first) or not (replace or node.state in _DRAINABLE):
        return outcome
    if node.drain_requested:
        return outcome  # already on its way out
    worst = reset_first or verdict.conditions[0]
    outcome.reason = f"{worst.name}: {worst.reason}" + ("; reset before the next tenant" if reset_first else "")
    # A shared component explains it (or an open fleet incident holds it): cordoned, not pulled.
    incident = fleet_incidents.hold_if_correlated(session, node, now=now, policy=breaker.correlation)
    if incident is not None:
        outcome.alert = (
            f"held by fleet incident {incident.id}: suspect {incident.component_kind} {incident.component_id}"
        )
        outcome.incident = fleet_kind_incidents.start_of(fleet_kind_incidents.for_burst(session, incident, now=now))
        return outcome
    refused = _ask_breaker(session, node, now=now, settings=breaker)
    if refused is not None:
        outcome.alert, outcome.incident = refused
        return outcome
    # Pulled first: cordoned in the judgement's own transaction, before any workflow acts, so
    # nothing schedules onto the node from here on. A passed burn-in lifts a health cordon.
    if not node.cordoned:
        session.execute(sa.update(Node).where(col(Node.id) == node.id).values(cordoned=True))
        session.add(NodeTransition.noted(node, "cordon", cause=outcome.reason, actor=HEALTH_ACTOR, at=now))
    if replace:
        outcome.pull, outcome.allocation_id = PullKind.REPLACE, node.allocation_id
        outcome.immediate = replace_at_once(NodeState(node.state), verdict.action)
    else:
        # Intent for the reconciler, as an operator's drain records it (the cordon is above).
        session.execute(
            sa.update(Node).where(col(Node.id) == node.id).values(drain_requested=True, next_reconcile_at=None)
        )
        session.add(NodeTransition.noted(node, "drain", cause=outcome.reason, actor=HEALTH_ACTOR, at=now))
        outcome.pull = PullKind.DRAIN
    return outcome


def _reset_before_next_tenant(node: Node, verdict: HealthVerdict) -> Condition | None:
    """The condition a GPU reset settles (`health.xid.RESET_PENDING`: a contained ECC error, a
    row remap pending) on a node idle in the pool: it is drained, reset by the repair ladder's
    first rung and gated by burn-in before anyone gets it. A tenant's node keeps running (the
    wipe after its release resets every GPU)."""
    if node.state != NodeState.AVAILABLE or node.allocation_id is not None:
        return None
    return next((c for c in verdict.conditions if c.name in RESET_PENDING), None)


class BreakerContended(RuntimeError):
    """The pool's breaker word kept changing under this judgement: no decision was taken."""


def _ask_breaker(
    session: Session, node: Node, *, now: datetime, settings: BreakerSettings
) -> tuple[str, fleet_kind_incidents.IncidentStart] | None:
    """Record an allowed pull and return None, or record and return the operator alert, with
    the trip's incident the refusal joined (one per pool and trip, `fleet_kind_incidents`). The
    budget is the node's owner's (`budget_of`): a share of the nodes it owns in the pool.

    Check and record are one compare-and-swap: the pool's breaker generation is read before the
    window is counted, and an allowed pull is recorded only if the generation is still the one
    read. A concurrent judgement that recorded a pull meanwhile made it stale: count again.
    """
    pool, tenant = budget_of(node)
    _ensure_breaker_row(session, pool)
    for _ in range(BREAKER_CAS_ATTEMPTS):
        generation = session.exec(
            select(col(QuarantineBreaker.generation)).where(col(QuarantineBreaker.pool) == pool)
        ).one()
        rows = breaker_window.recent_pulls(session, pool, now=now, window=settings.window)
        state = BreakerState(pulls={pool: [Pull(node_id=r.node_id, at=r.at) for r in rows]})
        pool_size = breaker_window.pool_size(session, gpu_type=node.gpu_type, region=node.region, tenant=tenant)
        decision = CircuitBreaker(
            max_pulled_share=settings.max_pulled_share, window=settings.window, state=state
        ).request_quarantine(pool=pool, node_id=node.id, pool_size=pool_size, now=now)
        if not decision.allowed:
            assert decision.alert is not None  # a refused quarantine always says why
            reason = _record_alert(session, node, decision.alert, now=now, settings=settings)
            # The trip is named by the window's oldest pull: concurrent refusals name the same.
            window_start = min((r.at for r in rows), default=now)
            trip = fleet_kind_incidents.for_trip(
                session, node, decision.alert, tenant=tenant, window_start=window_start, now=now
            )
            return reason, fleet_kind_incidents.start_of(trip)
        if any(r.node_id == node.id for r in rows):
            return None  # pulled in this window already: not counted twice
        swapped = session.execute(
            sa.update(QuarantineBreaker)
            .where(
                col(QuarantineBreaker.pool) == pool,
                col(QuarantineBreaker.generation) == generation,
            )
            .values(generation=generation + 1)
        )
        if rowcount(swapped) == 1:
            session.add(QuarantinePull(pool=pool, node_id=node.id, at=now))
            return None
    raise BreakerContended(f"circuit breaker of pool {pool}: {BREAKER_CAS_ATTEMPTS} compare-and-swaps lost in a row")


def _ensure_breaker_row(session: Session, pool: str) -> None:
    """The pool's breaker row, created on first use; a concurrent creator's row is as good."""
    if session.get(QuarantineBreaker, pool) is not None:
        return
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    session.execute(
        insert(QuarantineBreaker).values(pool=pool, generation=0).on_conflict_do_nothing(index_elements=["pool"])
    )


def _record_alert(
    session: Session, node: Node, alert: OperatorAlert, *, now: datetime, settings: BreakerSettings
) -> str:
    """One alert per node and window; the reason is the breaker's."""
    already = session.exec(
        select(col(OperatorAlertRecord.seq)).where(
            col(OperatorAlertRecord.node_id) == node.id,
            col(OperatorAlertRecord.kind) == "circuit_breaker",
            col(OperatorAlertRecord.at) > now - settings.window,
        )
    ).first()
    if already is None:
        session.add(
            OperatorAlertRecord(kind="circuit_breaker", pool=alert.pool, node_id=node.id, reason=alert.reason, at=now)
        )
    return alert.reason


@dataclass(frozen=True)
class RepairStep:
    rung: int | None  # index into REPAIR_LADDER to start from; None: send the node to RMA
    reason: str


def repair_plan(
    session: Session, node_id: str, *, now: datetime | None = None, policy: HealthPolicy = DEFAULT_POLICY
) -> RepairStep:
    """The rung to try for a node entering repair, counted over this quarantine episode: each
    failed burn-in after a repair sends the node back to quarantine and up one rung."""
    now = now or utcnow()
    node = session.get(Node, node_id)
    if node is None:
        raise LookupError(f"node {node_id} does not exist")
    verdict = judge(session, node, now=now, policy=policy)
    if verdict.action == Action.RMA:
        worst = verdict.conditions[0]
        return RepairStep(None, f"{worst.name}: {worst.reason}")
    episode_start = (
        session.exec(
            select(func.max(col(NodeTransition.seq))).where(
                col(NodeTransition.node_id) == node_id,
                col(NodeTransition.to_state) == NodeState.QUARANTINED.value,
                col(NodeTransition.from_state) != NodeState.BURN_IN.value,
            )
        ).one()
        or 0
    )
    repairs = session.exec(
        select(func.count())
        .select_from(NodeTransition)
        .where(
            col(NodeTransition.node_id) == node_id,
            col(NodeTransition.seq) > episode_start,
            col(NodeTransition.event) == NodeEvent.REPAIR.value,
        )
    ).one()
    rung = max(repairs - 1, 0)
    if rung >= len(REPAIR_LADDER):
        return RepairStep(None, f"repair ladder exhausted ({' -> '.join(REPAIR_LADDER)} did not pass burn-in)")
    return RepairStep(rung, f"repair attempt {rung + 1}: {REPAIR_LADDER[rung]}")
