"""Versions: push a signed manifest, list and read versions and manifests, record evaluations,
move aliases (gated), walk lineage.

A push of what a version already holds answers that version with a 200 and registers nothing:
the same manifest (its digest), or the same files and lineage built at another time and signed
by the same key (its `content_digest`, unique per tenant and key, so two such pushes at once end
as one version). Another key makes another version: weights re-signed after their key was
revoked must not answer with the revoked signature."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from gpucloud.adapters.temporal_gateway import start_version_evaluation
from gpucloud.api import pagination
from gpucloud.api.deps import (
    DbDep,
    ReadsDep,
    SettingsDep,
    TemporalDep,
    TenantDep,
    VersionReaderDep,
    out_of_scope,
    scoped_versions,
)
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.api.routers.registry.common import StoresDep, VersionRef
from gpucloud.models.registry_names import AliasName
from gpucloud.models.registry_tables import (
    AliasMove,
    EvaluationPage,
    EvaluationRequest,
    EvaluationResultPublic,
    EvaluationStarted,
    LineageEntry,
    LineagePage,
    ModelAliasPublic,
    ModelVersion,
    ModelVersionPublic,
    VersionPage,
)
from gpucloud.models.tables import OperationPublic
from gpucloud.registry import promotion
from gpucloud.registry.manifest import (
    ManifestTamperedError,
    SignedEvaluation,
    SignedManifest,
    VersionNotFoundError,
)
from gpucloud.services import registry_versions as service
from gpucloud.services.evaluations import evaluations_of
from gpucloud.services.operations import start_for_operation
from gpucloud.services.registry_models import model_row
from gpucloud.services.registry_versions import resolve_version
from gpucloud.web.problems import Problem

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["registry"])


@router.post(
    "/models/{name}/versions",
    status_code=201,
    response_model=ModelVersionPublic,
    responses={
        200: {
            "description": "the version was already registered: this manifest, or the same files and lineage "
            "under another creation time, signed by the same key (the answer is the version registered "
            "first, with its digest)",
            "model": ModelVersionPublic,
        },
        409: {"description": "chunks missing from the store (listed)"},
        422: {"description": "invalid manifest (a version too large among them), unknown key or bad signature"},
    },
)
async def push_version(
    name: str,
    signed: SignedManifest,
    request: Request,
    tenant: TenantDep,
    db: DbDep,
    settings: SettingsDep,
    stores: StoresDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        version, created = await run_in_threadpool(
            service.register_version, db, settings, stores, tenant.tenant_id, name, signed
        )
        return JSONResponse(
            version.model_dump(mode="json"),
            status_code=201 if created else 200,
            headers={"Location": f"/v1/models/{name}/versions/{version.digest}"},
        )

    return await idempotent(request, db, tenant.id, idempotency_key, handler)


@router.get("/models/{name}/versions", response_model=VersionPage)
def list_versions(name: str, tenant: TenantDep, reads: ReadsDep, page: pagination.PageDep):
    with reads() as session:
        model = model_row(session, tenant.tenant_id, name)
        rows, token = pagination.fetch(session, ModelVersion, "seq", page=page, equal={"model_id": model.id})
        return VersionPage(items=promotion.publish_versions(session, tenant.tenant_id, rows), next_page_token=token)


@router.get("/models/{name}/versions/{ref}", response_model=ModelVersionPublic)
def get_version(name: str, ref: VersionRef, tenant: TenantDep, reads: ReadsDep):
    with reads() as session:
        row = resolve_version(session, model_row(session, tenant.tenant_id, name), ref)
        return promotion.publish_versions(session, tenant.tenant_id, [row])[0]


@router.get("/models/{name}/versions/{ref}/manifest", response_model=SignedManifest)
def get_manifest(name: str, ref: VersionRef, reader: VersionReaderDep, reads: ReadsDep, stores: StoresDep):
    """The signed manifest exactly as pushed; clients verify it against the published keys. An
    evaluation's token reads only the versions it names."""
    assert reader.tenant_id is not None  # a tenant, or an evaluation for one (`get_version_reader`)
    tenant_id = reader.tenant_id
    versions = scoped_versions(reader, name)
    with reads() as session:
        digest = resolve_version(session, model_row(session, tenant_id, name), ref).digest
    if versions is not None and digest not in versions:
        raise out_of_scope(f"version {digest}")
    try:
        signed = stores.manifests(tenant_id).get(digest)
    except (ManifestTamperedError, VersionNotFoundError) as exc:
        log.error("stored manifest of version %s (tenant %s) failed its check: %s", digest, tenant_id, exc)
        raise Problem(500, "manifest-tampered", "Stored manifest failed verification", str(exc)) from None
    return Response(signed.model_dump_json(), media_type="application/json")


# ---------------------------------------------------------------- evaluations and aliases


@router.post("/models/{name}/versions/{ref}/evaluations", status_code=201, response_model=EvaluationResultPublic)
async def record_evaluation(
    name: str,
    ref: VersionRef,
    signed: SignedEvaluation,
    request: Request,
    tenant: TenantDep,
    db: DbDep,
    stores: StoresDep,
    idempotency_key: IdempotencyKey = None,
):
    """Report evaluation results for a version, signed by one of the tenant's keys. They are kept
    and shown as `reported`; gates hold only evaluations the platform runs (`.../evaluate`)."""

    async def handler() -> JSONResponse:
        row, created = await run_in_threadpool(
            service.record_evaluation, db, stores, tenant.tenant_id, name, ref, signed
        )
        body = EvaluationResultPublic.model_validate(row, from_attributes=True).model_dump(mode="json")
        return JSONResponse(body, status_code=201 if created else 200)

    return await idempotent(request, db, tenant.id, idempotency_key, handler)


@router.get("/models/{name}/versions/{ref}/evaluations", response_model=EvaluationPage)
def list_evaluations(name: str, ref: VersionRef, tenant: TenantDep, reads: ReadsDep):
    """Every evaluation record of the version, oldest first: the platform's and the reported."""
    with reads() as session:
        digest = resolve_version(session, model_row(session, tenant.tenant_id, name), ref).digest
        rows = evaluations_of(session, tenant.tenant_id, digest)
        return EvaluationPage(items=[EvaluationResultPublic.model_validate(r, from_attributes=True) for r in rows])


@router.post(
    "/models/{name}/versions/{ref}/evaluate",
    status_code=202,
    response_model=EvaluationStarted,
    responses={409: {"description": "the `command` evaluator on a model without an evaluation command"}},
)
async def evaluate_version(
    name: str,
    ref: VersionRef,
    req: EvaluationRequest,
    request: Request,
    tenant: TenantDep,
    db: DbDep,
    settings: SettingsDep,
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    """Have the platform evaluate the version: the worker pulls and verifies it, runs the evaluator
    (`sanity`, against its parent; or `command`, the model's own), and signs the results with the
    platform's evaluator key. Follow the operation; the results are in `.../evaluations`."""

    async def handler() -> JSONResponse:
        command, op = await run_in_threadpool(
            service.evaluation_operation, db, tenant.tenant_id, name, ref, req.evaluator, tenant.actor
        )
        start = start_version_evaluation(temporal, settings, command)
        await start_for_operation(start, db, op.id, "the evaluation")
        body = EvaluationStarted(
            version=command.version,
            evaluator=req.evaluator,
            parent=command.parent,
            operation=OperationPublic.model_validate(op, from_attributes=True),
        )
        return JSONResponse(body.model_dump(mode="json"), status_code=202)

    return await idempotent(request, db, tenant.id, idempotency_key, handler)


@router.put(
    "/models/{name}/aliases/{alias}",
    response_model=ModelAliasPublic,
    responses={409: {"description": "evaluation gates failed (`failing_metrics` names them)"}},
)
def move_alias(name: str, alias: AliasName, req: AliasMove, tenant: TenantDep, db: DbDep, settings: SettingsDep):
    """Point an alias at a version; `staging` and `production` move only when the model's gates
    and the platform's pass (no failed evaluation, no NaN weight, and for `production` a passing
    platform sanity evaluation). The alias records who moved it: the tenant and the key it used."""
    require_sanity = settings.registry.production_requires_sanity
    return service.move_alias(
        db, tenant.tenant_id, name, alias, req.version, moved_by=tenant.actor, require_sanity=require_sanity
    )


# ---------------------------------------------------------------- lineage


@router.get("/models/{name}/versions/{ref}/ancestors", response_model=LineagePage)
def get_ancestors(name: str, ref: VersionRef, tenant: TenantDep, reads: ReadsDep):
    """Parent, grandparent, ... (nearest first), across the tenant's models."""
    with reads() as session:
        row = resolve_version(session, model_row(session, tenant.tenant_id, name), ref)
        found = promotion.ancestors(session, tenant.tenant_id, row.digest)
        published = promotion.publish_versions(session, tenant.tenant_id, found)
        return LineagePage(items=[LineageEntry(**v.model_dump(), depth=i) for i, v in enumerate(published, start=1)])


@router.get("/models/{name}/versions/{ref}/descendants", response_model=LineagePage)
def get_descendants(name: str, ref: VersionRef, tenant: TenantDep, reads: ReadsDep):
    """Every version derived from this one, breadth first, across the tenant's models."""
    with reads() as session:
        row = resolve_version(session, model_row(session, tenant.tenant_id, name), ref)
        found = promotion.descendants(session, tenant.tenant_id, row.digest)
        published = promotion.publish_versions(session, tenant.tenant_id, [r for r, _ in found])
        return LineagePage(
            items=[LineageEntry(**v.model_dump(), depth=d) for v, (_, d) in zip(published, found, strict=True)]
        )
