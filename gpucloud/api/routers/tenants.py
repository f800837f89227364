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

import json

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlmodel import Session, col, select
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import start_tenant_offboarding, start_tenant_onboarding
from gpucloud.api import pagination
from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, ReadOperatorDep, ReadsDep, SettingsDep, TemporalDep, TenantsOperatorDep
from gpucloud.api.idempotency import IdempotencyKey, accepted, idempotent
from gpucloud.api.routers.api_keys import ApiKeyCreated
from gpucloud.api.schemas import (
    QuotaReport,
    QuotaRequest,
    QuotasRequest,
    QuotaUsage,
    TenantAccepted,
    TenantOperation,
    TenantPage,
    TenantRequest,
)
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.tables import (
    Operation,
    OperationPublic,
    Tenant,
    TenantPublic,
    TenantQuotaBase,
    TenantStatus,
)
from gpucloud.services import operations
from gpucloud.services import quotas as quota_service
from gpucloud.services import tenants as tenant_service
from gpucloud.services.workflow_engine import engine_problem
from gpucloud.web.problems import Problem, not_found

router = APIRouter(prefix="/v1", tags=["tenants"])

QUOTAS_OPERATION = "replace_quotas"


def _public(tenant: Tenant) -> TenantPublic:
    return TenantPublic.model_validate(tenant, from_attributes=True)


def _op_public(op: Operation) -> OperationPublic:
    return OperationPublic.model_validate(op, from_attributes=True)


def visible_tenant(session: Session, caller: Caller, tenant_id: str) -> Tenant:
    """The tenant, if the caller may see it: operators all, a tenant only itself (else 404)."""
    if not caller.is_operator and caller.tenant_id != tenant_id:
        raise not_found("tenant", tenant_id)
    tenant = session.exec(select(Tenant).where(col(Tenant.id) == tenant_id)).first()
    if tenant is None:
        raise not_found("tenant", tenant_id)
    return tenant


def _create(settings: Settings, req: TenantRequest, actor: str) -> TenantAccepted:
    quotas = sorted(
        (TenantQuotaBase(gpu_type=q.gpu_type, region=q.region, max_gpus=q.max_gpus) for q in req.quotas),
        key=lambda q: (q.gpu_type, q.region),
    )
    try:
        with session_scope(settings.database_url) as session:
            tenant, op, key, plaintext = tenant_service.create(session, name=req.name, quotas=quotas, actor=actor)
            return TenantAccepted(
                **_public(tenant).model_dump(),
                quotas=quotas,
                operation=_op_public(op),
                api_key=ApiKeyCreated(id=key.id, tenant_id=tenant.id, key=plaintext, created_at=key.created_at),
            )
    except tenant_service.TenantExists as exc:
        raise Problem(
            409,
            "tenant-exists",
            "Tenant exists",
            f"name: a tenant named {req.name!r} exists or existed; names are never reused",
            errors=[{"field": "name", "message": "taken"}],
        ) from exc


def _discard(settings: Settings, tenant_id: str) -> None:
    with session_scope(settings.database_url) as session:
        tenant_service.discard(session, tenant_id)


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
    settings: SettingsDep,
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        created = await run_in_threadpool(_create, settings, req, operator.actor)
        try:
            await start_tenant_onboarding(temporal, settings, created.id, created.operation.id)
        except RPCError as exc:
            await run_in_threadpool(_discard, settings, created.id)
            raise engine_problem(exc, what="the onboarding", left="nothing was kept") from exc
        return accepted(created, f"/v1/tenants/{created.id}")

    return await idempotent(
        request, settings.database_url, operator.id, idempotency_key, handler, redact=_without_secret
    )


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


def _begin_offboarding(settings: Settings, tenant_id: str, actor: str) -> tuple[Tenant, Operation, bool]:
    try:
        with session_scope(settings.database_url) as session:
            return tenant_service.begin_offboarding(session, tenant_id, actor=actor)
    except tenant_service.TenantNotFound as exc:
        raise not_found("tenant", tenant_id) from exc
    except tenant_service.TenantStateConflict as exc:
        raise Problem(
            409,
            "tenant-busy",
            "Tenant cannot be offboarded now",
            f"tenant {tenant_id} is {exc.status}; offboard it once its onboarding has ended",
            tenant_status=exc.status,
        ) from exc


@router.delete(
    "/tenants/{tenant_id}",
    status_code=202,
    response_model=TenantOperation,
    responses={409: {"description": "the tenant is still onboarding"}},
)
async def delete_tenant(tenant_id: str, operator: TenantsOperatorDep, settings: SettingsDep, temporal: TemporalDep):
    """Offboard: cancel the tenant's allocations, wait for their nodes' wipes, revoke its keys,
    release its VNI and schedule its storage's deletion. Repeating it returns the same operation."""
    tenant, op, _ = await run_in_threadpool(_begin_offboarding, settings, tenant_id, operator.actor)
    # Started on every call (the id makes it once): a start lost to an outage is made up here,
    # or by the worker's start-up recovery.
    try:
        await start_tenant_offboarding(temporal, settings, tenant_id, op.id)
    except RPCError as exc:
        raise engine_problem(
            exc, what="the offboarding", left="the offboarding is recorded and the next DELETE starts it"
        ) from exc
    body = TenantOperation(tenant=_public(tenant), operation=_op_public(op))
    return JSONResponse(body.model_dump(mode="json"), status_code=202)


def quota_report(session: Session, tenant_id: str) -> QuotaReport:
    """The tenant's granted quotas and what it holds against them (`GET .../quotas`, `whoami`)."""
    rows = quota_service.quota_rows(session, tenant_id)
    return QuotaReport(
        tenant_id=tenant_id,
        quotas=[TenantQuotaBase(gpu_type=r.gpu_type, region=r.region, max_gpus=r.max_gpus) for r in rows],
        usage=[
            QuotaUsage(
                gpu_type=u.gpu_type,
                region=u.region,
                usage_gpus=u.usage_gpus,
                usage_nodes=u.usage_nodes,
                max_gpus=u.limit.max_gpus if u.limit else 0,
                quota=(
                    TenantQuotaBase(gpu_type=u.limit.gpu_type, region=u.limit.region, max_gpus=u.limit.max_gpus)
                    if u.limit
                    else None
                ),
            )
            for u in quota_service.usage_report(session, tenant_id)
        ],
    )


@router.get("/tenants/{tenant_id}/quotas", response_model=QuotaReport)
def get_quotas(tenant_id: str, caller: CallerDep, reads: ReadsDep):
    with reads(snapshot=True) as session:  # the quotas and the usage against them, at one moment
        visible_tenant(session, caller, tenant_id)
        return quota_report(session, tenant_id)


def _replace_quotas(settings: Settings, tenant_id: str, quotas: list[QuotaRequest], actor: str) -> QuotaReport:
    with session_scope(settings.database_url) as session:
        # The row lock that allocation admission takes: a change lands between two admissions.
        if session.exec(select(col(Tenant.id)).where(col(Tenant.id) == tenant_id).with_for_update()).first() is None:
            raise not_found("tenant", tenant_id)
        quota_service.replace_quotas(session, tenant_id, [TenantQuotaBase(**q.model_dump()) for q in quotas])
        operations.record_done(session, kind=QUOTAS_OPERATION, resource_id=tenant_id, tenant_id=tenant_id, actor=actor)
        return quota_report(session, tenant_id)


@router.put("/tenants/{tenant_id}/quotas", response_model=QuotaReport)
async def put_quotas(tenant_id: str, req: QuotasRequest, operator: TenantsOperatorDep, settings: SettingsDep):
    """Replace the tenant's quotas (operator). Lowering one below the usage stops new
    allocations there; nothing running is taken away."""
    return await run_in_threadpool(_replace_quotas, settings, tenant_id, req.quotas, operator.actor)
