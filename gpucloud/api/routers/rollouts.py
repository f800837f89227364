"""Rollouts: start a staged rollout of a model version (idempotent, 202), read its progress, list
rollouts, and pause, resume or abort one. What each asks and refuses is the service's
(`services/rollout_requests.py`); this module is the HTTP: the caller, the pages, the answers.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from temporalio.client import Client

from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, CallerOrFleetOperatorDep, DbDep, SettingsDep, TemporalDep, TenantDep
from gpucloud.api.idempotency import IdempotencyKey, accepted, idempotent
from gpucloud.db import Database
from gpucloud.models.api_schemas import (
    RolloutAccepted,
    RolloutCommand,
    RolloutPage,
    RolloutRequest,
)
from gpucloud.models.rollout_messages import RolloutProgress
from gpucloud.services import rollout_requests as requests
from gpucloud.services.rollout_requests import ROLLOUT_START_GRACE_S

__all__ = ["ROLLOUT_START_GRACE_S", "router"]

router = APIRouter(prefix="/v1", tags=["rollouts"])


@router.post(
    "/rollouts",
    status_code=202,
    response_model=RolloutAccepted,
    responses={
        404: {"description": "the model, alias, version or allocation `model_version` or `allocation_id` names"},
        409: {"description": "the target allocation is not ready, or another rollout runs on it (named)"},
        422: {"description": "invalid request, or a digest prefix that matches several versions (named)"},
    },
)
async def create_rollout(
    request: Request,
    req: RolloutRequest,
    tenant: TenantDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        # Under an Idempotency-Key the rollout's id comes from the key (`requests.create`).
        seed = f"{tenant.id}:{idempotency_key}" if idempotency_key else None
        started = await requests.create(db, temporal, settings, tenant.tenant_id, req, seed=seed)
        body = RolloutAccepted(
            rollout_id=started.progress.rollout_id, progress=started.progress, warnings=started.warnings
        )
        return accepted(body, f"/v1/rollouts/{body.rollout_id}")

    return await idempotent(request, db, tenant.id, idempotency_key, handler)


@router.get("/rollouts", response_model=RolloutPage, responses={400: {"description": "a page token not issued here"}})
async def list_rollouts(caller: CallerDep, temporal: TemporalDep, page: pagination.PageDep):
    """The caller's rollouts (an operator's: every tenant's), newest first: running ones, then the
    rest by when they ended, as the workflow engine's index orders them (it may lag a start by a
    moment). The page token wraps the engine's own, bound to the caller."""
    filters = {"tenant_id": None if caller.is_operator else caller.tenant_id}
    cursor = pagination.decode(page.token, filters, str)
    items, token = await requests.list_rollouts(
        temporal,
        tenant_id=filters["tenant_id"],
        page_size=page.size,
        next_page_token=base64.urlsafe_b64decode(cursor.after) if isinstance(cursor.after, str) else None,
    )
    next_token = pagination.encode(base64.urlsafe_b64encode(token).decode(), filters) if token else ""
    return RolloutPage(items=items, next_page_token=next_token)


@router.get("/rollouts/{rollout_id}", response_model=RolloutProgress)
async def get_rollout(rollout_id: str, caller: CallerDep, temporal: TemporalDep):
    return await requests.visible(temporal, rollout_id, tenant_id=caller.tenant_id, operator=caller.is_operator)


async def _command(
    temporal: Client, db: Database, caller: Caller, rollout_id: str, command: str, req: RolloutCommand | None
) -> RolloutProgress:
    return await requests.send_command(
        temporal,
        db,
        rollout_id,
        command,
        req,
        tenant_id=caller.tenant_id,
        operator=caller.is_operator,
        actor=caller.actor,
    )


@router.post("/rollouts/{rollout_id}:pause", response_model=RolloutProgress)
async def pause_rollout(
    rollout_id: str,
    caller: CallerOrFleetOperatorDep,
    temporal: TemporalDep,
    db: DbDep,
    req: RolloutCommand | None = None,
):
    return await _command(temporal, db, caller, rollout_id, "pause", req)


@router.post("/rollouts/{rollout_id}:resume", response_model=RolloutProgress)
async def resume_rollout(
    rollout_id: str,
    caller: CallerOrFleetOperatorDep,
    temporal: TemporalDep,
    db: DbDep,
    req: RolloutCommand | None = None,
):
    return await _command(temporal, db, caller, rollout_id, "resume", req)


@router.post("/rollouts/{rollout_id}:abort", status_code=202, response_model=RolloutProgress)
async def abort_rollout(
    rollout_id: str,
    caller: CallerOrFleetOperatorDep,
    temporal: TemporalDep,
    db: DbDep,
    req: RolloutCommand | None = None,
):
    return await _command(temporal, db, caller, rollout_id, "abort", req)
