"""Registry garbage collection (operators): delete the chunks no version needs, and only those. A
run that deletes leaves a settled `registry_gc` operation per tenant naming the operator."""

from __future__ import annotations

import logging
from dataclasses import asdict
from datetime import timedelta

from fastapi import APIRouter
from pydantic import BaseModel, Field
from sqlmodel import col, select

from gpucloud.api.deps import DbDep, FleetOperatorDep, ReadsDep
from gpucloud.api.routers.registry.common import (
    StoresDep,
)
from gpucloud.models.registry_tables import (
    RegistryModel,
)
from gpucloud.registry import gc
from gpucloud.services import operations, storage_quota
from gpucloud.web.problems import not_found

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["registry"])


# ---------------------------------------------------------------- garbage collection (operators)


MIN_GC_GRACE_SECONDS = 3600
"""A push over the API holds no lease while it uploads: only the grace period keeps its fresh
chunks, so the API refuses one shorter than this (a push slower than the grace period loses
chunks and re-sends them when the manifest is refused with `chunks-missing`)."""
MAX_LISTED_IDS = 1000


class GcRequest(BaseModel):
    tenant_id: str | None = Field(None, max_length=128, description="one tenant; default: every tenant with a model")
    grace_period_seconds: int = Field(
        int(gc.GRACE_PERIOD.total_seconds()),
        ge=MIN_GC_GRACE_SECONDS,
        le=10 * 366 * 86_400,
        description="unreferenced chunks younger than this are kept (at most ten years)",
    )
    dry_run: bool = Field(False, description="report what would be removed, remove nothing")


class TenantGc(BaseModel):
    tenant_id: str
    chunks_scanned: int
    chunks_referenced: int
    chunks_young: int
    chunks_deleted: int
    bytes_deleted: int
    leases_expired: int
    uploads_aborted: int
    deleted_ids: list[str] = Field(description=f"the first {MAX_LISTED_IDS} removed (or removable) chunk ids")


class GcReport(BaseModel):
    dry_run: bool
    grace_period_seconds: int
    chunks_deleted: int
    bytes_deleted: int
    tenants: list[TenantGc]


@router.post(
    "/registry/gc", response_model=GcReport, responses={404: {"description": "no tenant with the `tenant_id` given"}}
)
def collect_garbage(req: GcRequest, operator: FleetOperatorDep, reads: ReadsDep, stores: StoresDep, db: DbDep):
    """Remove (or with `dry_run`, list) chunks no version references, older than the grace period;
    chunks of pushes in progress are kept (`gpucloud.registry.gc`)."""
    with reads() as session:  # closed before the run, which may take a while
        tenant_ids = list(
            session.exec(select(col(RegistryModel.tenant_id)).distinct().order_by(col(RegistryModel.tenant_id)))
        )
    if req.tenant_id is not None:
        if req.tenant_id not in tenant_ids:
            raise not_found("registry tenant", req.tenant_id)
        tenant_ids = [req.tenant_id]
    grace = timedelta(seconds=req.grace_period_seconds)
    reports = []
    for tenant_id in tenant_ids:
        result = gc.collect_garbage(
            stores.chunks(tenant_id), stores.manifests(tenant_id), grace_period=grace, dry_run=req.dry_run
        )
        if not req.dry_run:  # the tenant's storage as measured now, for its quota; who collected it
            storage_quota.measured(db, tenant_id, result.bytes_scanned - result.bytes_deleted)
            operations.record_done_in(
                db,
                kind="registry_gc",
                resource_id=tenant_id,
                actor=operator.actor,
                tenant_id=tenant_id,
            )
        log.info(
            "registry gc of tenant %s (dry run: %s): %d chunks, %d bytes",
            tenant_id,
            req.dry_run,
            result.chunks_deleted,
            result.bytes_deleted,
        )
        reports.append(
            TenantGc(
                tenant_id=tenant_id,
                **{k: v for k, v in asdict(result).items() if k in TenantGc.model_fields and k != "deleted_ids"},
                deleted_ids=result.deleted_ids[:MAX_LISTED_IDS],
            )
        )
    return GcReport(
        dry_run=req.dry_run,
        grace_period_seconds=req.grace_period_seconds,
        tenants=reports,
        chunks_deleted=sum(r.chunks_deleted for r in reports),
        bytes_deleted=sum(r.bytes_deleted for r in reports),
    )
