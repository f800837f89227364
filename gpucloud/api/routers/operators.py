"""Operator accounts (admins only, the `operators` scope): create one with a role and its first
token, list them with their tokens, rotate an account's token (the old one keeps working for a
grace period), revoke an account (all its tokens end at once). See `services.operators`.

A token's secret is in the response that creates it and nowhere else: with an Idempotency-Key, a
replay of a create answers the same body with `token` null. Who created an account is kept on it
(`created_by`); every change is logged with the admin who made it.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from functools import partial

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from gpucloud.api.deps import DbDep, OperatorsAdminDep, SettingsDep
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.config import Settings
from gpucloud.models.api_schemas import (
    OperatorList,
    OperatorRequest,
    OperatorRotateRequest,
    OperatorTokenIssued,
    OperatorView,
)
from gpucloud.services import operator_requests as requests
from gpucloud.services import operators as service

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["operators"])


def _lifetime(settings: Settings, expires_in_s: int | None) -> timedelta:
    return timedelta(seconds=expires_in_s or settings.api.operator_token_lifetime_s)


def _without_secret(body: bytes) -> bytes:
    return json.dumps({**json.loads(body), "token": None}).encode()


@router.post(
    "/operators",
    status_code=201,
    response_model=OperatorTokenIssued,
    responses={409: {"description": "the name is taken (names are never reused)"}},
)
async def create_operator(
    request: Request,
    req: OperatorRequest,
    admin: OperatorsAdminDep,
    db: DbDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
):
    """A named operator with a role, and its first token (shown once, here)."""

    async def handler() -> JSONResponse:
        lifetime = _lifetime(settings, req.expires_in_s)
        create = partial(requests.create, db, req.name, req.role, admin=admin.id, lifetime=lifetime)
        issued = await run_in_threadpool(create)
        log.info("%s created operator %s (%s)", admin.id, req.name, req.role.value)
        return JSONResponse(issued.model_dump(mode="json"), status_code=201)

    return await idempotent(request, db, admin.id, idempotency_key, handler, redact=_without_secret)


@router.get("/operators", response_model=OperatorList)
async def list_operators(admin: OperatorsAdminDep, db: DbDep):
    """Every named operator (the bootstrap admin is the settings' and not listed), with its
    tokens (never their secrets)."""
    return await run_in_threadpool(requests.list_all, db)


@router.post(
    "/operators/{name}/rotate",
    status_code=201,
    response_model=OperatorTokenIssued,
    responses={409: {"description": "the operator is revoked or has no live token"}},
)
async def rotate_operator(
    request: Request,
    name: str,
    admin: OperatorsAdminDep,
    db: DbDep,
    settings: SettingsDep,
    req: OperatorRotateRequest | None = None,
):
    """A new token for the operator; the old one keeps working for `grace_period_s`."""
    req = req or OperatorRotateRequest()
    grace, lifetime = timedelta(seconds=req.grace_period_s), _lifetime(settings, req.expires_in_s)
    issued = await run_in_threadpool(partial(requests.rotate, db, name, grace=grace, lifetime=lifetime))
    if issued.replaces:  # its grace starts now: no caller cached here outlives it
        request.app.state.credentials.forget(f"{service.TOKEN_PREFIX}{issued.replaces}")
    log.info("%s rotated operator %s's token %s", admin.id, name, issued.replaces)
    return JSONResponse(issued.model_dump(mode="json"), status_code=201)


@router.delete("/operators/{name}", response_model=OperatorView)
async def revoke_operator(request: Request, name: str, admin: OperatorsAdminDep, db: DbDep):
    """End the operator and all its tokens at once (the name is never reused)."""
    view = await run_in_threadpool(requests.revoke, db, name)
    for token in view.tokens:  # ended in this process at once; in other API processes within the cache's TTL
        request.app.state.credentials.forget(f"{service.TOKEN_PREFIX}{token.id}")
    log.info("%s revoked operator %s", admin.id, name)
    return view
