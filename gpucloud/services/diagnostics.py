"""Scheduled diagnostics of idle nodes (issue 42, active signals): short tests (`dcgmi diag -r 1`,
a single-node NCCL all-reduce, nvbandwidth) on nodes no tenant holds, within a fleet-wide budget,
so idle capacity stays checked rather than found bad by the next tenant.

`lease_due` picks idle nodes (available, healthy, neither cordoned, draining nor in maintenance,
no allocation, no tenant's data, the agent reporting) that have not been tested for
`health.diag_interval_s` (a burn-in counts as a test: a node is due that long after it came back
to the pool) and leases each with a compare-and-swap: `diag_lease` (the lease's id) and
`diag_lease_until`. A reservation never takes a node whose lease has not lapsed
(`catalog.allocatable`, and `allocations.reserve_node`'s own compare-and-swap), and a lease
lapses on its own, so a diagnostic whose worker died gives the node back. The budget is counted
fleet-wide, leases held included: at most `diag_budget_share` of the idle nodes (at least one)
and `diag_max_concurrent`; on Postgres the count and the leases are taken under one advisory
lock, so two sweeps cannot both spend the same room (SQLite's one writer takes turns already).

`record` ends a diagnostic: its findings (signal observations) go through `health.ingest_signals`,
judged by the signal table like any node's signals (a failed `dcgmi diag` drains the node), the
node's `last_diag_at` is set, a `diagnose` event names each tool's check in the node's history
(a tool that is not installed is `not_run`, never a pass), and the lease is released if it is
still this diagnostic's.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, func, select

from gpucloud.config import Settings
from gpucloud.db import rowcount
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodeTransition, utcnow
from gpucloud.protocol.actions import AgentAction, Diagnosis
from gpucloud.protocol.reports import SignalReport
from gpucloud.services import health
from gpucloud.services.catalog import not_diagnosing

# Who the diagnostics are in a node's history, and the event that records one.
DIAGNOSTICS_ACTOR = "diagnostics"
DIAGNOSE_EVENT = AgentAction.DIAGNOSE.value
# The advisory lock the budget is counted under (Postgres): any fixed key of our own.
_BUDGET_LOCK = 0x6469_6167_6E6F_7365 & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class DiagnosticPolicy:
    interval: timedelta = timedelta(hours=24)
    budget_share: float = 0.05
    max_concurrent: int = 16
    lease: timedelta = timedelta(hours=1)

    @classmethod
    def of(cls, settings: Settings) -> DiagnosticPolicy:
        h = settings.health
        return cls(
            interval=timedelta(seconds=h.diag_interval_s),
            budget_share=h.diag_budget_share,
            max_concurrent=h.diag_max_concurrent,
            lease=timedelta(seconds=h.diag_lease_s),
        )

    def budget(self, idle_nodes: int) -> int:
        """How many nodes may be diagnosed at once out of this many idle ones: the share of them
        (rounded down, but at least one, so a small fleet is checked too), at most the cap."""
        if idle_nodes <= 0 or self.budget_share <= 0 or self.max_concurrent <= 0:
            return 0
        return min(self.max_concurrent, max(1, math.floor(self.budget_share * idle_nodes)))


@dataclass(frozen=True)
class DiagnosticLease:
    node_id: str
    lease: str
    until: datetime


def idle() -> tuple[sa.ColumnElement[bool], ...]:
    """Nodes a diagnostic may run on: nobody's, and nothing else is being done to them."""
    return (
        col(Node.state) == NodeState.AVAILABLE.value,
        col(Node.allocation_id).is_(None),
        col(Node.tenant_id).is_(None),
        col(Node.cordoned) == False,
        col(Node.maintenance) == False,
        col(Node.drain_requested) == False,
        col(Node.health) == "ok",
        col(Node.agent_reachable) == True,
    )


# No diagnostic holds the node: never leased, released, or its lease lapsed.
not_leased = not_diagnosing


def _lock_budget(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _BUDGET_LOCK})


def room(session: Session, policy: DiagnosticPolicy, *, now: datetime) -> int:
    """How many more nodes may be leased now: the budget of the idle nodes (leased ones count
    as idle) less the leases held fleet-wide."""
    idle_nodes = session.exec(select(func.count()).select_from(Node).where(*idle())).one()
    held = session.exec(select(func.count()).select_from(Node).where(col(Node.diag_lease_until) > now)).one()
    return max(0, policy.budget(idle_nodes) - held)


def due(session: Session, policy: DiagnosticPolicy, *, now: datetime, limit: int) -> list[str]:
    """Idle, unleased nodes not tested for the interval, longest untested first."""
    cutoff = now - policy.interval
    return list(
        session.exec(
            select(col(Node.id))
            .where(
                *idle(),
                not_leased(now),
                sa.or_(col(Node.last_diag_at).is_(None), col(Node.last_diag_at) <= cutoff),
                col(Node.state_entered_at) <= cutoff,  # back from burn-in within it: tested
            )
            .order_by(func.coalesce(col(Node.last_diag_at), col(Node.state_entered_at)), col(Node.id))
            .limit(limit)
        ).all()
    )


def wanted(session: Session, policy: DiagnosticPolicy, *, now: datetime | None = None) -> int:
    """How many nodes `lease_due` would lease now (budget and due nodes allowing), without
    leasing any: a sweep with nothing to do asks nothing more."""
    now = now or utcnow()
    free = room(session, policy, now=now)
    return len(due(session, policy, now=now, limit=free)) if free > 0 else 0


def lease(session: Session, node_id: str, policy: DiagnosticPolicy, *, now: datetime) -> DiagnosticLease | None:
    """Lease one node for a diagnostic: a compare-and-swap that holds only while the node is idle
    and no other lease holds it (None: it is not, or someone took it first)."""
    lease_id, until = uuid.uuid4().hex, now + policy.lease
    swapped = session.execute(
        sa.update(Node)
        .where(col(Node.id) == node_id, *idle(), not_leased(now))
        .values(diag_lease=lease_id, diag_lease_until=until)
        .execution_options(synchronize_session=False)
    )
    return DiagnosticLease(node_id, lease_id, until) if rowcount(swapped) == 1 else None


def lease_due(
    session: Session, policy: DiagnosticPolicy, *, now: datetime | None = None, limit: int | None = None
) -> list[DiagnosticLease]:
    """Lease the nodes due for a diagnostic, as many as the fleet-wide budget has room for (and
    `limit`, when given: say, the node operations that may start)."""
    now = now or utcnow()
    _lock_budget(session)
    free = room(session, policy, now=now)
    if limit is not None:
        free = min(free, limit)
    if free <= 0:
        return []
    leases = []
    for node_id in due(session, policy, now=now, limit=free):
        taken = lease(session, node_id, policy, now=now)
        if taken is not None:
            leases.append(taken)
    return leases


def release(session: Session, node_id: str, lease_id: str) -> bool:
    """Give the node back, if this lease still holds it (a lapsed one may have been taken anew)."""
    swapped = session.execute(
        sa.update(Node)
        .where(col(Node.id) == node_id, col(Node.diag_lease) == lease_id)
        .values(diag_lease=None, diag_lease_until=None)
        .execution_options(synchronize_session=False)
    )
    return rowcount(swapped) == 1


def record(
    session: Session,
    node_id: str,
    lease_id: str,
    diagnosis: Diagnosis | None,
    *,
    failure: str | None = None,
    now: datetime | None = None,
    breaker: health.BreakerSettings = health.DEFAULT_BREAKER,
) -> list[health.HealthOutcome]:
    """A diagnostic ended: its findings judged (`health.ingest_signals`; the outcomes, whose pulls
    the caller carries out), the node's `last_diag_at` set, the checks (or why none ran) noted in
    its history, the lease released. A diagnostic that could not run counts as one that did for
    the interval: a node whose agent refuses is not asked again at every sweep."""
    now = now or utcnow()
    node = session.get(Node, node_id)
    if node is None:
        return []
    outcomes: list[health.HealthOutcome] = []
    if diagnosis is not None and diagnosis.observations:
        # Dated as the agent says, but never ahead of the control plane's clock.
        observations = [o.model_copy(update={"at": min(o.at, now)}) for o in diagnosis.observations]
        report = SignalReport(node_id=node_id, at=now, observations=observations)
        outcomes, _ = health.ingest_signals(session, [report], source=DIAGNOSTICS_ACTOR, now=now, breaker=breaker)
    summary = diagnosis.summary() if diagnosis is not None else f"not run: {failure or 'no answer'}"
    session.add(NodeTransition.noted(node, DIAGNOSE_EVENT, cause=summary, actor=DIAGNOSTICS_ACTOR, at=now))
    session.execute(
        sa.update(Node)
        .where(col(Node.id) == node_id)
        .values(last_diag_at=now)
        .execution_options(synchronize_session=False)
    )
    release(session, node_id, lease_id)
    return outcomes
