"""Node health: XID events, signals beyond XIDs and counter readings as agents report them (each
for its own node only), XIDs injected by operators, the judgement and its actions, node health
and alerts."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool

from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import (
    DbDep,
    FleetOperatorDep,
    ReadOperatorDep,
    ReadsDep,
    ReporterDep,
    SettingsDep,
    TemporalDep,
)
from gpucloud.api.routers import agents
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.health.pulls import PullKind
from gpucloud.models.api_schemas import (
    MAX_READING_CLOCK_SKEW,
    AlertPage,
    HealthDecision,
    NodeHealth,
    ReadingIngestResult,
    SignalIngestResult,
    XidIngestResult,
    XidInjection,
)
from gpucloud.models.health_tables import (
    OperatorAlertPublic,
    OperatorAlertRecord,
)
from gpucloud.protocol.reports import (
    AGENT_MAX_EVENTS,
    AGENT_MAX_READINGS,
    AGENT_MAX_SIGNAL_REPORTS,
    NodeReading,
    ReadingBatch,
    SignalReport,
    SignalReportBatch,
    XidEvent,
    XidEventBatch,
    utc_now,
)
from gpucloud.services import health as health_service
from gpucloud.services import node_health as node_health_service
from gpucloud.services import pulls
from gpucloud.web.problems import Problem, invalid, not_found

router = APIRouter(prefix="/v1", tags=["health"])


def own_node_only(caller: Caller, node_ids: list[str], *, most: int) -> None:
    """An agent reports for its own node, at most `most` items a request; the operator (the
    simulated fleet's batches, drills) for any node, up to the batch's own limit."""
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
    if len(node_ids) > most:
        raise Problem(
            413,
            "batch-too-large",
            "Batch too large",
            f"an agent sends at most {most} items a request ({len(node_ids)} sent); split the batch",
        )


def _ingest(db: Database, settings: Settings, events: list[XidEvent], source: str) -> tuple[list, list[str]]:
    with db.session() as session:
        return health_service.ingest_xids(
            session, events, source=source, breaker=health_service.BreakerSettings.of(settings)
        )


def _ingest_readings(db: Database, settings: Settings, readings: list[NodeReading]) -> list:
    with db.session() as session:
        outcomes, unknown = health_service.ingest_readings(
            session, readings, breaker=health_service.BreakerSettings.of(settings)
        )
    if unknown:
        raise Problem(
            404,
            "not-found",
            "node not found",
            f"no node {', '.join(repr(n) for n in unknown)}: nothing stored",
            unknown_nodes=unknown,
        )
    return outcomes


async def _ingest_and_act(
    db: Database, settings: Settings, temporal, events: list[XidEvent], source: str
) -> XidIngestResult:
    outcomes, unknown = await run_in_threadpool(_ingest, db, settings, events, source)
    await pulls.act_on(temporal, settings, outcomes, pulls.first_seen(events))
    return XidIngestResult(
        accepted=len(events) - sum(1 for e in events if e.node_id in set(unknown)),
        unknown_nodes=unknown,
        decisions=_decisions(outcomes),
    )


def _decisions(outcomes: list) -> list[HealthDecision]:
    return [
        HealthDecision(
            node_id=o.node_id,
            health=o.verdict.health,
            action=o.verdict.action,
            pull=None if o.pull == PullKind.NONE else o.pull.value,
            alert=o.alert,
        )
        for o in outcomes
    ]


@router.post("/nodes/{node_id}/xid", response_model=XidIngestResult)
async def inject_xid(
    node_id: str,
    req: XidInjection,
    operator: FleetOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
):
    """Record an XID on a node as if its agent had reported it (tests, demos, drills)."""
    event = XidEvent(
        node_id=node_id,
        gpu_index=req.gpu_index,
        xid=req.xid,
        timestamp=utc_now(),
        message=req.message or f"injected by {operator.id}: XID {req.xid}",
    )
    result = await _ingest_and_act(db, settings, temporal, [event], operator.id)
    if result.unknown_nodes:
        raise not_found("node", node_id)
    return result


def _not_ahead(field: str, timestamps: list) -> None:
    """A 422 naming every item dated further ahead of the control plane's clock than the skew
    allowed: a report from the future would count as newer than anything that really happened
    since (a later burn-in, a later tenant)."""
    _none_ahead({f"{field}.{i}.timestamp": t for i, t in enumerate(timestamps)})


def _none_ahead(dated: dict[str, datetime]) -> None:
    """`_not_ahead` over named moments (field path -> moment)."""
    latest_allowed = utc_now() + MAX_READING_CLOCK_SKEW
    ahead = [field for field, t in dated.items() if t > latest_allowed]
    if ahead:
        raise invalid(
            ahead[0],
            f"more than {MAX_READING_CLOCK_SKEW} ahead of the control plane's clock",
            errors=[{"field": f, "message": "in the future"} for f in ahead],
        )


@agents.router.post("/agents/events", response_model=XidIngestResult, tags=["health"])
async def agent_events(
    batch: XidEventBatch, caller: ReporterDep, db: DbDep, settings: SettingsDep, temporal: TemporalDep
):
    """XID events as agents saw them; each node is judged again and acted on at once. Who held
    the node is stamped here from the control plane's own record, never taken from the agent."""
    own_node_only(caller, [e.node_id for e in batch.events], most=AGENT_MAX_EVENTS)
    _not_ahead("events", [e.timestamp for e in batch.events])
    return await _ingest_and_act(db, settings, temporal, batch.events, "agent")


def _ingest_signals(
    db: Database, settings: Settings, reports: list[SignalReport], source: str
) -> tuple[list, list[str]]:
    with db.session() as session:
        return health_service.ingest_signals(
            session, reports, source=source, breaker=health_service.BreakerSettings.of(settings)
        )


def _signals_first_seen(reports: list[SignalReport]) -> dict[str, datetime]:
    """The earliest observation each node reported in a batch: when its fault happened."""
    first: dict[str, datetime] = {}
    for report in reports:
        for observation in report.observations:
            if report.node_id not in first or observation.at < first[report.node_id]:
                first[report.node_id] = observation.at
    return first


@agents.router.post("/agents/signals", response_model=SignalIngestResult, tags=["health"])
async def agent_signals(
    batch: SignalReportBatch, caller: ReporterDep, db: DbDep, settings: SettingsDep, temporal: TemporalDep
):
    """Signals beyond XIDs as agents saw them (kernel log, InfiniBand sysfs: `SignalReport`s),
    judged by the signal table with the node's XIDs and readings and acted on at once: a
    drain-level signal pulls the node as a fatal XID does, an application signal never does. An
    agent reports for its own node, at most 10 reports a request; the operator (the simulated
    fleet's batches) for any. Who held the node is stamped from the control plane's record."""
    own_node_only(caller, [r.node_id for r in batch.reports], most=AGENT_MAX_SIGNAL_REPORTS)
    _none_ahead(
        {f"reports.{i}.at": r.at for i, r in enumerate(batch.reports)}
        | {
            f"reports.{i}.observations.{j}.at": o.at
            for i, r in enumerate(batch.reports)
            for j, o in enumerate(r.observations)
        }
    )
    source = "agent" if caller.role == "agent" else caller.actor
    outcomes, unknown = await run_in_threadpool(_ingest_signals, db, settings, batch.reports, source)
    await pulls.act_on(temporal, settings, outcomes, _signals_first_seen(batch.reports))
    return SignalIngestResult(
        accepted=sum(len(r.observations) for r in batch.reports if r.node_id not in set(unknown)),
        unknown_nodes=unknown,
        decisions=_decisions(outcomes),
    )


@agents.router.post(
    "/agents/readings",
    response_model=ReadingIngestResult,
    tags=["health"],
    responses={404: {"description": "a reading names a node the control plane does not know: nothing stored"}},
)
async def agent_readings(
    batch: ReadingBatch, caller: ReporterDep, db: DbDep, settings: SettingsDep, temporal: TemporalDep
):
    """Counter readings as agents took them; each node's trends are judged again and acted on at once."""
    own_node_only(caller, [r.node_id for r in batch.readings], most=AGENT_MAX_READINGS)
    _not_ahead("readings", [r.timestamp for r in batch.readings])
    outcomes = await run_in_threadpool(_ingest_readings, db, settings, batch.readings)
    await pulls.act_on(temporal, settings, outcomes, pulls.first_seen(batch.readings))
    return ReadingIngestResult(accepted=len(batch.readings), decisions=_decisions(outcomes))


@router.get("/nodes/{node_id}/health", response_model=NodeHealth)
def node_health(
    node_id: str,
    operator: ReadOperatorDep,
    reads: ReadsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    reading_limit: Annotated[int, Query(ge=0, le=100)] = 1,
    signal_limit: Annotated[int, Query(ge=0, le=1000)] = 100,
):
    with reads() as session:
        return node_health_service.node_health(
            session, node_id, limit=limit, reading_limit=reading_limit, signal_limit=signal_limit
        )


@router.get("/alerts", response_model=AlertPage)
def list_alerts(operator: ReadOperatorDep, reads: ReadsDep, page: pagination.PageDep):
    with reads() as session:
        rows, token = pagination.fetch(session, OperatorAlertRecord, "seq", page=page, equal={})
        return AlertPage(
            items=[OperatorAlertPublic.model_validate(a, from_attributes=True) for a in rows], next_page_token=token
        )
