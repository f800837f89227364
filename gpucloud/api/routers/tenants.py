"""Tenants: onboarding (202 + operation), reads, quotas, offboarding (202 + operation).

`POST /v1/tenants` (operator) writes the tenant (`onboarding`), its quotas (exactly the
request's: none given, it may allocate nothing until an operator grants some), its first API key and the
operation in one transaction, then starts the onboarding workflow, which allocates the VNI and
the storage and makes the tenant `active` (or `failed`, with everything undone). The response
carries the key's secret, the only time it is ever shown: the server keeps only its hash, and a
replay of the request (same Idempotency-Key) answers the same body with `api_key.key` null. A
client that lost the first answer revokes that key and creates another.

A tenant reads its own record and quotas; another tenant's id is a 404, like one that does not
exist. `DELETE /v1/tenants/{id}` (operator) starts offboarding.

Each change names the operator who made it on an operation (`Operation.actor`): onboarding's and
offboarding's, and for a quota change, which ends within its request, a settled `replace_quotas`
operation written in the same transaction as the quotas.
"""

from __future__ import annotations

import functools
import json

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlmodel import Session

from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, DbDep, ReadOperatorDep, ReadsDep, SettingsDep, TemporalDep, TenantsOperatorDep
from gpucloud.api.idempotency import IdempotencyKey, accepted, idempotent
from gpucloud.models.api_schemas import (
    QuotaReport,
    QuotasRequest,
    TenantAccepted,
    TenantOperation,
    TenantPage,
    TenantRequest,
)
from gpucloud.models.tables import (
    Operation,
    OperationPublic,
    Tenant,
    TenantPublic,
    TenantStatus,
)
from gpucloud.services import tenant_requests as requests

router = APIRouter(prefix="/v1", tags=["tenants"])


def _public(tenant: Tenant) -> TenantPublic:
    return TenantPublic.model_validate(tenant, from_attributes=True)


def _op_public(op: Operation) -> OperationPublic:
    return OperationPublic.model_validate(op, from_attributes=True)


def visible_tenant(session: Session, caller: Caller, tenant_id: str) -> Tenant:
    """The tenant, if the caller may see it: operators all, a tenant only itself (else 404)."""
    return requests.visible_tenant(session, tenant_id, caller_tenant_id=caller.tenant_id, operator=caller.is_operator)


def _without_secret(body: bytes) -> bytes:
    data = json.loads(body)
    data["api_key"]["key"] = None
    return json.dumps(data).encode()


@router.post(
    "/tenants",
    status_code=202,
    response_model=TenantAccepted,
    responses={409: {"description": "the name is taken"}, 422: {"description": "invalid request"}},
)
async def create_tenant(
    request: Request,
    req: TenantRequest,
    operator: TenantsOperatorDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        created = await requests.onboard(db, temporal, settings, req.name, req.quotas, actor=operator.actor)
        return accepted(created, f"/v1/tenants/{created.id}")

    return await idempotent(request, db, operator.id, idempotency_key, handler, redact=_without_secret)


@router.get("/tenants", response_model=TenantPage)
def list_tenants(
    operator: ReadOperatorDep,
    reads: ReadsDep,
    page: pagination.PageDep,
    status: TenantStatus | None = None,
):
    with reads() as session:
        rows, token = pagination.fetch(session, Tenant, "seq", page=page, equal={"status": status})
        return TenantPage(items=[_public(t) for t in rows], next_page_token=token)


@router.get("/tenants/{tenant_id}", response_model=TenantPublic)
def get_tenant(tenant_id: str, caller: CallerDep, reads: ReadsDep):
    with reads() as session:
        return _public(visible_tenant(session, caller, tenant_id))


@router.delete(
    "/tenants/{tenant_id}",
    status_code=202,
    response_model=TenantOperation,
    responses={409: {"description": "the tenant is still onboarding"}},
)
async def delete_tenant(
    tenant_id: str, operator: TenantsOperatorDep, db: DbDep, settings: SettingsDep, temporal: TemporalDep
):
    """Offboard: cancel the tenant's allocations, wait for their nodes' wipes, revoke its keys,
    release its VNI and schedule its storage's deletion. Repeating it returns the same operation."""
    tenant, op = await requests.offboard(db, temporal, settings, tenant_id, actor=operator.actor)
    body = TenantOperation(tenant=_public(tenant), operation=_op_public(op))
    return JSONResponse(body.model_dump(mode="json"), status_code=202)


@router.get("/tenants/{tenant_id}/quotas", response_model=QuotaReport)
def get_quotas(tenant_id: str, caller: CallerDep, reads: ReadsDep):
    with reads(snapshot=True) as session:  # the quotas and the usage against them, at one moment
        visible_tenant(session, caller, tenant_id)
        return requests.quota_report(session, tenant_id)


@router.put("/tenants/{tenant_id}/quotas", response_model=QuotaReport)
async def put_quotas(tenant_id: str, req: QuotasRequest, operator: TenantsOperatorDep, db: DbDep):
    """Replace the tenant's quotas (operator). Lowering one below the usage stops new
    allocations there; nothing running is taken away."""
    return await run_in_threadpool(
        functools.partial(requests.replace_quotas, db, tenant_id, req.quotas, actor=operator.actor)
    )
