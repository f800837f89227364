"""What a tenant (or an operator stepping in) asks of rollouts through the API: start a staged
rollout of a model version, read its progress, list rollouts, and pause, resume or abort one. The
rollout id is its workflow's id; progress is the workflow's query. Refusals are domain errors
(`services/errors.py`).

A tenant rolls out to nodes it holds: explicit `node_ids` (each in one of its allocations), one of its
allocations, or its whole serving fleet; agent URLs come from the node records, never from the
request. The version must be one the tenant's registry holds, named as the registry names one
(MODEL@ALIAS, MODEL@DIGEST or a unique prefix, or a bare digest); the rollout records its digest,
and the answer warns where that is not the model's production version.

An allocation takes one running rollout at a time, and only while it is `ready`: a create claims
every allocation its target touches with a compare-and-swap on `allocation.active_rollout_id`, in
the database every create shares, so of two creates at once exactly one wins and the other is a
409 naming it. The workflow never lets go of its claim (its histories stay as they were): a later
create asks the workflow engine whether the holder still runs, and takes over when it does not.

A pause, resume or abort the workflow took is recorded as a settled operation (`rollout_pause`,
..., the rollout's id as its resource) naming who asked: the tenant, or the operator who stepped in.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa
from anyio import to_thread
from pydantic import ValidationError
from sqlalchemy import or_
from sqlmodel import Session, col, select
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.service import RPCError, RPCStatusCode

from gpucloud.adapters import temporal_gateway as gateway
from gpucloud.config import Settings
from gpucloud.db import Database, rowcount, table_of
from gpucloud.models import search_attributes
from gpucloud.models import workflow_ids as ids
from gpucloud.models.api_schemas import RolloutCommand, RolloutRequest, RolloutSummary
from gpucloud.models.registry_names import AliasName, split_ref
from gpucloud.models.registry_tables import ModelAlias, ModelVersion, RegistryModel
from gpucloud.models.rollout_messages import (
    ReasonInput,
    RolloutEvaluation,
    RolloutInput,
    RolloutProgress,
    RolloutTarget,
)
from gpucloud.models.tables import TERMINAL_ALLOCATION, Allocation, AllocationStatus, Node, utcnow
from gpucloud.registry import promotion
from gpucloud.services import operations
from gpucloud.services.errors import Conflict, Invalid, NotFound, Unavailable
from gpucloud.services.registry_models import model_row
from gpucloud.services.registry_versions import resolve_version
from gpucloud.services.workflow_engine import engine_error
from gpucloud.web.problems import field_of

# How many times a create looks again at allocations whose rollout changed under it.
_CLAIM_TRIES = 3
# A claim is committed before its workflow starts: a holder whose workflow is not found yet is
# starting, not gone, for this long after its claim (then its create died, and it gives way).
ROLLOUT_START_GRACE_S = 60.0

# The workflow update each command sends.
UPDATES = {"pause": ids.ROLLOUT_PAUSE_UPDATE, "resume": ids.ROLLOUT_RESUME_UPDATE, "abort": ids.ROLLOUT_ABORT_UPDATE}


@dataclass
class _Plan:
    """What a create resolved before it starts anything: the version's digest, the explicit
    targets, the canary's evaluation, the allocations the rollout will hold, and warnings."""

    digest: str
    targets: list[RolloutTarget] | None
    evaluation: RolloutEvaluation | None
    allocations: list[str]
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Started:
    """A rollout a create started (or found started under its Idempotency-Key): its first
    progress, and the warnings its plan raised."""

    progress: RolloutProgress
    warnings: list[str]


def _version(session: Session, tenant_id: str, ref: str) -> ModelVersion:
    """The version `model_version` names: a full digest, or MODEL@ALIAS / MODEL@DIGEST-PREFIX read
    as the registry reads them (`names.split_ref`, `resolve_version`)."""
    try:
        model_name, version_ref = split_ref(ref)
    except ValueError as exc:
        raise Invalid("model_version", str(exc)) from None
    if model_name is not None:
        return resolve_version(session, model_row(session, tenant_id, model_name), version_ref, field="model_version")
    version = session.exec(
        select(ModelVersion).where(col(ModelVersion.tenant_id) == tenant_id, col(ModelVersion.digest) == ref)
    ).first()
    if version is None:
        raise Invalid("model_version", f"no version {ref} in this tenant's registry")
    return version


def _not_promoted(session: Session, model: RegistryModel | None, digest: str) -> list[str]:
    """A warning where the version is not what the model's production alias names: rolling out
    an unpromoted version is allowed (a canary of a candidate), but should be a choice."""
    if model is None:
        return []
    production = session.exec(
        select(ModelAlias).where(col(ModelAlias.model_id) == model.id, col(ModelAlias.name) == AliasName.PRODUCTION)
    ).first()
    if production is not None and production.version == digest:
        return []
    now = f"{model.name}@production is {production.version}" if production else f"{model.name} has no production alias"
    return [
        f"{model.name}@{digest} is not promoted to production ({now}); once its gates pass, promote it with "
        f"`gpucloud weights promote {model.name} {digest} --to production`"
    ]


def _not_ready(allocations: Iterable[Allocation]) -> None:
    """A 409 naming the first allocation that is not `ready`: a rollout started on one being
    provisioned, cancelled or released would only fail later, with nodes already sent weights."""
    for allocation in allocations:
        if allocation.status != AllocationStatus.READY:
            raise Conflict(
                f"allocation {allocation.id} is {allocation.status}: a rollout goes only to a ready allocation",
                type_="allocation-not-ready",
                title="The allocation is not ready",
                allocation_id=allocation.id,
                allocation_status=allocation.status,
            )


def _plan(db: Database, tenant_id: str, req: RolloutRequest) -> _Plan:
    """The version (which must be one the tenant's registry holds), its model's evaluations that
    the canary's check runs, the explicit nodes as targets (each one the tenant's), and the
    allocations the rollout will hold, each ready where the request names it or its nodes."""
    with db.reads() as session:
        version = _version(session, tenant_id, req.model_version)
        model = promotion.model_by_id(session, version.model_id)
        gates = promotion.gates_of(session, version.model_id)
        command = promotion.evaluation_of(model) if model is not None else None
        evaluation = RolloutEvaluation(gates=gates, command=command) if gates else None
        warnings = _not_promoted(session, model, version.digest)
        allocations = select(Allocation).where(col(Allocation.tenant_id) == tenant_id)
        if req.allocation_id is not None:
            allocation = session.exec(allocations.where(col(Allocation.id) == req.allocation_id)).first()
            if allocation is None:
                raise NotFound("allocation", req.allocation_id)
            _not_ready([allocation])
            return _Plan(version.digest, None, evaluation, [allocation.id], warnings)
        if req.node_ids is None:  # the serving fleet: every allocation the tenant still holds
            held = session.exec(
                allocations.where(col(Allocation.status).not_in([s.value for s in TERMINAL_ALLOCATION]))
            ).all()
            return _Plan(version.digest, None, evaluation, sorted(a.id for a in held), warnings)
        nodes = {
            n.id: n
            for n in session.exec(
                select(Node).where(
                    col(Node.id).in_(req.node_ids),
                    col(Node.tenant_id) == tenant_id,
                    col(Node.allocation_id).is_not(None),
                )
            ).all()
        }
        if unknown := [n for n in req.node_ids if n not in nodes]:
            raise Invalid("node_ids", f"not nodes this tenant holds in an allocation: {', '.join(unknown[:10])}")
        ids = sorted({n.allocation_id for n in nodes.values() if n.allocation_id})
        _not_ready(session.exec(allocations.where(col(Allocation.id).in_(ids))).all())
    targets = [
        RolloutTarget(node_id=n.id, agent_url=n.agent_url, rack=n.rack, site=n.region, allocation_id=n.allocation_id)
        for n in (nodes[i] for i in req.node_ids)
    ]
    return _Plan(version.digest, targets, evaluation, ids, warnings)


class _LostRace(Exception):
    """Another create changed an allocation between this one's read and its swap: look again."""


def _try_claim(
    db: Database, tenant_id: str, rollout_id: str, allocations: list[str], closed: set[str], *, ready: bool
) -> dict[str, tuple[str, datetime | None]]:
    """Make `rollout_id` the active rollout of every allocation, in one transaction, where each
    has none, has this one (a retried create), or has one of `closed` (rollouts seen finished):
    {} once done, else the allocations held by other rollouts: the rollout holding each, and when
    it claimed it. The UPDATE is a compare-and-swap on the rows read, so of two creates at once
    only one wins."""
    table = table_of(Allocation)
    free = or_(
        table.c.active_rollout_id.is_(None),
        table.c.active_rollout_id == rollout_id,
        table.c.active_rollout_id.in_(sorted(closed)),
    )
    with db.session() as session:
        rows = session.exec(select(Allocation).where(col(Allocation.id).in_(allocations)).with_for_update()).all()
        held = {
            a.id: (a.active_rollout_id, a.active_rollout_claimed_at)
            for a in rows
            if a.active_rollout_id and a.active_rollout_id != rollout_id and a.active_rollout_id not in closed
        }
        if ready:
            _not_ready(rows)
        if held:
            return held
        swap = sa.update(table).where(table.c.id.in_(allocations), table.c.tenant_id == tenant_id, free)
        if ready:
            swap = swap.where(table.c.status == AllocationStatus.READY.value)
        claimed = swap.values(active_rollout_id=rollout_id, active_rollout_claimed_at=utcnow())
        if rowcount(session.execute(claimed)) != len(allocations):
            raise _LostRace
    return {}


def _release(db: Database, rollout_id: str) -> None:
    """Let go of what a create claimed when its workflow never started."""
    table = table_of(Allocation)
    with db.session() as session:
        session.execute(
            sa.update(table)
            .where(table.c.active_rollout_id == rollout_id)
            .values(active_rollout_id=None, active_rollout_claimed_at=None)
        )


async def _running(temporal: Client, rollout_id: str, claimed_at: datetime | None) -> bool:
    """Whether the rollout still runs: its workflow is open and its phase is not a final one (a
    rollout rolling back still runs; one that has just reached its end is closing, and done), or
    it is not found yet within `ROLLOUT_START_GRACE_S` of its claim (its create is starting it)."""
    try:
        described = await gateway.describe_workflow(temporal, ids.rollout_workflow_id(rollout_id))
        if described.status != WorkflowExecutionStatus.RUNNING:
            return False
        return not (await gateway.rollout_progress(temporal, rollout_id)).finished
    except WorkflowQueryFailedError:
        return True  # open, and its phase unknown: it holds the allocation until it says otherwise
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            starting = claimed_at is not None and (utcnow() - claimed_at).total_seconds() < ROLLOUT_START_GRACE_S
            return starting
        raise engine_error(exc, what="the rollout", left="nothing was started") from exc


async def _claim(temporal: Client, db: Database, tenant_id: str, rollout_id: str, plan: _Plan, *, ready: bool) -> None:
    """Hold the plan's allocations for this rollout, or refuse (409) naming the rollout that runs
    on one of them. A holder whose workflow has closed gives way; a bounded number of looks."""
    closed: set[str] = set()
    for _ in range(_CLAIM_TRIES):
        try:
            held = await to_thread.run_sync(
                functools.partial(_try_claim, db, tenant_id, rollout_id, plan.allocations, closed, ready=ready)
            )
        except _LostRace:
            continue
        if not held:
            return
        for allocation_id, (holder, claimed_at) in sorted(held.items()):
            if await _running(temporal, holder, claimed_at):
                raise Conflict(
                    f"rollout {holder} is running on allocation {allocation_id}: wait for it to finish, or "
                    f"abort it (`gpucloud rollout abort {holder}`), then start this one",
                    type_="rollout-in-progress",
                    title="Another rollout runs on the allocation",
                    rollout_id=holder,
                    allocation_id=allocation_id,
                )
            closed.add(holder)
    raise Conflict(
        "other rollouts were starting on the same allocations at the same time; send the request again",
        type_="rollout-conflict",
        title="The allocation's rollouts kept changing",
    )


def _invalid_input(exc: ValidationError) -> Invalid:
    """The request's options the workflow's input refuses, named as the client named them."""
    errors = [
        {"field": field_of(tuple(e["loc"])), "message": e["msg"].removeprefix("Value error, ")} for e in exc.errors()
    ]
    detail = "; ".join(e["message"] for e in errors)
    return Invalid(errors[0]["field"], errors[0]["message"], detail=detail, errors=errors)


async def create(
    db: Database,
    temporal: Client,
    settings: Settings,
    tenant_id: str,
    req: RolloutRequest,
    *,
    seed: str | None = None,
) -> Started:
    """Plan the rollout, claim its allocations and start its workflow. Under a `seed` (the caller
    and its Idempotency-Key) the id comes from the seed: a create re-run after its first try died
    finds the rollout that try started instead of starting a second one."""
    plan = await to_thread.run_sync(_plan, db, tenant_id, req)
    seed = seed or uuid.uuid4().hex
    rollout_id = ids.rollout_workflow_id(hashlib.sha256(seed.encode()).hexdigest()[:16])
    options = req.model_dump(exclude={"node_ids", "waves", "model_version"}, exclude_none=True)
    try:
        inp = RolloutInput(
            rollout_id=rollout_id,
            tenant_id=tenant_id,
            model_version=plan.digest,
            nodes=plan.targets,
            evaluation=plan.evaluation,
            **options,
            **({"waves": req.waves} if req.waves else {}),
        )
    except ValidationError as exc:
        raise _invalid_input(exc) from None
    # Only one rollout at a time on an allocation: this one claims each it will touch first.
    await _claim(temporal, db, tenant_id, rollout_id, plan, ready=not req.serving_fleet)
    try:
        await gateway.start_rollout(temporal, settings, inp, allocation_id=req.allocation_id)
    except RPCError as exc:
        await to_thread.run_sync(_release, db, rollout_id)
        raise engine_error(exc, what="the rollout", left="nothing was started") from exc
    progress = RolloutProgress(rollout_id=rollout_id, tenant_id=tenant_id, model_version=plan.digest, phase="resolving")
    return Started(progress=progress, warnings=plan.warnings)


async def visible(temporal: Client, rollout_id: str, *, tenant_id: str | None, operator: bool) -> RolloutProgress:
    """The rollout's progress, where the caller sees it (an operator every tenant's, a tenant its
    own); NotFound otherwise, as for one that does not exist."""
    if not rollout_id.startswith(ids.ROLLOUT_WORKFLOW_PREFIX):
        raise NotFound("rollout", rollout_id)
    try:
        progress = await gateway.rollout_progress(temporal, rollout_id)
    except WorkflowQueryFailedError as exc:
        # The workflow could not answer this time (a workflow task that failed and is retried,
        # such as one a worker's pause stopped as a possible deadlock): ask again, as for an outage.
        raise Unavailable(
            f"the rollout's workflow did not answer its progress ({exc.message}); nothing changed; retry",
            type_="workflow-engine-unavailable",
            retry_after_s=1,
            retryable=True,
        ) from None
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise NotFound("rollout", rollout_id) from None
        raise
    if not operator and progress.tenant_id != tenant_id:
        raise NotFound("rollout", rollout_id)
    return progress


async def list_rollouts(
    temporal: Client, *, tenant_id: str | None, page_size: int, next_page_token: bytes | None
) -> tuple[list[RolloutSummary], bytes | None]:
    """A page of rollouts (a tenant's, or every tenant's when `tenant_id` is None), newest first
    as the workflow engine's index orders them, and the engine's token for the next page."""
    try:
        executions, token = await gateway.list_rollouts(
            temporal, tenant_id=tenant_id, page_size=page_size, next_page_token=next_page_token
        )
    except RPCError as exc:
        raise engine_error(exc, what="the rollouts", left="nothing changed") from exc
    items = [
        RolloutSummary(
            rollout_id=wf.id,
            tenant_id=wf.typed_search_attributes.get(search_attributes.TENANT_ID),
            model_version=wf.typed_search_attributes.get(search_attributes.MODEL_VERSION),
            allocation_id=wf.typed_search_attributes.get(search_attributes.ALLOCATION_ID),
            status=wf.status.name.lower() if wf.status is not None else "unknown",
            started_at=wf.start_time,
            closed_at=wf.close_time,
        )
        for wf in executions
    ]
    return items, token


async def send_command(
    temporal: Client,
    db: Database,
    rollout_id: str,
    command: str,
    req: RolloutCommand | None,
    *,
    tenant_id: str | None,
    operator: bool,
    actor: str,
) -> RolloutProgress:
    """Pause, resume or abort the rollout (`UPDATES`), and record who asked as a settled
    operation; a rollout that cannot take the command now is a Conflict."""
    progress = await visible(temporal, rollout_id, tenant_id=tenant_id, operator=operator)
    update = UPDATES[command]
    arg = ReasonInput(reason=req.reason if req else "")
    try:
        # The rollback may take a while: an abort is answered once the workflow has accepted it.
        answer = await gateway.update_rollout(temporal, rollout_id, update, arg, until_accepted=command == "abort")
    except WorkflowUpdateFailedError as exc:
        raise Conflict(str(exc.cause or exc), type_="rollout-conflict", title=f"Cannot {command}") from None
    except RPCError as exc:
        if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
            raise Conflict(
                f"the rollout is already {progress.phase.value}", type_="rollout-conflict", title=f"Cannot {command}"
            ) from None
        raise
    await to_thread.run_sync(
        functools.partial(
            operations.record_done_in,
            db,
            kind=f"rollout_{command}",
            resource_id=rollout_id,
            actor=actor,
            tenant_id=progress.tenant_id,
        )
    )
    return answer


def model_names(session: Session, rollouts: Iterable[RolloutSummary | RolloutProgress]) -> dict[str, str]:
    """The registry model each rollout's version belongs to, by rollout id (one query; a rollout
    whose version its tenant's registry no longer holds is left out)."""
    wanted = {(r.tenant_id, r.model_version) for r in rollouts if r.tenant_id and r.model_version}
    if not wanted:
        return {}
    rows = session.exec(
        select(ModelVersion.tenant_id, ModelVersion.digest, RegistryModel.name)
        .join(RegistryModel, col(RegistryModel.id) == col(ModelVersion.model_id))
        .where(col(ModelVersion.digest).in_(sorted({digest for _, digest in wanted})))
    ).all()
    names = {(tenant, digest): name for tenant, digest, name in rows}
    return {
        r.rollout_id: names[(r.tenant_id, r.model_version)]
        for r in rollouts
        if r.tenant_id and r.model_version and (r.tenant_id, r.model_version) in names
    }


async def progress_of(
    temporal: Client, rollout_ids: Iterable[str], *, concurrency: int = 8, timeout_s: float = 2.0
) -> dict[str, RolloutProgress]:
    """The progress of several rollouts (an operator's view: any tenant's), asked of their
    workflows at most `concurrency` at a time, each within `timeout_s`; a rollout whose workflow
    does not answer (closed and not replayable, the engine slow) is left out."""
    gate = asyncio.Semaphore(concurrency)

    async def one(rollout_id: str) -> RolloutProgress | None:
        async with gate:
            try:
                return await asyncio.wait_for(
                    visible(temporal, rollout_id, tenant_id=None, operator=True), timeout=timeout_s
                )
            except (NotFound, RPCError, WorkflowQueryFailedError, TimeoutError):
                return None

    ids_ = list(dict.fromkeys(rollout_ids))
    answers = await asyncio.gather(*(one(i) for i in ids_))
    return {i: p for i, p in zip(ids_, answers, strict=True) if p is not None}
