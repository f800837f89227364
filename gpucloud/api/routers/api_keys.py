"""API keys: create, list, rotate (the old key keeps working for the grace period the rotation
names, `grace_period_s`, which has no default), revoke (at once).

A tenant holds at most `api.max_api_keys_per_tenant` live keys (admission shares slots per
tenant whatever its keys, and a bounded set of keys keeps a leaked one findable); a create past
it is a 409 that says to revoke one. A rotation replaces a key, so it is not held to the cap.

A tenant manages its own keys under `/v1/api-keys`; operators manage any tenant's under
`/v1/tenants/{tenant id}/api-keys` (a tenant may use those paths for itself too, and gets a 404
for any other tenant). A new key's secret is in the response that creates it and nowhere else:
with an Idempotency-Key, a replay answers the same body with `key` null.

Every issue, rotation and revocation leaves a settled operation (`issue_api_key`,
`rotate_api_key`, `revoke_api_key`, the key's id as its resource) naming who did it, written in
the key's own transaction: an operator's change to a tenant's keys, or a tenant's with which key.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, CallerOrTenantsOperatorDep, DbDep, SettingsDep, TenantDep
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.db import Database
from gpucloud.models.api_schemas import (
    ApiKeyCreated,
    ApiKeyList,
    RotateRequest,
)
from gpucloud.models.tables import ApiKeyPublic
from gpucloud.services import api_key_requests as requests
from gpucloud.web.problems import invalid, not_found

router = APIRouter(prefix="/v1", tags=["api-keys"])

GRACE_REQUIRED = (
    'required: send {"grace_period_s": SECONDS}, how long the old key keeps working '
    "(0: it stops at once, cutting off whatever still uses it)"
)


def _scope(caller: Caller, tenant_id: str) -> str:
    if not caller.is_operator and caller.tenant_id != tenant_id:
        raise not_found("tenant", tenant_id)
    return tenant_id


def _without_secret(body: bytes) -> bytes:
    return json.dumps({**json.loads(body), "key": None}).encode()


async def _created(request: Request, db: Database, caller: Caller, idempotency_key: str | None, make) -> Response:
    async def handler() -> JSONResponse:
        created = await run_in_threadpool(make)
        return JSONResponse(created.model_dump(mode="json"), status_code=201)

    return await idempotent(request, db, caller.id, idempotency_key, handler, redact=_without_secret)


def _forget(request: Request, key_id: str) -> None:
    """This process stops taking the key at once; other API processes within their cache's TTL
    (`api.credential_cache_s`, api/gate.py)."""
    request.app.state.credentials.forget(f"gpc_{key_id}")


@dataclass(frozen=True)
class _Scoped:
    """Whose keys a request manages, and who asks (the idempotency records are the caller's)."""

    caller: Caller
    tenant_id: str


async def _own(tenant: TenantDep) -> _Scoped:
    return _Scoped(tenant, tenant.tenant_id)


async def _any_read(tenant_id: str, caller: CallerDep) -> _Scoped:
    return _Scoped(caller, _scope(caller, tenant_id))


async def _any_change(tenant_id: str, caller: CallerOrTenantsOperatorDep) -> _Scoped:
    return _Scoped(caller, _scope(caller, tenant_id))


Scoping = Callable[..., Awaitable[_Scoped]]


def _key_routes(prefix: str, read: Scoping, change: Scoping, tag: str) -> None:
    """The four key routes under `prefix`: the caller's own keys (`/api-keys`) or any tenant's
    (`/tenants/{tenant_id}/api-keys`, operators holding `tenants` to change them; a tenant for
    itself)."""
    read_by, scoped_by = Depends(read), Depends(change)
    conflict: dict[int | str, dict[str, Any]] = {409: {"description": "the key is revoked, expired or already rotated"}}

    @router.get(prefix, response_model=ApiKeyList, name=f"list_{tag}")
    async def list_keys(db: DbDep, scoped: _Scoped = read_by):
        return await run_in_threadpool(requests.list_keys, db, scoped.tenant_id)

    too_many: dict[int | str, dict[str, Any]] = {
        409: {"description": "the tenant is not active, or already holds its most live keys (revoke one)"}
    }

    @router.post(prefix, status_code=201, response_model=ApiKeyCreated, responses=too_many, name=f"create_{tag}")
    async def create_key(
        request: Request,
        db: DbDep,
        settings: SettingsDep,
        scoped: _Scoped = scoped_by,
        idempotency_key: IdempotencyKey = None,
    ):
        cap = settings.api.max_api_keys_per_tenant
        make = partial(requests.issue, db, scoped.tenant_id, actor=scoped.caller.actor, max_keys=cap)
        return await _created(request, db, scoped.caller, idempotency_key, make)

    @router.post(
        f"{prefix}/{{key_id}}/rotate",
        status_code=201,
        response_model=ApiKeyCreated,
        responses=conflict,
        name=f"rotate_{tag}",
        # The body is required (its `grace_period_s` is); FastAPI is told it is optional only so
        # that a rotation sent without one hears which field to send, not "body: Field required".
        openapi_extra={"requestBody": {"required": True}},
    )
    async def rotate_key(
        request: Request,
        key_id: str,
        db: DbDep,
        scoped: _Scoped = scoped_by,
        req: RotateRequest | None = None,
        idempotency_key: IdempotencyKey = None,
    ):
        if req is None:
            raise invalid("grace_period_s", GRACE_REQUIRED)
        grace_s, actor = req.grace_period_s, scoped.caller.actor
        make = partial(requests.rotate, db, scoped.tenant_id, key_id, grace_s=grace_s, actor=actor)
        try:
            return await _created(request, db, scoped.caller, idempotency_key, make)
        finally:
            _forget(request, key_id)  # its grace starts now: no cached caller outlives it here

    @router.delete(f"{prefix}/{{key_id}}", response_model=ApiKeyPublic, name=f"revoke_{tag}")
    async def revoke_key(request: Request, key_id: str, db: DbDep, scoped: _Scoped = scoped_by):
        revoke = partial(requests.revoke, db, scoped.tenant_id, key_id, actor=scoped.caller.actor)
        revoked = await run_in_threadpool(revoke)
        _forget(request, key_id)
        return revoked


_key_routes("/api-keys", _own, _own, "own_keys")
_key_routes("/tenants/{tenant_id}/api-keys", _any_read, _any_change, "keys")
