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

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlmodel import Session, col, select

from gpucloud.api.deps import OperatorsAdminDep, SettingsDep
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.api_schemas import (
    OperatorList,
    OperatorRequest,
    OperatorRotateRequest,
    OperatorTokenIssued,
    OperatorView,
)
from gpucloud.models.tables import Operator, OperatorPublic, OperatorToken, OperatorTokenPublic
from gpucloud.services import operators as service
from gpucloud.web.problems import Problem, not_found

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["operators"])


def _lifetime(settings: Settings, expires_in_s: int | None) -> timedelta:
    return timedelta(seconds=expires_in_s or settings.api.operator_token_lifetime_s)


def _issued(
    account: Operator, token: OperatorToken, plaintext: str, *, replaced: OperatorToken | None = None
) -> OperatorTokenIssued:
    body = OperatorTokenIssued(
        operator=OperatorPublic.model_validate(account, from_attributes=True),
        token_id=token.id,
        token=plaintext,
        expires_at=token.expires_at,
    )
    if replaced is not None:
        body.replaces, body.replaced_token_expires_at = replaced.id, replaced.expires_at
    return body


def _view(session: Session, account: Operator) -> OperatorView:
    tokens = [
        OperatorTokenPublic.model_validate(t, from_attributes=True) for t in service.tokens(session, account.name)
    ]
    return OperatorView(**OperatorPublic.model_validate(account, from_attributes=True).model_dump(), tokens=tokens)


def _create(settings: Settings, req: OperatorRequest, admin: str) -> OperatorTokenIssued:
    try:
        with session_scope(settings.database_url) as session:
            lifetime = _lifetime(settings, req.expires_in_s)
            account, token, plaintext = service.create(session, req.name, req.role, created_by=admin, lifetime=lifetime)
            return _issued(account, token, plaintext)
    except service.OperatorExists as exc:
        raise Problem(
            409, "operator-exists", "Operator exists", str(exc), errors=[{"field": "name", "message": "taken"}]
        ) from exc


def _list(settings: Settings) -> OperatorList:
    with session_scope(settings.database_url) as session:
        accounts = session.exec(select(Operator).order_by(col(Operator.created_at))).all()
        return OperatorList(items=[_view(session, a) for a in accounts])


def _rotate(settings: Settings, name: str, req: OperatorRotateRequest) -> OperatorTokenIssued:
    try:
        with session_scope(settings.database_url) as session:
            old, new, plaintext = service.rotate(
                session,
                name,
                grace=timedelta(seconds=req.grace_period_s),
                lifetime=_lifetime(settings, req.expires_in_s),
            )
            return _issued(service.get(session, name), new, plaintext, replaced=old)
    except service.OperatorNotFound as exc:
        raise not_found("operator", name) from exc
    except service.TokenNotRotatable as exc:
        raise Problem(409, "token-not-rotatable", "Token cannot be rotated", str(exc)) from exc


def _revoke(settings: Settings, name: str) -> OperatorView:
    try:
        with session_scope(settings.database_url) as session:
            return _view(session, service.revoke(session, name))
    except service.OperatorNotFound as exc:
        raise not_found("operator", name) from exc


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
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
):
    """A named operator with a role, and its first token (shown once, here)."""

    async def handler() -> JSONResponse:
        issued = await run_in_threadpool(_create, settings, req, admin.id)
        log.info("%s created operator %s (%s)", admin.id, req.name, req.role.value)
        return JSONResponse(issued.model_dump(mode="json"), status_code=201)

    return await idempotent(request, settings.database_url, admin.id, idempotency_key, handler, redact=_without_secret)


@router.get("/operators", response_model=OperatorList)
async def list_operators(admin: OperatorsAdminDep, settings: SettingsDep):
    """Every named operator (the bootstrap admin is the settings' and not listed), with its
    tokens (never their secrets)."""
    return await run_in_threadpool(_list, settings)


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
    settings: SettingsDep,
    req: OperatorRotateRequest | None = None,
):
    """A new token for the operator; the old one keeps working for `grace_period_s`."""
    issued = await run_in_threadpool(_rotate, settings, name, req or OperatorRotateRequest())
    if issued.replaces:  # its grace starts now: no caller cached here outlives it
        request.app.state.credentials.forget(f"{service.TOKEN_PREFIX}{issued.replaces}")
    log.info("%s rotated operator %s's token %s", admin.id, name, issued.replaces)
    return JSONResponse(issued.model_dump(mode="json"), status_code=201)


@router.delete("/operators/{name}", response_model=OperatorView)
async def revoke_operator(request: Request, name: str, admin: OperatorsAdminDep, settings: SettingsDep):
    """End the operator and all its tokens at once (the name is never reused)."""
    view = await run_in_threadpool(_revoke, settings, name)
    for token in view.tokens:  # ended in this process at once; in other API processes within the cache's TTL
        request.app.state.credentials.forget(f"{service.TOKEN_PREFIX}{token.id}")
    log.info("%s revoked operator %s", admin.id, name)
    return view
