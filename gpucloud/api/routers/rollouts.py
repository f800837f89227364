"""Rollouts: start a staged rollout of a model version (idempotent, 202), read its progress, and
pause, resume or abort it. The rollout id is its workflow's id; progress is the workflow's query.

A tenant rolls out to nodes it holds: explicit `node_ids` (each in one of its allocations), one of its
allocations, or its whole serving fleet; agent URLs come from the node records, never from the
request. The version must be one the tenant's registry holds.

A pause, resume or abort the workflow took is recorded as a settled operation (`rollout_pause`,
..., the rollout's id as its resource) naming who asked: the tenant, or the operator who stepped in.
"""

from __future__ import annotations

import functools
import hashlib
import uuid

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlmodel import col, select
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError, WorkflowUpdateStage
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, CallerOrFleetOperatorDep, SettingsDep, TemporalDep, TenantDep
from gpucloud.api.idempotency import IdempotencyKey, accepted, idempotent
from gpucloud.api.schemas import (
    RolloutAccepted,
    RolloutCommand,
    RolloutRequest,
)
from gpucloud.config import Settings
from gpucloud.db import read_scope
from gpucloud.models.registry_tables import ModelVersion
from gpucloud.models.rollout_messages import (
    ReasonInput,
    RolloutEvaluation,
    RolloutInput,
    RolloutProgress,
    RolloutTarget,
)
from gpucloud.models.tables import Node
from gpucloud.registry import promotion
from gpucloud.services import operations
from gpucloud.services.workflow_engine import engine_problem
from gpucloud.web.problems import Problem, field_of, invalid, not_found
from gpucloud.workflows import search_attributes
from gpucloud.workflows.rollout import RolloutWorkflow

router = APIRouter(prefix="/v1", tags=["rollouts"])


def _targets(
    settings: Settings, tenant_id: str, req: RolloutRequest
) -> tuple[list[RolloutTarget] | None, RolloutEvaluation | None]:
    """The explicit nodes as targets (each one the tenant's), after checking the version exists,
    and the evaluations of the version's model that the canary's check runs."""
    with read_scope(settings.database_url) as session:
        version = session.exec(
            select(ModelVersion).where(
                col(ModelVersion.tenant_id) == tenant_id, col(ModelVersion.digest) == req.model_version
            )
        ).first()
        if version is None:
            raise invalid("model_version", f"no version {req.model_version} in this tenant's registry")
        model = promotion.model_by_id(session, version.model_id)
        gates = promotion.gates_of(session, version.model_id)
        command = promotion.evaluation_of(model) if model is not None else None
        evaluation = RolloutEvaluation(gates=gates, command=command) if gates else None
        if req.node_ids is None:
            return None, evaluation
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
        raise invalid("node_ids", f"not nodes this tenant holds in an allocation: {', '.join(unknown[:10])}")
    targets = [
        RolloutTarget(node_id=n.id, agent_url=n.agent_url, rack=n.rack, site=n.region, allocation_id=n.allocation_id)
        for n in (nodes[i] for i in req.node_ids)
    ]
    return targets, evaluation


@router.post(
    "/rollouts", status_code=202, response_model=RolloutAccepted, responses={422: {"description": "invalid request"}}
)
async def create_rollout(
    request: Request,
    req: RolloutRequest,
    tenant: TenantDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        targets, evaluation = await run_in_threadpool(_targets, settings, tenant.tenant_id, req)
        # Under an Idempotency-Key the id comes from the key: a create re-run after its first try
        # died finds the rollout that try started instead of starting a second one.
        seed = f"{tenant.id}:{idempotency_key}" if idempotency_key else uuid.uuid4().hex
        rollout_id = f"rollout-{hashlib.sha256(seed.encode()).hexdigest()[:16]}"
        options = req.model_dump(exclude={"node_ids", "waves"}, exclude_none=True)
        try:
            inp = RolloutInput(
                rollout_id=rollout_id,
                tenant_id=tenant.tenant_id,
                nodes=targets,
                evaluation=evaluation,
                **options,
                **({"waves": req.waves} if req.waves else {}),
            )
        except ValidationError as exc:
            errors = [
                {"field": field_of(tuple(e["loc"])), "message": e["msg"].removeprefix("Value error, ")}
                for e in exc.errors()
            ]
            detail = "; ".join(e["message"] for e in errors)
            raise invalid(errors[0]["field"], errors[0]["message"], detail=detail, errors=errors) from None
        attributes = [
            (search_attributes.MODEL_VERSION, req.model_version),
            (search_attributes.TENANT_ID, tenant.tenant_id),
        ]
        if req.allocation_id:
            attributes.append((search_attributes.ALLOCATION_ID, req.allocation_id))
        try:
            await temporal.start_workflow(
                RolloutWorkflow.run,
                inp,
                id=rollout_id,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                task_queue=settings.temporal.task_queue,
                search_attributes=search_attributes.typed(*attributes),
            )
        except RPCError as exc:
            raise engine_problem(exc, what="the rollout", left="nothing was started") from exc
        progress = RolloutProgress(
            rollout_id=rollout_id, tenant_id=tenant.tenant_id, model_version=req.model_version, phase="resolving"
        )
        body = RolloutAccepted(rollout_id=rollout_id, progress=progress)
        return accepted(body, f"/v1/rollouts/{rollout_id}")

    return await idempotent(request, settings.database_url, tenant.id, idempotency_key, handler)


async def _visible(temporal: Client, caller: Caller, rollout_id: str) -> tuple[WorkflowHandle, RolloutProgress]:
    if not rollout_id.startswith("rollout-"):
        raise not_found("rollout", rollout_id)
    handle = temporal.get_workflow_handle(rollout_id)
    try:
        progress = await handle.query(RolloutWorkflow.progress)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise not_found("rollout", rollout_id) from None
        raise
    if not caller.is_operator and progress.tenant_id != caller.tenant_id:
        raise not_found("rollout", rollout_id)
    return handle, progress


@router.get("/rollouts/{rollout_id}", response_model=RolloutProgress)
async def get_rollout(rollout_id: str, caller: CallerDep, temporal: TemporalDep):
    return (await _visible(temporal, caller, rollout_id))[1]


async def _command(
    temporal: Client, settings: Settings, caller: Caller, rollout_id: str, command: str, req: RolloutCommand | None
) -> RolloutProgress:
    handle, progress = await _visible(temporal, caller, rollout_id)
    update = getattr(RolloutWorkflow, command)
    arg = ReasonInput(reason=req.reason if req else "")
    try:
        if command == "abort":  # the rollback may take a while: answer once the abort is accepted
            await handle.start_update(update, arg, wait_for_stage=WorkflowUpdateStage.ACCEPTED)
            answer = await handle.query(RolloutWorkflow.progress)
        else:
            answer = await handle.execute_update(update, arg)
    except WorkflowUpdateFailedError as exc:
        raise Problem(409, "rollout-conflict", f"Cannot {command}", str(exc.cause or exc)) from None
    except RPCError as exc:
        if exc.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
            raise Problem(
                409, "rollout-conflict", f"Cannot {command}", f"the rollout is already {progress.phase.value}"
            ) from None
        raise
    await run_in_threadpool(
        functools.partial(
            operations.record_done_in,
            settings.database_url,
            kind=f"rollout_{command}",
            resource_id=rollout_id,
            actor=caller.actor,
            tenant_id=progress.tenant_id,
        )
    )
    return answer


@router.post("/rollouts/{rollout_id}:pause", response_model=RolloutProgress)
async def pause_rollout(
    rollout_id: str,
    caller: CallerOrFleetOperatorDep,
    temporal: TemporalDep,
    settings: SettingsDep,
    req: RolloutCommand | None = None,
):
    return await _command(temporal, settings, caller, rollout_id, "pause", req)


@router.post("/rollouts/{rollout_id}:resume", response_model=RolloutProgress)
async def resume_rollout(
    rollout_id: str,
    caller: CallerOrFleetOperatorDep,
    temporal: TemporalDep,
    settings: SettingsDep,
    req: RolloutCommand | None = None,
):
    return await _command(temporal, settings, caller, rollout_id, "resume", req)


@router.post("/rollouts/{rollout_id}:abort", status_code=202, response_model=RolloutProgress)
async def abort_rollout(
    rollout_id: str,
    caller: CallerOrFleetOperatorDep,
    temporal: TemporalDep,
    settings: SettingsDep,
    req: RolloutCommand | None = None,
):
    return await _command(temporal, settings, caller, rollout_id, "abort", req)
