"""API keys: create, list, rotate (the old key keeps working for a grace period), revoke (at once).

A tenant manages its own keys under `/v1/api-keys`; operators manage any tenant's under
`/v1/tenants/{tenant id}/api-keys` (a tenant may use those paths for itself too, and gets a 404
for any other tenant). A new key's secret is in the response that creates it and nowhere else:
with an Idempotency-Key, a replay answers the same body with `key` null.
"""

from __future__ import annotations

import json
from datetime import timedelta

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from sqlmodel import col, select

from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, SettingsDep, TenantDep
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.api.schemas import (
    ApiKeyCreated,
    ApiKeyList,
    RotateRequest,
)
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.tables import ApiKeyPublic, Tenant, TenantStatus
from gpucloud.services import api_keys as key_service
from gpucloud.web.problems import Problem, not_found

router = APIRouter(prefix="/v1", tags=["api-keys"])

# A tenant being onboarded gets its keys ready; one that failed or is leaving gets none.
ISSUING = (TenantStatus.ONBOARDING, TenantStatus.ACTIVE)


def _scope(caller: Caller, tenant_id: str) -> str:
    if not caller.is_operator and caller.tenant_id != tenant_id:
        raise not_found("tenant", tenant_id)
    return tenant_id


def _issuing_tenant(session, tenant_id: str) -> None:
    status = session.exec(select(col(Tenant.status)).where(col(Tenant.id) == tenant_id).with_for_update()).first()
    if status is None:
        raise not_found("tenant", tenant_id)
    if status not in ISSUING:
        raise Problem(
            409,
            "tenant-not-active",
            "Tenant takes no new keys",
            f"tenant {tenant_id} is {status}; keys are issued to onboarding and active tenants only",
            tenant_status=status,
        )


def _issue(settings: Settings, tenant_id: str) -> ApiKeyCreated:
    with session_scope(settings.database_url) as session:
        _issuing_tenant(session, tenant_id)
        key, plaintext = key_service.issue_key(session, tenant_id)
        session.flush()
        return ApiKeyCreated(id=key.id, tenant_id=tenant_id, key=plaintext, created_at=key.created_at)


def _rotate(settings: Settings, tenant_id: str, key_id: str, grace_s: int) -> ApiKeyCreated:
    try:
        with session_scope(settings.database_url) as session:
            _issuing_tenant(session, tenant_id)
            old, new, plaintext = key_service.rotate_key(session, tenant_id, key_id, grace=timedelta(seconds=grace_s))
            return ApiKeyCreated(
                id=new.id,
                tenant_id=tenant_id,
                key=plaintext,
                created_at=new.created_at,
                replaces=old.id,
                replaced_key_expires_at=old.expires_at,
            )
    except key_service.KeyNotFound as exc:
        raise not_found("api key", key_id) from exc
    except key_service.KeyNotRotatable as exc:
        raise Problem(409, "key-not-rotatable", "Key cannot be rotated", str(exc)) from exc


def _revoke(settings: Settings, tenant_id: str, key_id: str) -> ApiKeyPublic:
    try:
        with session_scope(settings.database_url) as session:
            return ApiKeyPublic.model_validate(key_service.revoke_key(session, tenant_id, key_id), from_attributes=True)
    except key_service.KeyNotFound as exc:
        raise not_found("api key", key_id) from exc


def _list(settings: Settings, tenant_id: str) -> ApiKeyList:
    with session_scope(settings.database_url) as session:
        if session.exec(select(col(Tenant.id)).where(col(Tenant.id) == tenant_id)).first() is None:
            raise not_found("tenant", tenant_id)
        return ApiKeyList(
            items=[
                ApiKeyPublic.model_validate(k, from_attributes=True) for k in key_service.list_keys(session, tenant_id)
            ]
        )


def _without_secret(body: bytes) -> bytes:
    return json.dumps({**json.loads(body), "key": None}).encode()


async def _created(request: Request, settings: Settings, caller: Caller, idempotency_key: str | None, make) -> Response:
    async def handler() -> JSONResponse:
        created = await run_in_threadpool(make)
        return JSONResponse(created.model_dump(mode="json"), status_code=201)

    return await idempotent(request, settings.database_url, caller.id, idempotency_key, handler, redact=_without_secret)


# ---------------------------------------------------------------- the caller's own keys


@router.get("/api-keys", response_model=ApiKeyList)
async def list_own_keys(tenant: TenantDep, settings: SettingsDep):
    return await run_in_threadpool(_list, settings, tenant.tenant_id)


@router.post("/api-keys", status_code=201, response_model=ApiKeyCreated)
async def create_own_key(
    request: Request, tenant: TenantDep, settings: SettingsDep, idempotency_key: IdempotencyKey = None
):
    return await _created(request, settings, tenant, idempotency_key, lambda: _issue(settings, tenant.tenant_id))


@router.post(
    "/api-keys/{key_id}/rotate",
    status_code=201,
    response_model=ApiKeyCreated,
    responses={409: {"description": "the key is revoked, expired or already rotated"}},
)
async def rotate_own_key(
    request: Request,
    key_id: str,
    tenant: TenantDep,
    settings: SettingsDep,
    req: RotateRequest | None = None,
    idempotency_key: IdempotencyKey = None,
):
    grace = (req or RotateRequest()).grace_period_s
    return await _created(
        request, settings, tenant, idempotency_key, lambda: _rotate(settings, tenant.tenant_id, key_id, grace)
    )


@router.delete("/api-keys/{key_id}", response_model=ApiKeyPublic)
async def revoke_own_key(key_id: str, tenant: TenantDep, settings: SettingsDep):
    return await run_in_threadpool(_revoke, settings, tenant.tenant_id, key_id)


# ---------------------------------------------------------------- any tenant's keys (operator)


@router.get("/tenants/{tenant_id}/api-keys", response_model=ApiKeyList)
async def list_keys(tenant_id: str, caller: CallerDep, settings: SettingsDep):
    return await run_in_threadpool(_list, settings, _scope(caller, tenant_id))


@router.post("/tenants/{tenant_id}/api-keys", status_code=201, response_model=ApiKeyCreated)
async def create_key(
    request: Request,
    tenant_id: str,
    caller: CallerDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
):
    scoped = _scope(caller, tenant_id)
    return await _created(request, settings, caller, idempotency_key, lambda: _issue(settings, scoped))


@router.post(
    "/tenants/{tenant_id}/api-keys/{key_id}/rotate",
    status_code=201,
    response_model=ApiKeyCreated,
    responses={409: {"description": "the key is revoked, expired or already rotated"}},
)
async def rotate_key(
    request: Request,
    tenant_id: str,
    key_id: str,
    caller: CallerDep,
    settings: SettingsDep,
    req: RotateRequest | None = None,
    idempotency_key: IdempotencyKey = None,
):
    scoped = _scope(caller, tenant_id)
    grace = (req or RotateRequest()).grace_period_s
    return await _created(request, settings, caller, idempotency_key, lambda: _rotate(settings, scoped, key_id, grace))


@router.delete("/tenants/{tenant_id}/api-keys/{key_id}", response_model=ApiKeyPublic)
async def revoke_key(tenant_id: str, key_id: str, caller: CallerDep, settings: SettingsDep):
    return await run_in_threadpool(_revoke, settings, _scope(caller, tenant_id), key_id)
