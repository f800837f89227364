"""What operators and agents ask of nodes through the API: enrollment and its bring-ups,
operator actions (cordon, drain, maintenance, hardware replaced, retire), power through the BMC,
agents' credentials and heartbeats. Refusals are domain errors (`services/errors.py`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from datetime import timedelta

from anyio import to_thread
from temporalio.client import Client
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import (
    reconcile_now,
    running_node_operations,
    start_bringup_batches,
    start_node_power,
)
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.models.api_schemas import EnrollResult
from gpucloud.models.messages import BmcPowerInput
from gpucloud.models.tables import Node, NodeEnroll, NodePublic, NodeTransition, Operation
from gpucloud.services import agent_credentials
from gpucloud.services.errors import Conflict, NotFound
from gpucloud.services.fleet import (
    LIFECYCLE_ACTIONS,
    NodeStateConflict,
    apply_lifecycle_action,
    apply_operator_action,
    judge_heartbeats,
    record_heartbeats,
)
from gpucloud.services.nodes import enroll_nodes, held_for_bringup, lease_for_bringup
from gpucloud.services.operations import start_for_operation
from gpucloud.services.workflow_engine import engine_error, log_undelivered

log = logging.getLogger(__name__)


def _record_enrollment(
    db: Database, settings: Settings, nodes: Sequence[NodeEnroll], running: int
) -> tuple[list[str], int, int, int]:
    with db.session() as session:
        new, known = enroll_nodes(session, nodes)
        session.flush()
        # Within the global limit on node operations, as the sweep counts it (running operations
        # and the nodes bring-up batches hold); the sweep starts the rest as room frees up.
        budget = max(0, settings.reconciler.max_concurrent_node_ops - running - held_for_bringup(session))
        # New nodes, and known ones still waiting for a bring-up nobody holds (it was lost).
        candidates = [*new, *known]
        to_start = lease_for_bringup(session, candidates[:budget], deadline_scale=settings.reconciler.deadline_scale)
        return to_start, len(new), len(known), max(0, len(candidates) - budget)


async def enroll(db: Database, temporal: Client, settings: Settings, nodes: Sequence[NodeEnroll]) -> EnrollResult:
    """Record the nodes, then bring them up in batches (`BringupBatchWorkflow`), as many as the
    global limit on node operations has room for; the reconciler's sweep starts the rest (and
    any whose start failed after the commit, once the hold runs out)."""
    try:
        running = await running_node_operations(temporal, settings.temporal.task_queue)
    except RPCError as exc:
        raise engine_error(exc, what="the enrollment", left="nothing was enrolled") from exc
    to_start, new, known, deferred = await to_thread.run_sync(_record_enrollment, db, settings, nodes, running)
    batches = await start_bringup_batches(temporal, settings, to_start)
    return EnrollResult(
        enrolled=new, already_known=known, bringups_started=len(to_start), batches=batches, deferred=deferred
    )


def _act(db: Database, node_id: str, action: str, reason: str, actor: str) -> tuple[Node, Operation]:
    with db.session() as session:
        node = session.get(Node, node_id)
        if node is None:
            raise NotFound("node", node_id)
        try:
            if action in LIFECYCLE_ACTIONS:
                op = apply_lifecycle_action(session, node, action, actor=actor, cause=reason or action)
            else:
                op = apply_operator_action(session, node, action, actor=actor, cause=reason or action)
        except NodeStateConflict as exc:
            raise Conflict(str(exc), type_="node-state-conflict", title="Node in another state") from None
        session.flush()
        session.refresh(node)
        return node, op


async def operator_action(
    db: Database, temporal: Client, settings: Settings, node_id: str, action: str, *, reason: str, actor: str
) -> tuple[Node, Operation]:
    """Record an operator's action on a node (`services.fleet`), then set what it calls for going:
    the reconciler on a drain or a replaced part now, a retired node's power-off."""
    node, op = await to_thread.run_sync(_act, db, node_id, action, reason, actor)
    if action in ("drain", "hardware_replaced"):  # the reconciler starts on it now, not at the next sweep
        await reconcile_now(temporal, settings, [node_id])
    if action == "retire" and node.bmc_url:
        # Out of the fleet: powered off through its BMC (durable; recorded in the node's events).
        cause = f"retired: {reason}" if reason else "retired"
        command = BmcPowerInput(node_id=node_id, action="off", cause=cause, actor=actor)
        try:
            await start_node_power(temporal, settings, command)
        except RPCError as exc:
            log_undelivered(log, exc, f"power-off of retired node {node_id}", "power it off by hand")
    return node, op


def _power_operation(db: Database, node_id: str, action: str, reason: str, actor: str) -> tuple[NodePublic, Operation]:
    with db.session() as session:
        node = session.get(Node, node_id)
        if node is None:
            raise NotFound("node", node_id)
        if not node.has_bmc:
            raise Conflict(
                f"node {node_id} has no BMC: enroll it again with bmc_url, bmc_system_id and bmc_credential_ref",
                type_="node-without-bmc",
                title="Node without a BMC",
            )
        op = Operation(kind=f"node_power_{action}", resource_id=node_id, actor=actor)
        session.add(op)
        session.add(
            NodeTransition.noted(
                node, f"power_{action}_requested", cause=reason or action, actor=actor, at=op.created_at
            )
        )
        session.flush()
        session.refresh(op)
        return NodePublic.model_validate(node, from_attributes=True), op


async def power(
    db: Database, temporal: Client, settings: Settings, node_id: str, action: str, *, reason: str, actor: str
) -> tuple[NodePublic, Operation]:
    """Record a power action through the node's BMC and start it; its operation settles when the
    BMC's power state shows it (or at once, failed, if the workflow engine refuses it)."""
    node, op = await to_thread.run_sync(_power_operation, db, node_id, action, reason, actor)
    cause = f"{actor}: {reason}" if reason else actor
    command = BmcPowerInput(node_id=node_id, action=action, cause=cause, actor=actor, operation_id=op.id)
    await start_for_operation(start_node_power(temporal, settings, command), db, op.id, "the power action")
    return node, op


def issue_agent_credential(db: Database, node_id: str) -> str:
    """A credential for the node's host agent, replacing any earlier one (the token, once)."""
    with db.session() as session:
        try:
            return agent_credentials.issue(session, node_id)
        except agent_credentials.UnknownNode:
            raise NotFound("node", node_id) from None


def _record_heartbeats(db: Database, beats: list[dict], refresh: timedelta) -> list[str]:
    # Most reports change nothing: they are judged on a reader's connection (one select, no ORM
    # session around it), and only one that calls for a write takes the writer's (where it is
    # judged again, under the write lock).
    with db.read_connection() as connection:
        drifted, writes = judge_heartbeats(connection, beats, refresh_after=refresh)
    if not writes:
        return drifted
    with db.session() as session:
        return record_heartbeats(session, beats, refresh_after=refresh)


async def heartbeats(db: Database, temporal: Client, settings: Settings, beats: list[dict]) -> list[str]:
    """Store what agents report; a node whose report disagrees with the record is reconciled at
    once. Returns the drifted nodes."""
    refresh = timedelta(seconds=settings.agent.heartbeat_timeout_s / 3)
    drifted = await to_thread.run_sync(functools.partial(_record_heartbeats, db, beats, refresh))
    if drifted:
        await reconcile_now(temporal, settings, drifted)
    return drifted
