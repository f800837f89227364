"""Nodes (operator only): enrollment by the fleet, listing and reading, operator actions and
events, the fleet summary and spares, agents' credentials and heartbeats (health is `health.py`)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from temporalio.client import Client

from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import (
    DbDep,
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
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.models.api_schemas import (
    AgentCredentialIssued,
    EnrollRequest,
    EnrollResult,
    FleetSpares,
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
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodePublic, NodeTransition, OperationPublic
from gpucloud.protocol.reports import HeartbeatBatch
from gpucloud.services import node_requests, spares
from gpucloud.services.fleet import (
    summary,
)
from gpucloud.web.problems import Problem, not_found
from gpucloud.web.service_tokens import LEDGER_AUDIENCE

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["nodes"])


@router.post("/nodes:enroll", response_model=EnrollResult)
async def enroll(
    req: EnrollRequest, operator: FleetOperatorDep, db: DbDep, settings: SettingsDep, temporal: TemporalDep
):
    """Records the nodes, then brings them up in batches (`BringupBatchWorkflow`), as many as the
    global limit on node operations has room for; the reconciler's sweep starts the rest (and
    any whose start failed after the commit, once the hold runs out)."""
    return await node_requests.enroll(db, temporal, settings, req.nodes)


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


async def _operator_action(
    node_id: str, action: str, reason: str, operator: Caller, db: Database, settings: Settings, temporal: Client
) -> JSONResponse:
    node, op = await node_requests.operator_action(
        db, temporal, settings, node_id, action, reason=reason, actor=operator.id
    )
    body = NodeActionResult(
        node=NodePublic.model_validate(node, from_attributes=True),
        operation=OperationPublic.model_validate(op, from_attributes=True),
    )
    return JSONResponse(body.model_dump(mode="json"), status_code=202 if op.status == "running" else 200)


@router.post("/nodes/{node_id}/cordon", response_model=NodeActionResult)
async def cordon(
    node_id: str,
    operator: FleetOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    return await _operator_action(node_id, "cordon", req.reason if req else "", operator, db, settings, temporal)


@router.post("/nodes/{node_id}/uncordon", response_model=NodeActionResult)
async def uncordon(
    node_id: str,
    operator: FleetOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    return await _operator_action(node_id, "uncordon", req.reason if req else "", operator, db, settings, temporal)


@router.post("/nodes/{node_id}/drain", response_model=NodeActionResult, status_code=202)
async def drain(
    node_id: str,
    operator: FleetOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    """Intent: the node is cordoned now and drained by the reconciler (-> quarantined)."""
    return await _operator_action(node_id, "drain", req.reason if req else "", operator, db, settings, temporal)


@router.post("/nodes/{node_id}/maintenance", response_model=NodeActionResult)
async def maintenance(
    node_id: str,
    req: MaintenanceRequest,
    operator: FleetOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
):
    action = "maintenance_on" if req.enabled else "maintenance_off"
    return await _operator_action(node_id, action, req.reason, operator, db, settings, temporal)


@router.post(
    "/nodes/{node_id}/power",
    response_model=NodeActionResult,
    status_code=202,
    responses={404: {"description": "no such node"}, 409: {"description": "the node has no BMC"}},
)
async def power(
    node_id: str,
    req: PowerRequest,
    operator: FleetOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
):
    """Power the node on or off, or cycle it, through its BMC (Redfish): the operation finishes
    once the BMC's power state shows it (a cycle: off, then on), and the node's events keep the
    BMC's answer. The node's state is left as it is: a node powered off is found by the
    reconciler when its agent falls silent."""
    node, op = await node_requests.power(
        db, temporal, settings, node_id, req.action, reason=req.reason, actor=operator.id
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
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    """The vendor replaced the node's faulty part (RMA): the node is enrolled again and goes
    through inspection, wipe and burn-in before it rejoins the pool."""
    return await _operator_action(
        node_id, "hardware_replaced", req.reason if req else "", operator, db, settings, temporal
    )


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
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    req: OperatorActionRequest | None = None,
):
    """Take a node out of the fleet for good (from RMA, quarantine, or before its first bring-up)."""
    return await _operator_action(node_id, "retire", req.reason if req else "", operator, db, settings, temporal)


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


@router.get("/fleet/spares", response_model=FleetSpares)
def fleet_spares(operator: ReadOperatorDep, reads: ReadsDep, settings: SettingsDep) -> FleetSpares:
    """Spare nodes per pool (GPU type and region): what each needs so that a pulled node's
    replacement starts within the target at the stated probability, beside what it holds now,
    and the failure rate planned on (`rate_source`: the pool's own record, or the Llama 3 default)."""
    with reads(snapshot=True) as session:  # counts that add up
        return spares.pool_spares(session, policy=spares.SparesPolicy.of(settings))


@router.post("/nodes/{node_id}/agent-credential", response_model=AgentCredentialIssued, status_code=201)
def issue_agent_credential(request: Request, node_id: str, operator: FleetOperatorDep, db: DbDep):
    """A credential for the node's host agent, replacing any earlier one; it reports for this
    node only (heartbeats, XID events, readings) and opens nothing else."""
    token = node_requests.issue_agent_credential(db, node_id)
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
async def heartbeats(
    batch: HeartbeatBatch, caller: ReporterDep, db: DbDep, settings: SettingsDep, temporal: TemporalDep
):
    """Agents report what they see; a disagreement with the record is reconciled at once."""
    own_node_only(caller, [b.node_id for b in batch.heartbeats], most=1)
    drifted = await node_requests.heartbeats(db, temporal, settings, [b.model_dump() for b in batch.heartbeats])
    return HeartbeatResult(accepted=len(batch.heartbeats), drifted=drifted)
