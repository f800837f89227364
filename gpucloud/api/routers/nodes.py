"""Nodes (operator only): enrollment by the fleet, listing and reading, operator actions and
events, the fleet summary, agents' credentials and heartbeats (health is `health.py`)."""

from __future__ import annotations

import logging
from datetime import timedelta

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import (
    reconcile_now,
    running_node_operations,
    start_bringup_batches,
    start_node_power,
)
from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import (
    FleetOperatorDep,
    LedgerReporterDep,
    ReadOperatorDep,
    ReadsDep,
    ReporterDep,
    SettingsDep,
    TemporalDep,
)
from gpucloud.api.routers import agents
from gpucloud.api.routers.health import own_node_only
from gpucloud.api.schemas import (
    AgentCredentialIssued,
    EnrollRequest,
    EnrollResult,
    FleetSummary,
    HeartbeatResult,
    LedgerToken,
    MaintenanceRequest,
    NodeActionResult,
    NodeEventPage,
    NodeEventPublic,
    NodePage,
    OperatorActionRequest,
    PowerRequest,
)
from gpucloud.config import Settings
from gpucloud.db import get_read_engine, session_scope
from gpucloud.models.messages import BmcPowerInput
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodePublic, NodeTransition, Operation, OperationPublic
from gpucloud.protocol.reports import HeartbeatBatch
from gpucloud.services import agent_credentials
from gpucloud.services.fleet import (
    LIFECYCLE_ACTIONS,
    NodeStateConflict,
    apply_lifecycle_action,
    apply_operator_action,
    judge_heartbeats,
    record_heartbeats,
    summary,
)
from gpucloud.services.nodes import enroll_nodes, held_for_bringup, lease_for_bringup
from gpucloud.services.operations import start_for_operation
from gpucloud.services.workflow_engine import engine_problem, log_undelivered
from gpucloud.web.problems import Problem, not_found
from gpucloud.web.service_tokens import LEDGER_AUDIENCE

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["nodes"])


def _enroll(settings: Settings, req: EnrollRequest, running: int) -> tuple[list[str], int, int, int]:
    with session_scope(settings.database_url) as session:
        new, known = enroll_nodes(session, req.nodes)
        session.flush()
        # Within the global limit on node operations, as the sweep counts it (running operations
        # and the nodes bring-up batches hold); the sweep starts the rest as room frees up.
        budget = max(0, settings.reconciler.max_concurrent_node_ops - running - held_for_bringup(session))
        # New nodes, and known ones still waiting for a bring-up nobody holds (it was lost).
        candidates = [*new, *known]
        to_start = lease_for_bringup(session, candidates[:budget], deadline_scale=settings.reconciler.deadline_scale)
        return to_start, len(new), len(known), max(0, len(candidates) - budget)


@router.post("/nodes:enroll", response_model=EnrollResult)
async def enroll(req: EnrollRequest, operator: FleetOperatorDep, settings: SettingsDep, temporal: TemporalDep):
    """Records the nodes, then brings them up in batches (`BringupBatchWorkflow`), as many as the
    global limit on node operations has room for; the reconciler's sweep starts the rest (and
    any whose start failed after the commit, once the hold runs out)."""
    try:
        running = await running_node_operations(temporal, settings.temporal.task_queue)
    except RPCError as exc:
        raise engine_problem(exc, what="the enrollment", left="nothing was enrolled") from exc
    to_start, new, known, deferred = await run_in_threadpool(_enroll, settings, req, running)
    batches = await start_bringup_batches(temporal, settings, to_start)
    return EnrollResult(
        enrolled=new, already_known=known, bringups_started=len(to_start), batches=batches, deferred=deferred
    )


@router.get("/nodes", response_model=NodePage)
def list_nodes(
    operator: ReadOperatorDep,
    reads: ReadsDep,
    page: pagination.PageDep,
    state: NodeState | None = None,
    gpu_type: str | None = None,
    region: str | None = None,
):
    with reads() as session:
        rows, token = pagination.fetch(
            session, Node, "id", page=page, equal={"state": state, "gpu_type": gpu_type, "region": region}
        )
        return NodePage(items=[NodePublic.model_validate(n, from_attributes=True) for n in rows], next_page_token=token)


@router.get("/nodes/{node_id}", response_model=NodePublic)
def get_node(node_id: str, operator: ReadOperatorDep, reads: ReadsDep):
    with reads() as session:
        node = session.get(Node, node_id)
        if node is None:
            raise not_found("node", node_id)
        return NodePublic.model_validate(node, from_attributes=True)


# ---------------------------------------------------------------- operator actions and events


def _act(settings: Settings, node_id: str, action: str, reason: str, actor: str) -> tuple[Node, Operation]:
    with session_scope(settings.database_url) as session:
        node = session.get(Node, node_id)
        if node is None:
            raise not_found("node", node_id)
        try:
            if action in LIFECYCLE_ACTIONS:
                op = apply_lifecycle_action(session, node, action, actor=actor, cause=reason or action)
            else:
                op = apply_operator_action(session, node, action, actor=actor, cause=reason or action)
        except NodeStateConflict as exc:
            raise Problem(409, "node-state-conflict", "Node in another state", str(exc)) from None
        session.flush()
        session.refresh(node)
        return node, op


async def _operator_action(
    node_id: str, action: str, reason: str, operator: Caller, settings: Settings, temporal
) -> JSONResponse:
    node, op = await run_in_threadpool(_act, settings, node_id, action, reason, operator.id)
    if action in ("drain", "hardware_replaced"):  # the reconciler starts on it now, not at the next sweep
        await reconcile_now(temporal, settings, [node_id])
    if action == "retire" and node.bmc_url:
        # Out of the fleet: powered off through its BMC (durable; recorded in the node's events).
        cause = f"retired: {reason}" if reason else "retired"
        command = BmcPowerInput(node_id=node_id, action="off", cause=cause, actor=operator.id)
        try:
            await start_node_power(temporal, settings, command)
        except RPCError as exc:
            log_undelivered(log, exc, f"power-off of retired node {node_id}", "power it off by hand")
    body = NodeActionResult(
        node=NodePublic.model_validate(node, from_attributes=True),
        operation=OperationPublic.model_validate(op, from_attributes=True),
    )
    return JSONResponse(body.model_dump(mode="json"), status_code=202 if op.status == "running" else 200)


@router.post("/nodes/{node_id}/cordon", response_model=NodeActionResult)
async def cordon(
    node_id: str,
    operator: FleetOperatorDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    return await _operator_action(node_id, "cordon", req.reason if req else "", operator, settings, temporal)


@router.post("/nodes/{node_id}/uncordon", response_model=NodeActionResult)
async def uncordon(
    node_id: str,
    operator: FleetOperatorDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    return await _operator_action(node_id, "uncordon", req.reason if req else "", operator, settings, temporal)


@router.post("/nodes/{node_id}/drain", response_model=NodeActionResult, status_code=202)
async def drain(
    node_id: str,
    operator: FleetOperatorDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    """Intent: the node is cordoned now and drained by the reconciler (-> quarantined)."""
    return await _operator_action(node_id, "drain", req.reason if req else "", operator, settings, temporal)


@router.post("/nodes/{node_id}/maintenance", response_model=NodeActionResult)
async def maintenance(
    node_id: str, req: MaintenanceRequest, operator: FleetOperatorDep, settings: SettingsDep, temporal: TemporalDep
):
    action = "maintenance_on" if req.enabled else "maintenance_off"
    return await _operator_action(node_id, action, req.reason, operator, settings, temporal)


def _power_operation(settings: Settings, node_id: str, req: PowerRequest, actor: str) -> tuple[NodePublic, Operation]:
    with session_scope(settings.database_url) as session:
        node = session.get(Node, node_id)
        if node is None:
            raise not_found("node", node_id)
        if not node.has_bmc:
            raise Problem(
                409,
                "node-without-bmc",
                "Node without a BMC",
                f"node {node_id} has no BMC: enroll it again with bmc_url, bmc_system_id and bmc_credential_ref",
            )
        op = Operation(kind=f"node_power_{req.action}", resource_id=node_id, actor=actor)
        session.add(op)
        session.add(
            NodeTransition.noted(
                node,
                f"power_{req.action}_requested",
                cause=req.reason or req.action,
                actor=actor,
                at=op.created_at,
            )
        )
        session.flush()
        session.refresh(op)
        return NodePublic.model_validate(node, from_attributes=True), op


@router.post(
    "/nodes/{node_id}/power",
    response_model=NodeActionResult,
    status_code=202,
    responses={404: {"description": "no such node"}, 409: {"description": "the node has no BMC"}},
)
async def power(
    node_id: str, req: PowerRequest, operator: FleetOperatorDep, settings: SettingsDep, temporal: TemporalDep
):
    """Power the node on or off, or cycle it, through its BMC (Redfish): the operation finishes
    once the BMC's power state shows it (a cycle: off, then on), and the node's events keep the
    BMC's answer. The node's state is left as it is: a node powered off is found by the
    reconciler when its agent falls silent."""
    node, op = await run_in_threadpool(_power_operation, settings, node_id, req, operator.id)
    cause = f"{operator.id}: {req.reason}" if req.reason else operator.id
    command = BmcPowerInput(node_id=node_id, action=req.action, cause=cause, actor=operator.id, operation_id=op.id)
    await start_for_operation(
        start_node_power(temporal, settings, command), settings.database_url, op.id, "the power action"
    )
    body = NodeActionResult(node=node, operation=OperationPublic.model_validate(op, from_attributes=True))
    return JSONResponse(body.model_dump(mode="json"), status_code=202)


@router.post(
    "/nodes/{node_id}/hardware-replaced",
    response_model=NodeActionResult,
    responses={404: {"description": "no such node"}, 409: {"description": "the node is not in RMA"}},
)
async def hardware_replaced(
    node_id: str,
    operator: FleetOperatorDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    """The vendor replaced the node's faulty part (RMA): the node is enrolled again and goes
    through inspection, wipe and burn-in before it rejoins the pool."""
    return await _operator_action(node_id, "hardware_replaced", req.reason if req else "", operator, settings, temporal)


@router.post(
    "/nodes/{node_id}/retire",
    response_model=NodeActionResult,
    responses={
        404: {"description": "no such node"},
        409: {"description": "the node is not in RMA, quarantined or enrolled"},
    },
)
async def retire(
    node_id: str,
    operator: FleetOperatorDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    """Take a node out of the fleet for good (from RMA, quarantine, or before its first bring-up)."""
    return await _operator_action(node_id, "retire", req.reason if req else "", operator, settings, temporal)


@router.get("/nodes/{node_id}/events", response_model=NodeEventPage)
def node_events(node_id: str, operator: ReadOperatorDep, reads: ReadsDep, page: pagination.PageDep):
    with reads() as session:
        if session.get(Node, node_id) is None:
            raise not_found("node", node_id)
        rows, token = pagination.fetch(session, NodeTransition, "seq", page=page, equal={"node_id": node_id})
        return NodeEventPage(
            items=[NodeEventPublic.model_validate(e, from_attributes=True) for e in rows], next_page_token=token
        )


@router.get("/fleet/summary", response_model=FleetSummary)
def fleet_summary(operator: ReadOperatorDep, reads: ReadsDep) -> FleetSummary:
    """Node counts by state, health, GPU type and region; cordoned and unreachable nodes."""
    with reads(snapshot=True) as session:  # counts that add up
        return FleetSummary.model_validate(summary(session))


def _record(settings: Settings, batch: HeartbeatBatch) -> list[str]:
    beats = [b.model_dump() for b in batch.heartbeats]
    refresh = timedelta(seconds=settings.agent.heartbeat_timeout_s / 3)
    # Most reports change nothing: they are judged on a reader's connection (one select, no ORM
    # session around it), and only one that calls for a write takes the writer's (where it is
    # judged again, under the write lock).
    with get_read_engine(settings.database_url).connect() as connection:
        drifted, writes = judge_heartbeats(connection, beats, refresh_after=refresh)
    if not writes:
        return drifted
    with session_scope(settings.database_url) as session:
        return record_heartbeats(session, beats, refresh_after=refresh)


@router.post("/nodes/{node_id}/agent-credential", response_model=AgentCredentialIssued, status_code=201)
def issue_agent_credential(request: Request, node_id: str, operator: FleetOperatorDep, settings: SettingsDep):
    """A credential for the node's host agent, replacing any earlier one; it reports for this
    node only (heartbeats, XID events, readings) and opens nothing else."""
    with session_scope(settings.database_url) as session:
        try:
            token = agent_credentials.issue(session, node_id)
        except agent_credentials.UnknownNode:
            raise not_found("node", node_id) from None
    # The one it replaced ends here at once (other API processes: within the cache's TTL).
    request.app.state.credentials.forget(f"gpa_{node_id}")
    return AgentCredentialIssued(node_id=node_id, token=token)


@agents.router.post(
    "/agents/ledger-token",
    response_model=LedgerToken,
    tags=["nodes"],
    responses={501: {"description": "this API process holds no delegate key to sign ledger tokens with"}},
)
def ledger_token(caller: LedgerReporterDep, request: Request) -> LedgerToken:
    """A token for the billing ledger: an agent's posts usage for its own node only; an
    operator's (the simulated fleet ships for every node) may post usage for any, and change the
    books, so it needs `billing`. Signed by the API's delegate key (`bootstrap.api_token_issuer`)."""
    issuer = request.app.state.issuer
    if issuer is None:
        raise Problem(
            501,
            "billing-not-configured",
            "Billing is not configured",
            "this API process holds no delegate key to sign ledger tokens with (`gpucloud issue-delegate` makes one)",
        )
    if caller.role == "agent":
        token, expires_at = issuer.mint_until(LEDGER_AUDIENCE, subject=f"node:{caller.node_id}", role="agent")
    else:
        token, expires_at = issuer.mint_until(LEDGER_AUDIENCE, subject=caller.id, role="operator")
    return LedgerToken(token=token, expires_at=expires_at)


@agents.router.post("/agents/heartbeats", response_model=HeartbeatResult, tags=["nodes"])
async def heartbeats(batch: HeartbeatBatch, caller: ReporterDep, settings: SettingsDep, temporal: TemporalDep):
    """Agents report what they see; a disagreement with the record is reconciled at once."""
    own_node_only(caller, [b.node_id for b in batch.heartbeats], most=1)
    drifted = await run_in_threadpool(_record, settings, batch)
    if drifted:
        await reconcile_now(temporal, settings, drifted)
    return HeartbeatResult(accepted=len(batch.heartbeats), drifted=drifted)
