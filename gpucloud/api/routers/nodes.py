"""Nodes (operator only): enrollment by the fleet, listing and reading, operator actions, what
agents report (heartbeats, XID events, counter readings), node health and operator alerts."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlmodel import select
from temporalio.service import RPCError

from gpucloud.agent.readings import NodeReading, XidEvent, utc_now
from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import OperatorDep, ReporterDep, SessionDep, SettingsDep, TemporalDep
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.health_tables import (
    NodeReadingRecord,
    OperatorAlertPublic,
    OperatorAlertRecord,
    XidEventRecord,
)
from gpucloud.models.messages import ReplaceNodeRequest
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodeEnroll, NodePublic, NodeTransition, Operation, OperationPublic
from gpucloud.services import agent_credentials
from gpucloud.services import health as health_service
from gpucloud.services.fleet import apply_operator_action, record_heartbeats, summary
from gpucloud.services.nodes import enroll_nodes, lease_for_bringup
from gpucloud.services.schedules import reconcile_now
from gpucloud.services.workflows import signal_replace_node, start_bringup_batches
from gpucloud.web.problems import Problem, not_found

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["nodes"])

MAX_ENROLL_BATCH = 1000
MAX_READINGS_BATCH = 1000
# An agent clock this far ahead would put its reading after every later one: it is refused.
MAX_READING_CLOCK_SKEW = timedelta(minutes=5)


class EnrollRequest(BaseModel):
    nodes: list[NodeEnroll] = Field(min_length=1, max_length=MAX_ENROLL_BATCH)


class EnrollResult(BaseModel):
    enrolled: int
    already_known: int
    bringups_started: int
    batches: int = 0


class NodePage(BaseModel):
    items: list[NodePublic]
    next_page_token: str


def _enroll(settings: Settings, req: EnrollRequest) -> tuple[list[str], int, int]:
    with session_scope(settings.database_url) as session:
        new, known = enroll_nodes(session, req.nodes)
        session.flush()
        # New nodes, and known ones still waiting for a bring-up nobody holds (it was lost).
        to_start = lease_for_bringup(session, [*new, *known], deadline_scale=settings.reconciler.deadline_scale)
        return to_start, len(new), len(known)


@router.post("/nodes:enroll", response_model=EnrollResult)
async def enroll(req: EnrollRequest, operator: OperatorDep, settings: SettingsDep, temporal: TemporalDep):
    """Records the nodes, then brings them up in batches (`BringupBatchWorkflow`). Should the
    start fail after the commit, the reconciler starts the bring-up once the hold runs out."""
    to_start, new, known = await run_in_threadpool(_enroll, settings, req)
    batches = await start_bringup_batches(temporal, settings, to_start)
    return EnrollResult(enrolled=new, already_known=known, bringups_started=len(to_start), batches=batches)


@router.get("/nodes", response_model=NodePage)
def list_nodes(
    operator: OperatorDep,
    session: SessionDep,
    page_size: Annotated[int, Query(ge=1, le=pagination.MAX_PAGE_SIZE)] = pagination.DEFAULT_PAGE_SIZE,
    page_token: str | None = None,
    state: NodeState | None = None,
    gpu_type: str | None = None,
    region: str | None = None,
):
    filters = {"state": state, "gpu_type": gpu_type, "region": region}
    cursor = pagination.decode(page_token, filters)
    query = select(Node).order_by(Node.id).limit(page_size + 1)
    if state is not None:
        query = query.where(Node.state == state)
    if gpu_type is not None:
        query = query.where(Node.gpu_type == gpu_type)
    if region is not None:
        query = query.where(Node.region == region)
    if cursor.after is not None:
        query = query.where(Node.id > cursor.after)
    rows, token = pagination.page(list(session.exec(query).all()), page_size, lambda n: n.id, filters)
    return NodePage(items=[NodePublic.model_validate(n, from_attributes=True) for n in rows], next_page_token=token)


@router.get("/nodes/{node_id}", response_model=NodePublic)
def get_node(node_id: str, operator: OperatorDep, session: SessionDep):
    node = session.get(Node, node_id)
    if node is None:
        raise not_found("node", node_id)
    return NodePublic.model_validate(node, from_attributes=True)


# ---------------------------------------------------------------- operator actions and events


class NodeActionResult(BaseModel):
    node: NodePublic
    operation: OperationPublic


class MaintenanceRequest(BaseModel):
    enabled: bool
    reason: str = Field("", max_length=500)


class ActionRequest(BaseModel):
    reason: str = Field("", max_length=500)


class NodeEventPublic(BaseModel):
    seq: int
    from_state: str
    to_state: str
    event: str
    cause: str
    actor: str
    at: datetime


class NodeEventPage(BaseModel):
    items: list[NodeEventPublic]
    next_page_token: str


class HeartbeatIn(BaseModel):
    node_id: str
    tenant_id: str | None = None
    workload_running: bool = False
    boot_id: str | None = None


class HeartbeatBatch(BaseModel):
    heartbeats: list[HeartbeatIn] = Field(min_length=1, max_length=5000)


class HeartbeatResult(BaseModel):
    accepted: int
    drifted: list[str]


def _act(settings: Settings, node_id: str, action: str, reason: str) -> tuple[Node, Operation]:
    with session_scope(settings.database_url) as session:
        node = session.get(Node, node_id)
        if node is None:
            raise not_found("node", node_id)
        op = apply_operator_action(session, node, action, actor="operator", cause=reason or action)
        session.flush()
        session.refresh(node)
        return node, op


async def _operator_action(node_id: str, action: str, reason: str, settings: Settings, temporal) -> JSONResponse:
    node, op = await run_in_threadpool(_act, settings, node_id, action, reason)
    if action == "drain":
        await reconcile_now(temporal, settings, [node_id])
    body = NodeActionResult(
        node=NodePublic.model_validate(node, from_attributes=True),
        operation=OperationPublic.model_validate(op, from_attributes=True),
    )
    return JSONResponse(body.model_dump(mode="json"), status_code=202 if op.status == "running" else 200)


@router.post("/nodes/{node_id}/cordon", response_model=NodeActionResult)
async def cordon(
    node_id: str, operator: OperatorDep, settings: SettingsDep, temporal: TemporalDep, req: ActionRequest | None = None
):
    return await _operator_action(node_id, "cordon", req.reason if req else "", settings, temporal)


@router.post("/nodes/{node_id}/uncordon", response_model=NodeActionResult)
async def uncordon(
    node_id: str, operator: OperatorDep, settings: SettingsDep, temporal: TemporalDep, req: ActionRequest | None = None
):
    return await _operator_action(node_id, "uncordon", req.reason if req else "", settings, temporal)


@router.post("/nodes/{node_id}/drain", response_model=NodeActionResult, status_code=202)
async def drain(
    node_id: str, operator: OperatorDep, settings: SettingsDep, temporal: TemporalDep, req: ActionRequest | None = None
):
    """Intent: the node is cordoned now and drained by the reconciler (-> quarantined)."""
    return await _operator_action(node_id, "drain", req.reason if req else "", settings, temporal)


@router.post("/nodes/{node_id}/maintenance", response_model=NodeActionResult)
async def maintenance(
    node_id: str, req: MaintenanceRequest, operator: OperatorDep, settings: SettingsDep, temporal: TemporalDep
):
    action = "maintenance_on" if req.enabled else "maintenance_off"
    return await _operator_action(node_id, action, req.reason, settings, temporal)


@router.get("/nodes/{node_id}/events", response_model=NodeEventPage)
def node_events(
    node_id: str,
    operator: OperatorDep,
    session: SessionDep,
    page_size: Annotated[int, Query(ge=1, le=pagination.MAX_PAGE_SIZE)] = pagination.DEFAULT_PAGE_SIZE,
    page_token: str | None = None,
):
    if session.get(Node, node_id) is None:
        raise not_found("node", node_id)
    filters = {"node": node_id}
    cursor = pagination.decode(page_token, filters)
    query = select(NodeTransition).where(NodeTransition.node_id == node_id).order_by(NodeTransition.seq)
    if cursor.after is not None:
        query = query.where(NodeTransition.seq > cursor.after)
    rows, token = pagination.page(
        list(session.exec(query.limit(page_size + 1)).all()), page_size, lambda e: e.seq, filters
    )
    return NodeEventPage(
        items=[NodeEventPublic.model_validate(e, from_attributes=True) for e in rows], next_page_token=token
    )


@router.get("/fleet/summary")
def fleet_summary(operator: OperatorDep, session: SessionDep) -> dict:
    return summary(session)


def _record(settings: Settings, batch: HeartbeatBatch) -> list[str]:
    with session_scope(settings.database_url) as session:
        return record_heartbeats(session, [b.model_dump() for b in batch.heartbeats])


def _own_node_only(caller: Caller, node_ids: list[str]) -> None:
    """An agent reports for its own node; the operator (the simulated fleet, drills) for any."""
    if caller.role != "agent":
        return
    foreign = sorted({n for n in node_ids if n != caller.node_id})
    if foreign:
        raise Problem(
            403,
            "forbidden",
            "Not this agent's node",
            f"the agent credential of {caller.node_id} cannot report for {foreign[0]}",
        )


class AgentCredentialIssued(BaseModel):
    node_id: str
    token: str = Field(description="shown once: give it to the node's agent (`gpucloud agent --token`)")


@router.post("/nodes/{node_id}/agent-credential", response_model=AgentCredentialIssued, status_code=201)
def issue_agent_credential(node_id: str, operator: OperatorDep, settings: SettingsDep):
    """A credential for the node's host agent, replacing any earlier one; it reports for this
    node only (heartbeats, XID events, readings) and opens nothing else."""
    with session_scope(settings.database_url) as session:
        try:
            token = agent_credentials.issue(session, node_id)
        except agent_credentials.UnknownNode:
            raise not_found("node", node_id) from None
    return AgentCredentialIssued(node_id=node_id, token=token)


@router.post("/agents/heartbeats", response_model=HeartbeatResult)
async def heartbeats(batch: HeartbeatBatch, caller: ReporterDep, settings: SettingsDep, temporal: TemporalDep):
    """Agents report what they see; a disagreement with the record is reconciled at once."""
    _own_node_only(caller, [b.node_id for b in batch.heartbeats])
    drifted = await run_in_threadpool(_record, settings, batch)
    if drifted:
        await reconcile_now(temporal, settings, drifted)
    return HeartbeatResult(accepted=len(batch.heartbeats), drifted=drifted)


# ---------------------------------------------------------------- health: XIDs, judgement, alerts


class XidInjection(BaseModel):
    xid: int = Field(ge=0, le=100_000)
    gpu_index: int | None = Field(None, ge=0, le=63)
    message: str = Field("", max_length=1000)


class XidEventBatch(BaseModel):
    events: list[XidEvent] = Field(min_length=1, max_length=5000)


class HealthDecision(BaseModel):
    node_id: str
    health: str
    action: str
    pull: str | None
    alert: str | None


class XidIngestResult(BaseModel):
    accepted: int
    unknown_nodes: list[str]
    decisions: list[HealthDecision]


class ReadingBatch(BaseModel):
    readings: list[NodeReading] = Field(min_length=1, max_length=MAX_READINGS_BATCH)


class ReadingIngestResult(BaseModel):
    accepted: int
    decisions: list[HealthDecision]


class XidRecordPublic(BaseModel):
    xid: int
    gpu_index: int | None
    timestamp: datetime
    message: str
    source: str


class NodeHealth(BaseModel):
    node_id: str
    state: str
    health: str
    conditions: list[dict]
    xid_history: list[XidRecordPublic]
    # The newest stored readings, newest first (the trend window's, and fatal ones).
    readings: list[NodeReading]


def _breaker(settings: Settings) -> health_service.BreakerSettings:
    return health_service.BreakerSettings(
        max_pulled_share=settings.health.breaker_max_pulled_share,
        window=timedelta(seconds=settings.health.breaker_window_s),
    )


def _ingest(settings: Settings, events: list[XidEvent], source: str) -> tuple[list, list[str]]:
    with session_scope(settings.database_url) as session:
        return health_service.ingest_xids(session, events, source=source, breaker=_breaker(settings))


def _ingest_readings(settings: Settings, readings: list[NodeReading]) -> list:
    with session_scope(settings.database_url) as session:
        outcomes, unknown = health_service.ingest_readings(session, readings, breaker=_breaker(settings))
    if unknown:
        raise Problem(
            404,
            "not-found",
            "node not found",
            f"no node {', '.join(repr(n) for n in unknown)}: nothing stored",
            unknown_nodes=unknown,
        )
    return outcomes


async def _act_on(outcomes: list, settings: Settings, temporal) -> None:
    """A pull decided in the DB is carried out by the allocation's workflow or the reconciler."""
    drains = [o.node_id for o in outcomes if o.pull == "drain"]
    for o in outcomes:
        if o.pull != "replace":
            continue
        req = ReplaceNodeRequest(
            node_id=o.node_id,
            reason=o.reason[:1000],
            immediate=o.immediate,
            grace_s=settings.health.drain_grace_s,
            recheck_s=settings.health.replacement_recheck_s,
        )
        try:
            await signal_replace_node(temporal, o.allocation_id, req)
        except RPCError as exc:
            log.warning("replace signal for %s in %s not delivered: %s", o.node_id, o.allocation_id, exc)
    if drains:
        await reconcile_now(temporal, settings, drains)


async def _ingest_and_act(settings: Settings, temporal, events: list[XidEvent], source: str) -> XidIngestResult:
    outcomes, unknown = await run_in_threadpool(_ingest, settings, events, source)
    await _act_on(outcomes, settings, temporal)
    return XidIngestResult(
        accepted=len(events) - sum(1 for e in events if e.node_id in set(unknown)),
        unknown_nodes=unknown,
        decisions=_decisions(outcomes),
    )


def _decisions(outcomes: list) -> list[HealthDecision]:
    return [
        HealthDecision(node_id=o.node_id, health=o.verdict.health, action=o.verdict.action, pull=o.pull, alert=o.alert)
        for o in outcomes
    ]


@router.post("/nodes/{node_id}/xid", response_model=XidIngestResult)
async def inject_xid(
    node_id: str, req: XidInjection, operator: OperatorDep, settings: SettingsDep, temporal: TemporalDep
):
    """Record an XID on a node as if its agent had reported it (tests, demos, drills)."""
    event = XidEvent(
        node_id=node_id,
        gpu_index=req.gpu_index,
        xid=req.xid,
        timestamp=utc_now(),
        message=req.message or f"injected by operator: XID {req.xid}",
    )
    result = await _ingest_and_act(settings, temporal, [event], "operator")
    if result.unknown_nodes:
        raise not_found("node", node_id)
    return result


@router.post("/agents/events", response_model=XidIngestResult)
async def agent_events(batch: XidEventBatch, caller: ReporterDep, settings: SettingsDep, temporal: TemporalDep):
    """XID events as agents saw them; each node is judged again and acted on at once."""
    _own_node_only(caller, [e.node_id for e in batch.events])
    return await _ingest_and_act(settings, temporal, batch.events, "agent")


@router.post("/agents/readings", response_model=ReadingIngestResult)
async def agent_readings(batch: ReadingBatch, caller: ReporterDep, settings: SettingsDep, temporal: TemporalDep):
    """Counter readings as agents took them; each node's trends are judged again and acted on at once."""
    _own_node_only(caller, [r.node_id for r in batch.readings])
    latest_allowed = utc_now() + MAX_READING_CLOCK_SKEW
    ahead = [f"readings.{i}.timestamp" for i, r in enumerate(batch.readings) if r.timestamp > latest_allowed]
    if ahead:
        raise Problem(
            422,
            "invalid-request",
            "The request is invalid",
            f"{ahead[0]}: more than {MAX_READING_CLOCK_SKEW} ahead of the control plane's clock",
            errors=[{"field": f, "message": "in the future"} for f in ahead],
        )
    outcomes = await run_in_threadpool(_ingest_readings, settings, batch.readings)
    await _act_on(outcomes, settings, temporal)
    return ReadingIngestResult(accepted=len(batch.readings), decisions=_decisions(outcomes))


@router.get("/nodes/{node_id}/health", response_model=NodeHealth)
def node_health(
    node_id: str,
    operator: OperatorDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    reading_limit: Annotated[int, Query(ge=0, le=100)] = 1,
):
    node = session.get(Node, node_id)
    if node is None:
        raise not_found("node", node_id)
    rows = session.exec(
        select(XidEventRecord).where(XidEventRecord.node_id == node_id).order_by(XidEventRecord.seq.desc()).limit(limit)
    ).all()
    readings = session.exec(
        select(NodeReadingRecord.reading)
        .where(NodeReadingRecord.node_id == node_id)
        .order_by(NodeReadingRecord.timestamp.desc())
        .limit(reading_limit)
    ).all()
    return NodeHealth(
        node_id=node.id,
        state=node.state,
        health=node.health,
        conditions=node.health_conditions,
        xid_history=[XidRecordPublic.model_validate(r, from_attributes=True) for r in rows],
        readings=[NodeReading.model_validate(r) for r in readings],
    )


class AlertPage(BaseModel):
    items: list[OperatorAlertPublic]
    next_page_token: str


@router.get("/alerts", response_model=AlertPage)
def list_alerts(
    operator: OperatorDep,
    session: SessionDep,
    page_size: Annotated[int, Query(ge=1, le=pagination.MAX_PAGE_SIZE)] = pagination.DEFAULT_PAGE_SIZE,
    page_token: str | None = None,
):
    cursor = pagination.decode(page_token, {})
    query = select(OperatorAlertRecord).order_by(OperatorAlertRecord.seq).limit(page_size + 1)
    if cursor.after is not None:
        query = query.where(OperatorAlertRecord.seq > cursor.after)
    rows, token = pagination.page(list(session.exec(query).all()), page_size, lambda a: a.seq, {})
    return AlertPage(
        items=[OperatorAlertPublic.model_validate(a, from_attributes=True) for a in rows], next_page_token=token
    )
