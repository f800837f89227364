"""What operators and tenants ask of tenants through the API: onboarding (the tenant, its quotas,
its first API key and the operation in one transaction, then the onboarding workflow), quotas and
what is held against them, offboarding. Refusals are domain errors (`services/errors.py`)."""

from __future__ import annotations

from collections.abc import Sequence

from anyio import to_thread
from sqlmodel import Session, col, select
from temporalio.client import Client
from temporalio.service import RPCError

from gpucloud.adapters.temporal_gateway import start_tenant_offboarding, start_tenant_onboarding
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.models.api_schemas import ApiKeyCreated, QuotaReport, QuotaRequest, QuotaUsage, TenantAccepted
from gpucloud.models.tables import Operation, OperationPublic, Tenant, TenantPublic, TenantQuotaBase
from gpucloud.services import operations
from gpucloud.services import quotas as quota_service
from gpucloud.services import tenants as tenant_service
from gpucloud.services.errors import Conflict, NotFound
from gpucloud.services.workflow_engine import engine_error

QUOTAS_OPERATION = "replace_quotas"


def visible_tenant(session: Session, tenant_id: str, *, caller_tenant_id: str | None, operator: bool) -> Tenant:
    """The tenant, if the caller may see it: operators all, a tenant only itself (else NotFound)."""
    if not operator and caller_tenant_id != tenant_id:
        raise NotFound("tenant", tenant_id)
    tenant = session.exec(select(Tenant).where(col(Tenant.id) == tenant_id)).first()
    if tenant is None:
        raise NotFound("tenant", tenant_id)
    return tenant


def _record(db: Database, name: str, quotas: list[TenantQuotaBase], actor: str) -> TenantAccepted:
    try:
        with db.session() as session:
            tenant, op, key, plaintext = tenant_service.create(session, name=name, quotas=quotas, actor=actor)
            return TenantAccepted(
                **TenantPublic.model_validate(tenant, from_attributes=True).model_dump(),
                quotas=quotas,
                operation=OperationPublic.model_validate(op, from_attributes=True),
                api_key=ApiKeyCreated(id=key.id, tenant_id=tenant.id, key=plaintext, created_at=key.created_at),
            )
    except tenant_service.TenantExists as exc:
        raise Conflict(
            f"name: a tenant named {name!r} exists or existed; names are never reused",
            type_="tenant-exists",
            title="Tenant exists",
            errors=[{"field": "name", "message": "taken"}],
        ) from exc


def _discard(db: Database, tenant_id: str) -> None:
    with db.session() as session:
        tenant_service.discard(session, tenant_id)


async def onboard(
    db: Database, temporal: Client, settings: Settings, name: str, quotas: Sequence[QuotaRequest], *, actor: str
) -> TenantAccepted:
    """Record the tenant (`onboarding`), exactly the quotas asked for, its first API key (the
    secret shown in this answer only) and the operation; then start its onboarding workflow. If
    the engine refuses it, nothing is kept."""
    granted = sorted(
        (TenantQuotaBase(gpu_type=q.gpu_type, region=q.region, max_gpus=q.max_gpus) for q in quotas),
        key=lambda q: (q.gpu_type, q.region),
    )
    created = await to_thread.run_sync(_record, db, name, granted, actor)
    try:
        await start_tenant_onboarding(temporal, settings, created.id, created.operation.id)
    except RPCError as exc:
        await to_thread.run_sync(_discard, db, created.id)
        raise engine_error(exc, what="the onboarding", left="nothing was kept") from exc
    return created


def _begin_offboarding(db: Database, tenant_id: str, actor: str) -> tuple[Tenant, Operation, bool]:
    try:
        with db.session() as session:
            return tenant_service.begin_offboarding(session, tenant_id, actor=actor)
    except tenant_service.TenantNotFound as exc:
        raise NotFound("tenant", tenant_id) from exc
    except tenant_service.TenantStateConflict as exc:
        raise Conflict(
            f"tenant {tenant_id} is {exc.status}; offboard it once its onboarding has ended",
            type_="tenant-busy",
            title="Tenant cannot be offboarded now",
            tenant_status=exc.status,
        ) from exc


async def offboard(
    db: Database, temporal: Client, settings: Settings, tenant_id: str, *, actor: str
) -> tuple[Tenant, Operation]:
    """Record the offboarding (repeating it returns the same operation) and start its workflow."""
    tenant, op, _ = await to_thread.run_sync(_begin_offboarding, db, tenant_id, actor)
    # Started on every call (the id makes it once): a start lost to an outage is made up here,
    # or by the worker's start-up recovery.
    try:
        await start_tenant_offboarding(temporal, settings, tenant_id, op.id)
    except RPCError as exc:
        raise engine_error(
            exc, what="the offboarding", left="the offboarding is recorded and the next DELETE starts it"
        ) from exc
    return tenant, op


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


def replace_quotas(db: Database, tenant_id: str, quotas: Sequence[QuotaRequest], *, actor: str) -> QuotaReport:
    """Replace the tenant's quotas, recorded as a settled operation in the same transaction."""
    with db.session() as session:
        # The row lock that allocation admission takes: a change lands between two admissions.
        if session.exec(select(col(Tenant.id)).where(col(Tenant.id) == tenant_id).with_for_update()).first() is None:
            raise NotFound("tenant", tenant_id)
        quota_service.replace_quotas(session, tenant_id, [TenantQuotaBase(**q.model_dump()) for q in quotas])
        operations.record_done(session, kind=QUOTAS_OPERATION, resource_id=tenant_id, tenant_id=tenant_id, actor=actor)
        return quota_report(session, tenant_id)
