"""The reconciler's sweep: find the nodes that need work (indexed queries only), apply what the
plan says to the DB (deadline transitions, reachability) with compare-and-swap, and start the
per-node operations under a global limit and a per-node exponential backoff.

A converged fleet costs one set of indexed queries that return nothing: no starts, no writes.
Only a sweep that finds a silent node counts how much of the fleet is silent (one aggregate):
a silence that wide holds every power action and raises an alert (`plan.plan_sweep`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from datetime import timedelta

import httpx
import sqlalchemy as sa
from pydantic import ValidationError
from sqlmodel import Session, col, select
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import WorkflowAlreadyStartedError

from gpucloud.activities import ActivityGroup
from gpucloud.activities.fabric import ControllerFactory, fabric_node
from gpucloud.activities.heartbeats import beats_while_awaited
from gpucloud.adapters.temporal_gateway import (
    running_node_operations,
    start_bringup_batches,
    start_node_operation,
)
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.fabric import membership
from gpucloud.fabric.interface import FabricError, FabricVerificationError
from gpucloud.health.pulls import PullKind, pulling_since
from gpucloud.models.health_tables import OperatorAlertRecord
from gpucloud.models.messages import (
    DiagnosisInput,
    NodeOperationInput,
    NodeOperationKind,
    SweepInput,
    SweepResult,
)
from gpucloud.models.node_states import NodeEvent, NodeState
from gpucloud.models.tables import Allocation, Node, utcnow
from gpucloud.protocol.actions import ActionAnswer, Diagnosis
from gpucloud.reconciler.plan import FleetSilence, NodePlan, NodeSnapshot, backoff, plan_sweep
from gpucloud.services import (
    agent_credentials,
    diagnostics,
    fleet_kind_incidents,
    health,
    idempotency_records,
    node_conditions,
    pulls,
    spares,
)
from gpucloud.services import nodes as node_service
from gpucloud.services.recovery import adopt_orphans
from gpucloud.web import metrics

log = logging.getLogger(__name__)

# Nodes whose credential was revoked with their allocation: they cannot report, so their
# silence is no news (the reconciler never marks them unreachable for it).
_REVOKED = agent_credentials.REVOKED_NODES
# Nodes whose agents are expected to report: heard from before, neither gone (RMA, retired) nor
# under maintenance (which may power a host off), nor revoked.
_EXPECTED_TO_REPORT = sa.and_(
    col(Node.last_heartbeat_at).is_not(None),
    col(Node.state).not_in([NodeState.RMA.value, NodeState.RETIRED.value]),
    col(Node.maintenance) == False,
    col(Node.id).not_in(_REVOKED),
)


CONTROL_PLANE_SUSPECT = "control_plane_suspect"


def candidate_filter(now, heartbeat_cutoff, power_cycle_cutoff=None):
    """Nodes that may need work: each term is served by an index on its column."""
    down = (
        # A host down past the power-cycle delay, with a BMC to act through (`plan.host_down`).
        sa.and_(
            col(Node.agent_reachable) == False,
            col(Node.last_heartbeat_at) < power_cycle_cutoff,
            col(Node.bmc_url).is_not(None),
            col(Node.state).in_([s.value for s in (NodeState.AVAILABLE, NodeState.ACTIVE, NodeState.QUARANTINED)]),
            col(Node.maintenance) == False,
        )
        if power_cycle_cutoff is not None
        else sa.false()
    )
    return sa.or_(
        down,
        col(Node.deadline_at) <= now,
        col(Node.state).in_([NodeState.ENROLLED.value, NodeState.INSPECTING.value]),
        # Burn-in a bring-up batch handed back (its agent went silent): retried with backoff.
        sa.and_(col(Node.state) == NodeState.BURN_IN.value, col(Node.reconcile_attempts) > 0),
        sa.and_(col(Node.drain_requested) == True, col(Node.state) != NodeState.QUARANTINED.value),
        col(Node.drifted) == True,
        sa.and_(
            col(Node.last_heartbeat_at) < heartbeat_cutoff,
            col(Node.agent_reachable) == True,
            col(Node.id).not_in(_REVOKED),
        ),
        sa.and_(col(Node.last_heartbeat_at) >= heartbeat_cutoff, col(Node.agent_reachable) == False),
        sa.and_(
            col(Node.state) == NodeState.QUARANTINED.value,
            col(Node.health) != "ok",
            col(Node.maintenance) == False,
            col(Node.agent_reachable) == True,
        ),
        # A bad node its allocation still holds (the replace signal may have been lost), or one
        # its allocation let go of before pulling it.
        sa.and_(
            col(Node.allocation_id).is_not(None),
            col(Node.health) != "ok",
            col(Node.state).in_([s.value for s in (NodeState.ACTIVE, NodeState.RESERVED, NodeState.PROVISIONING)]),
        ),
        sa.and_(col(Node.state) == NodeState.AVAILABLE.value, col(Node.health) != "ok"),
    )


# What the planner sees of a node, read by name off the row (`has_bmc` is the row's property);
# the conditions become a tuple, so a snapshot shares nothing mutable with the row.
_SNAPSHOT = tuple(
    f.name for f in dataclasses.fields(NodeSnapshot) if f.name not in ("health_conditions", "reports_revoked")
)


def _snapshot(node: Node, *, reports_revoked: bool) -> NodeSnapshot:
    read = {name: getattr(node, name) for name in _SNAPSHOT}
    return NodeSnapshot(**read, health_conditions=tuple(node.health_conditions or ()), reports_revoked=reports_revoked)


def fleet_silence(session: Session, heartbeat_cutoff) -> FleetSilence:
    """How many nodes are expected to report, and how many of them are silent past the cutoff."""
    reporting, silent = session.exec(
        select(
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(sa.case((col(Node.last_heartbeat_at) < heartbeat_cutoff, 1), else_=0)), 0),
        ).where(_EXPECTED_TO_REPORT)
    ).one()
    return FleetSilence(reporting=reporting, silent=silent)


class FabricHeld(Exception):
    """An overdue node's fabric membership could not be taken away (a manager down or refusing)."""


class ReconcilerActivities(ActivityGroup):
    def __init__(
        self, client: Client, db: Database, settings: Settings, *, fabric: ControllerFactory | None = None
    ) -> None:
        """`fabric`: the fabric managers (None: none configured), for a deadline that takes a
        node out of its allocation: its membership goes first."""
        self.client = client
        self.db = db
        self.settings = settings
        self._fabric = fabric
        # When this worker's next full sweep checks spare capacity (monotonic; 0: the first).
        self._spares_due = 0.0
        # When this worker's next full sweep looks for idle nodes due for a diagnostic (likewise).
        self._diagnostics_due = 0.0

    @activity.defn
    @beats_while_awaited
    async def sweep(self, req: SweepInput) -> SweepResult:
        started = time.perf_counter()
        result = await self._sweep(req)
        if req.node_ids is None:  # a full sweep (a targeted one is a health pull's nudge)
            metrics.SWEEP_SECONDS.observe(time.perf_counter() - started)
            metrics.SWEEP_NODES.labels("candidates").set(result.candidates)
            metrics.SWEEP_NODES.labels("started").set(result.started)
            metrics.SWEEP_NODES.labels("deferred_by_limit").set(result.deferred_by_limit)
        return result

    async def _sweep(self, req: SweepInput) -> SweepResult:
        result = SweepResult()
        if req.node_ids is None:
            # Allocations and tenant operations whose workflow was lost get it back.
            result.adopted = await adopt_orphans(self.client, self.db, self.settings)
            result.idempotency_expired = await asyncio.to_thread(
                idempotency_records.delete_expired, self.db, now=utcnow()
            )
            await self._check_spares_if_due(result)
            await self._diagnose_if_due(result)
            await self._follow_fleet_incidents(result)
        plans = await asyncio.to_thread(self._plan_and_apply, req, result)
        health_pulls = [p.node_id for p in plans if p.pull != PullKind.NONE]
        if health_pulls:
            held_back = await asyncio.to_thread(self._breaker_held, health_pulls)
            plans = [p for p in plans if p.node_id not in held_back]
        replaces = [p for p in plans if p.pull == PullKind.REPLACE]
        if replaces:
            await self._signal_replacements(replaces, result)
        drains = [p.decision() for p in plans if p.pull == PullKind.DRAIN]
        if drains:  # their incidents (a replacement's opens in `carry_out`); the drains start below
            await pulls.open_incidents(self.client, self.settings, drains)
        starts = [p for p in plans if p.start is not None]
        if not starts:
            return result
        budget = await self._room()
        # Bring-ups go in batches (one workflow per batch); every other operation per node.
        bringups = [p.node_id for p in starts if p.start == NodeOperationKind.BRINGUP]
        starts = [p for p in starts if p.start != NodeOperationKind.BRINGUP]
        if bringups:
            budget = await self._start_bringups(bringups, budget, result)
        started_ids: list[str] = []
        for plan in starts:
            if budget <= 0:
                result.deferred_by_limit += 1
                continue
            try:
                await start_node_operation(
                    self.client,
                    self.settings,
                    NodeOperationInput(
                        node_id=plan.node_id,
                        operation=plan.start,
                        allocation_id=plan.allocation_id,
                        tenant_id=plan.tenant_id,
                    ),
                )
                result.started += 1
                budget -= 1
            except WorkflowAlreadyStartedError:
                result.already_running += 1
            started_ids.append(plan.node_id)
        await asyncio.to_thread(self._record_attempts, started_ids)
        return result

    async def _check_spares_if_due(self, result: SweepResult) -> None:
        """Spare capacity per pool, every `health.spares_check_interval_s` of this worker's
        sweeps (a few aggregate queries, not worth every 15 s): the gauges, and an operator alert
        for a pool short of spares. Its failure is reported, not the sweep's."""
        if time.monotonic() < self._spares_due:
            return
        self._spares_due = time.monotonic() + self.settings.health.spares_check_interval_s
        try:
            await asyncio.to_thread(self._check_spares)
        except Exception as exc:  # the sweep's own work goes on; the next interval tries again
            log.exception("spares check failed")
            result.errors.append(f"spares check: {exc}")

    async def _diagnose_if_due(self, result: SweepResult) -> None:
        """Idle nodes due for a scheduled diagnostic (`services/diagnostics.py`), every
        `health.diag_check_interval_s` of this worker's sweeps: leased within the fleet-wide
        budget and the node operations' limit, then each one's diagnose started under the node's
        single-flight id (a node another operation holds is given back at once). Its failure is
        reported, not the sweep's."""
        if time.monotonic() < self._diagnostics_due:
            return
        self._diagnostics_due = time.monotonic() + self.settings.health.diag_check_interval_s
        try:
            if await asyncio.to_thread(self._wanted_for_diagnosis) == 0:
                return  # nothing due, or no room in the budget: no more queries
            room = await self._room()
            leases = await asyncio.to_thread(self._lease_for_diagnosis, room) if room > 0 else []
            for taken in leases:
                inp = NodeOperationInput(node_id=taken.node_id, operation=NodeOperationKind.DIAGNOSE, lease=taken.lease)
                try:
                    await start_node_operation(self.client, self.settings, inp)
                    result.diagnostics_started += 1
                except WorkflowAlreadyStartedError:
                    await asyncio.to_thread(self._release_diagnosis, taken.node_id, taken.lease)
        except Exception as exc:  # the sweep's own work goes on; the leases lapse on their own
            log.exception("diagnostics scheduling failed")
            result.errors.append(f"diagnostics: {exc}")

    def _wanted_for_diagnosis(self) -> int:
        with self.db.session() as session:
            return diagnostics.wanted(session, diagnostics.DiagnosticPolicy.of(self.settings))

    def _lease_for_diagnosis(self, limit: int) -> list[diagnostics.DiagnosticLease]:
        with self.db.session() as session:
            return diagnostics.lease_due(session, diagnostics.DiagnosticPolicy.of(self.settings), limit=limit)

    def _release_diagnosis(self, node_id: str, lease: str) -> None:
        with self.db.session() as session:
            diagnostics.release(session, node_id, lease)

    @activity.defn
    async def record_diagnosis(self, req: DiagnosisInput) -> bool:
        """A diagnose's end (`NodeOperationWorkflow._diagnose`): its findings judged and the lease
        released (`diagnostics.record`), and each pull's incident opened. True when the findings
        drain the node: the diagnose's workflow, which holds the node's single-flight id, drives
        the drain itself."""
        diagnosis, failure = None, req.failure
        if req.answer is not None:
            try:
                diagnosis = ActionAnswer.model_validate(req.answer).diagnosis
            except ValidationError as exc:
                failure = f"the agent's answer cannot be read: {exc.error_count()} errors"
            else:
                if diagnosis is None:
                    failure = "the agent's answer carries no diagnosis"
        outcomes = await asyncio.to_thread(self._record_diagnosis, req, diagnosis, failure)
        pulled = [o for o in outcomes if o.pull != PullKind.NONE]
        if not pulled or diagnosis is None:
            return False
        fault_at = min(min(o.at for o in diagnosis.observations), utcnow())
        decisions = [
            dataclasses.replace(o.decision(fault_at=fault_at), since=pulling_since(o.verdict.conditions))
            for o in pulled
        ]
        await pulls.open_incidents(self.client, self.settings, decisions)
        # A leased node is nobody's: its pull is a drain (a replacement would be its allocation's).
        return any(o.pull == PullKind.DRAIN for o in pulled)

    def _record_diagnosis(
        self, req: DiagnosisInput, diagnosis: Diagnosis | None, failure: str | None
    ) -> list[health.HealthOutcome]:
        with self.db.session() as session:
            return diagnostics.record(
                session,
                req.node_id,
                req.lease,
                diagnosis,
                failure=failure,
                breaker=health.BreakerSettings.of(self.settings),
            )

    async def _follow_fleet_incidents(self, result: SweepResult) -> None:
        """Start the workflow of each fleet-kind incident nobody follows (a start the engine
        refused when the judgement wrote it; an open fleet incident without its incident gets
        one). Its failure is reported, not the sweep's."""
        try:
            starts = await asyncio.to_thread(self._fleet_incidents_to_start)
            if starts:
                result.incidents_started = len(await pulls.open_fleet_incidents(self.client, self.settings, starts))
        except Exception as exc:  # the sweep's own work goes on; the next sweep tries again
            log.exception("fleet incidents not followed")
            result.errors.append(f"fleet incidents: {exc}")

    def _fleet_incidents_to_start(self) -> list[fleet_kind_incidents.IncidentStart]:
        stale_after = timedelta(seconds=3 * self.settings.health.incident_poll_s)
        with self.db.session() as session:
            return fleet_kind_incidents.to_start(session, now=utcnow(), stale_after=stale_after)

    def _check_spares(self) -> spares.SparesCheck:
        with self.db.session() as session:
            return spares.check_spares(session, policy=spares.SparesPolicy.of(self.settings))

    async def _signal_replacements(self, plans: list[NodePlan], result: SweepResult) -> None:
        """Ask allocation workflows (again) to replace nodes the health rules want out. The
        workflow ignores a node it is already replacing; per-node backoff spaces the repeats."""
        decisions = [p.decision() for p in plans if p.allocation_id is not None]  # a replace names it
        undelivered = await pulls.carry_out(self.client, self.settings, decisions)
        result.replace_signals += len(decisions) - len(undelivered)
        for decision, exc in undelivered:  # the allocation's workflow is gone: nothing to replace into
            result.errors.append(f"replace {decision.node_id} in {decision.allocation_id}: {exc}")
        await asyncio.to_thread(self._record_attempts, [d.node_id for d in decisions])

    def _breaker_held(self, node_ids: list[str]) -> set[str]:
        since = utcnow() - timedelta(seconds=self.settings.health.breaker_window_s)
        with self.db.session() as session:
            return {
                node_id
                for node_id in session.exec(
                    select(col(OperatorAlertRecord.node_id)).where(
                        col(OperatorAlertRecord.node_id).in_(node_ids),
                        col(OperatorAlertRecord.kind) == "circuit_breaker",
                        col(OperatorAlertRecord.at) > since,
                    )
                ).all()
                if node_id is not None
            }

    async def _start_bringups(self, node_ids: list[str], budget: int, result: SweepResult) -> int:
        if budget < len(node_ids):
            result.deferred_by_limit += len(node_ids) - budget
            node_ids = node_ids[:budget]
        leased = await asyncio.to_thread(self._lease_for_bringup, node_ids)
        result.already_running += len(node_ids) - len(leased)
        result.bringup_batches += await start_bringup_batches(self.client, self.settings, leased)
        result.started += len(leased)
        return budget - len(leased)

    @activity.defn
    @beats_while_awaited
    async def start_waiting_bringups(self) -> SweepResult:
        """A bring-up batch that is done hands its room to enrolled nodes still waiting (an
        enrolment beyond `max_concurrent_node_ops` defers the rest) at once, within the same
        limit, instead of leaving it idle until the next sweep."""
        result = SweepResult()
        waiting = await asyncio.to_thread(self._waiting_for_bringup, self.settings.reconciler.max_concurrent_node_ops)
        if not waiting:
            return result
        await self._start_bringups(waiting, await self._room(), result)
        return result

    async def _room(self) -> int:
        """Node operations that may start now: the global limit less those running and the
        nodes bring-up batches hold."""
        running = await running_node_operations(self.client, self.settings.temporal.task_queue)
        held = await asyncio.to_thread(self._held_for_bringup)
        return max(0, self.settings.reconciler.max_concurrent_node_ops - running - held)

    def _waiting_for_bringup(self, limit: int) -> list[str]:
        with self.db.session() as session:
            return node_service.waiting_for_bringup(session, limit)

    def _lease_for_bringup(self, node_ids: list[str]) -> list[str]:
        with self.db.session() as session:
            return node_service.lease_for_bringup(
                session, node_ids, deadline_scale=self.settings.reconciler.deadline_scale
            )

    def _held_for_bringup(self) -> int:
        with self.db.session() as session:
            return node_service.held_for_bringup(session)

    def _plan_and_apply(self, req: SweepInput, result: SweepResult) -> list[NodePlan]:
        now = utcnow()
        timeout = timedelta(seconds=self.settings.agent.heartbeat_timeout_s)
        cycle_after = timedelta(seconds=self.settings.bmc.power_cycle_after_s)
        with self.db.session() as session:
            query = (
                select(Node)
                .where(
                    candidate_filter(now, now - timeout, now - cycle_after),
                    sa.or_(col(Node.next_reconcile_at).is_(None), col(Node.next_reconcile_at) <= now),
                )
                .limit(self.settings.reconciler.sweep_batch)
            )
            if req.node_ids is not None:
                query = select(Node).where(col(Node.id).in_(req.node_ids))
            nodes = list(session.exec(query).all())
            revoked = agent_credentials.revoked(session, [n.id for n in nodes])
            heard_of_silence = any(
                not n.agent_reachable or (n.last_heartbeat_at is not None and n.last_heartbeat_at < now - timeout)
                for n in nodes
            )
            silence = fleet_silence(session, now - timeout) if heard_of_silence else FleetSilence()
        result.candidates = len(nodes)
        sweep = plan_sweep(
            [_snapshot(n, reports_revoked=n.id in revoked) for n in nodes],
            now=now,
            heartbeat_timeout=timeout,
            power_cycle_after=cycle_after,
            silence=silence,
            max_silent_share=self.settings.reconciler.silence_max_share,
            min_silent_nodes=self.settings.reconciler.silence_min_nodes,
        )
        if sweep.alert is not None:
            result.power_held = True
            self._alert_once(sweep.alert, now=now)
        plans = []
        by_id = {n.id: n for n in nodes}
        for plan in sweep.plans:
            node = by_id[plan.node_id]
            try:
                self._off_fabric_first(node, plan)
                self._apply(node, plan, result)
            except FabricHeld as exc:
                # The node keeps its deadline's state until its membership is gone: the next
                # sweep tries again (a node still on a tenant's fabric never reaches the pool).
                result.errors.append(str(exc))
                continue
            except node_service.StaleNode as exc:
                # Someone moved the node first; the next sweep sees its new state.
                result.errors.append(str(exc))
                continue
            plans.append(plan)
        return plans

    def _alert_once(self, reason: str, *, now) -> None:
        """One control-plane-suspect alert per breaker window while the silence lasts."""
        since = now - timedelta(seconds=self.settings.health.breaker_window_s)
        with self.db.session() as session:
            already = session.exec(
                select(col(OperatorAlertRecord.seq)).where(
                    col(OperatorAlertRecord.kind) == CONTROL_PLANE_SUSPECT, col(OperatorAlertRecord.at) > since
                )
            ).first()
            if already is None:
                session.add(OperatorAlertRecord(kind=CONTROL_PLANE_SUSPECT, reason=reason, at=now))

    def _off_fabric_first(self, node: Node, plan: NodePlan) -> None:
        """A deadline that takes a node out of its allocation (a reservation, a provision or a
        release overdue) takes its fabric membership away first, as the allocation's own steps
        do: the allocation's workflow may be stuck on the very outage that made it overdue."""
        if (
            self._fabric is None
            or plan.state_after_deadline is None
            or node.allocation_id is None
            or NodeState(plan.state_after_deadline) not in node_service.LEAVES_ALLOCATION
        ):
            return
        with self.db.session() as session:
            tenant_id = session.exec(
                select(col(Allocation.tenant_id)).where(col(Allocation.id) == node.allocation_id)
            ).first()
        if tenant_id is None:
            return  # no such allocation: nothing was applied for it
        try:
            with self._fabric() as controller:
                membership.remove_nodes(controller, node.allocation_id, tenant_id, [fabric_node(node)])
        except (FabricError, FabricVerificationError, httpx.HTTPError) as exc:
            raise FabricHeld(
                f"{node.id}: overdue, but its membership of {node.allocation_id} could not be removed: {exc}"
            ) from exc

    def _apply(self, node: Node, plan: NodePlan, result: SweepResult) -> None:
        with self.db.session() as session:
            if plan.deadline_passed:
                node_service.transition(
                    session,
                    node.id,
                    NodeEvent.DEADLINE,
                    from_state=node.state,
                    cause="; ".join(plan.reasons),
                    actor="reconciler",
                    deadline_scale=self.settings.reconciler.deadline_scale,
                )
                result.deadlines_applied += 1
            if plan.set_reachable is not None:
                fresh = session.get(Node, node.id)
                if fresh is not None:
                    now = utcnow()
                    values = node_conditions.reachability(
                        fresh, reachable=plan.set_reachable, reason="; ".join(plan.reasons), now=now
                    )
                    node_conditions.write(session, node.id, values, now=now)
                if plan.set_reachable:
                    result.marked_reachable += 1
                else:
                    result.marked_unreachable += 1

    def _record_attempts(self, node_ids: list[str]) -> None:
        if not node_ids:
            return
        now = utcnow()
        with self.db.session() as session:
            for node in session.exec(select(Node).where(col(Node.id).in_(node_ids))).all():
                node.reconcile_attempts += 1
                node.next_reconcile_at = now + backoff(
                    node.reconcile_attempts,
                    base_s=self.settings.reconciler.backoff_base_s,
                    cap_s=self.settings.reconciler.backoff_cap_s,
                )
                session.add(node)
