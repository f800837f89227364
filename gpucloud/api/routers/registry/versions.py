"""Versions: push a signed manifest, list and read versions and manifests, record evaluations,
move aliases (gated), walk lineage.

A push of what a version already holds answers that version with a 200 and registers nothing:
the same manifest (its digest), or the same files and lineage built at another time and signed
by the same key (its `content_digest`, unique per tenant and key, so two such pushes at once end
as one version). Another key makes another version: weights re-signed after their key was
revoked must not answer with the revoked signature."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from sqlmodel import Session, col, select

from gpucloud.adapters.temporal_gateway import start_version_evaluation
from gpucloud.api import pagination
from gpucloud.api.deps import (
    ReadsDep,
    SettingsDep,
    TemporalDep,
    TenantDep,
    VersionReaderDep,
    out_of_scope,
    scoped_versions,
)
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.api.routers.registry.common import (
    StoresDep,
    VersionRef,
    model_row,
    resolve_version,
    signature_problem,
)
from gpucloud.config import Settings
from gpucloud.db import read_scope, session_scope
from gpucloud.models.evaluation_messages import EvaluateVersionInput
from gpucloud.models.registry_names import GATED_ALIASES, AliasName, EvaluatorName
from gpucloud.models.registry_tables import (
    AliasMove,
    EvaluationPage,
    EvaluationRequest,
    EvaluationResult,
    EvaluationResultPublic,
    EvaluationSource,
    EvaluationStarted,
    LineageEntry,
    LineagePage,
    ModelAlias,
    ModelAliasPublic,
    ModelVersion,
    ModelVersionPublic,
    RegistryModel,
    VersionPage,
)
from gpucloud.models.tables import Operation, OperationPublic, utcnow
from gpucloud.models.workflow_ids import evaluation_workflow_id
from gpucloud.registry import gc, promotion
from gpucloud.registry.manifest import (
    BadSignatureError,
    ManifestTamperedError,
    SignedEvaluation,
    SignedManifest,
    UnknownKeyError,
    VersionNotFoundError,
)
from gpucloud.registry.stores import RegistryStores
from gpucloud.services.evaluations import evaluation_input, evaluations_of, keep_evaluation, operation_kind
from gpucloud.services.operations import start_for_operation
from gpucloud.web.problems import Problem, invalid

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["registry"])


def _register_version(
    settings: Settings, stores: RegistryStores, tenant_id: str, name: str, signed: SignedManifest
) -> tuple[ModelVersionPublic, bool]:
    manifest, digest = signed.manifest, signed.digest
    with session_scope(settings.database_url) as session:
        model = model_row(session, tenant_id, name)
        if manifest.model != name:
            raise invalid("manifest.model", f"the manifest is for model {manifest.model!r}, posted to {name!r}")
        limits = settings.registry
        if problem := manifest.size_problem(
            max_bytes=limits.max_version_bytes,
            max_amplification=limits.max_version_amplification,
            amplification_floor=limits.version_amplification_floor,
        ):
            raise invalid("manifest.total_size", problem, "version-too-large")
        if (existing := promotion.version_row(session, tenant_id, digest)) is not None:
            return promotion.publish_versions(session, tenant_id, [existing])[0], False
        try:
            promotion.keyring_for(session, tenant_id).verify(signed, tenant=tenant_id)
        except (UnknownKeyError, BadSignatureError) as exc:
            raise signature_problem(exc) from None
        if (
            same := promotion.version_with_content(session, tenant_id, manifest.content_digest, signed.key_id)
        ) is not None:
            return promotion.publish_versions(session, tenant_id, [same])[0], False
        parent = manifest.lineage.parent
        if parent is not None and promotion.version_row(session, tenant_id, parent) is None:
            raise invalid("manifest.lineage.parent", f"no version {parent} visible to this caller")
        model_id = model.id
    # Outside the transaction: checking thousands of chunks must not hold the database. The hold
    # keeps a concurrent garbage collection from deleting a chunk between the check and the put.
    ordered = [chunk.id for entry in manifest.files.values() for chunk in entry.chunks]
    with gc.holding(stores.manifests(tenant_id), ordered, model=name):
        missing = promotion.missing_chunks(stores.chunks(tenant_id), ordered)
        if missing:
            raise Problem(
                409,
                "chunks-missing",
                "Chunks missing",
                f"{len(missing)} of the version's {len(set(ordered))} chunks are not in the store; "
                "upload them and post the manifest again",
                missing=missing[:1000],
                missing_count=len(missing),
            )
        stores.manifests(tenant_id).put(signed)
    row = ModelVersion(
        digest=digest,
        tenant_id=tenant_id,
        model_id=model_id,
        **manifest.lineage.model_dump(),  # parent, base model, training run, datasets
        total_size=manifest.total_size,
        chunk_count=manifest.chunk_count,
        file_count=len(manifest.files),
        key_id=signed.key_id,
        created_at=manifest.created_at,
        manifest_uri=stores.manifest_uri(tenant_id, digest),
        content_digest=manifest.content_digest,
    )
    try:
        with session_scope(settings.database_url) as session:
            session.add(row)
            session.flush()
            return promotion.publish_versions(session, tenant_id, [row])[0], True
    except sa.exc.IntegrityError:  # the same version, or the same content, posted concurrently
        with session_scope(settings.database_url) as session:
            existing = promotion.version_row(session, tenant_id, digest) or promotion.version_with_content(
                session, tenant_id, manifest.content_digest, signed.key_id
            )
            assert existing is not None  # the insert that won the race committed it
            if existing.digest != digest:
                # Our manifest is stored under a digest no version has: the winner's stands for it.
                stores.manifests(tenant_id).delete(digest)
            return promotion.publish_versions(session, tenant_id, [existing])[0], False


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
    settings: SettingsDep,
    stores: StoresDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        version, created = await run_in_threadpool(_register_version, settings, stores, tenant.tenant_id, name, signed)
        return JSONResponse(
            version.model_dump(mode="json"),
            status_code=201 if created else 200,
            headers={"Location": f"/v1/models/{name}/versions/{version.digest}"},
        )

    return await idempotent(request, settings.database_url, tenant.id, idempotency_key, handler)


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
def get_manifest(name: str, ref: VersionRef, reader: VersionReaderDep, settings: SettingsDep, stores: StoresDep):
    """The signed manifest exactly as pushed; clients verify it against the published keys. An
    evaluation's token reads only the versions it names."""
    assert reader.tenant_id is not None  # a tenant, or an evaluation for one (`get_version_reader`)
    tenant_id = reader.tenant_id
    versions = scoped_versions(reader, name)
    with read_scope(settings.database_url) as session:
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


def _record_evaluation(
    settings: Settings, stores: RegistryStores, tenant_id: str, name: str, ref: str, signed: SignedEvaluation
) -> tuple[EvaluationResult, bool]:
    record = signed.record
    with session_scope(settings.database_url) as session:
        digest = resolve_version(session, model_row(session, tenant_id, name), ref).digest
        if record.version != digest:
            raise invalid("record.version", f"the record is about version {record.version}, posted for {digest}")
        try:
            promotion.keyring_for(session, tenant_id).verify_evaluation(signed, tenant=tenant_id)
        except (UnknownKeyError, BadSignatureError) as exc:
            raise signature_problem(exc) from None
    return keep_evaluation(settings.database_url, stores, tenant_id, signed, source=EvaluationSource.REPORTED)


@router.post("/models/{name}/versions/{ref}/evaluations", status_code=201, response_model=EvaluationResultPublic)
async def record_evaluation(
    name: str,
    ref: VersionRef,
    signed: SignedEvaluation,
    request: Request,
    tenant: TenantDep,
    settings: SettingsDep,
    stores: StoresDep,
    idempotency_key: IdempotencyKey = None,
):
    """Report evaluation results for a version, signed by one of the tenant's keys. They are kept
    and shown as `reported`; gates hold only evaluations the platform runs (`.../evaluate`)."""

    async def handler() -> JSONResponse:
        row, created = await run_in_threadpool(
            _record_evaluation, settings, stores, tenant.tenant_id, name, ref, signed
        )
        body = EvaluationResultPublic.model_validate(row, from_attributes=True).model_dump(mode="json")
        return JSONResponse(body, status_code=201 if created else 200)

    return await idempotent(request, settings.database_url, tenant.id, idempotency_key, handler)


@router.get("/models/{name}/versions/{ref}/evaluations", response_model=EvaluationPage)
def list_evaluations(name: str, ref: VersionRef, tenant: TenantDep, reads: ReadsDep):
    """Every evaluation record of the version, oldest first: the platform's and the reported."""
    with reads() as session:
        digest = resolve_version(session, model_row(session, tenant.tenant_id, name), ref).digest
        rows = evaluations_of(session, tenant.tenant_id, digest)
        return EvaluationPage(items=[EvaluationResultPublic.model_validate(r, from_attributes=True) for r in rows])


def _evaluation_operation(
    settings: Settings, tenant_id: str, name: str, ref: str, evaluator: EvaluatorName, actor: str
) -> tuple[EvaluateVersionInput, Operation]:
    with session_scope(settings.database_url) as session:
        model = model_row(session, tenant_id, name)
        version = resolve_version(session, model, ref)
        if evaluator == EvaluatorName.COMMAND and promotion.evaluation_of(model) is None:
            raise Problem(
                409,
                "no-evaluation-command",
                "No evaluation command",
                f"model {name!r} has no evaluation command; register one with PUT /v1/models/{name}/evaluation",
            )
        op = Operation(kind=operation_kind(evaluator), resource_id=version.digest, tenant_id=tenant_id, actor=actor)
        op.workflow_id = evaluation_workflow_id(tenant_id, op.id)
        session.add(op)
        session.flush()
        session.refresh(op)
        return evaluation_input(session, model, version, evaluator, op.id), op


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
    settings: SettingsDep,
    temporal: TemporalDep,
    idempotency_key: IdempotencyKey = None,
):
    """Have the platform evaluate the version: the worker pulls and verifies it, runs the evaluator
    (`sanity`, against its parent; or `command`, the model's own), and signs the results with the
    platform's evaluator key. Follow the operation; the results are in `.../evaluations`."""

    async def handler() -> JSONResponse:
        command, op = await run_in_threadpool(
            _evaluation_operation, settings, tenant.tenant_id, name, ref, req.evaluator, tenant.actor
        )
        start = start_version_evaluation(temporal, settings, command)
        await start_for_operation(start, settings.database_url, op.id, "the evaluation")
        body = EvaluationStarted(
            version=command.version,
            evaluator=req.evaluator,
            parent=command.parent,
            operation=OperationPublic.model_validate(op, from_attributes=True),
        )
        return JSONResponse(body.model_dump(mode="json"), status_code=202)

    return await idempotent(request, settings.database_url, tenant.id, idempotency_key, handler)


def _check_gates(
    session: Session,
    tenant_id: str,
    model: RegistryModel,
    alias: AliasName,
    version: ModelVersion,
    *,
    require_sanity: bool,
) -> None:
    if version.key_id not in promotion.active_key_ids(session, tenant_id):
        raise Problem(
            409,
            "signing-key-revoked",
            "Signing key revoked",
            f"version {version.digest} was signed by key {version.key_id}, which is no longer trusted",
        )
    failures = promotion.promotion_failures(
        session, tenant_id, model.id, version.digest, alias=alias, require_sanity=require_sanity
    )
    if failures:
        evaluators = " or ".join(sorted({f.evaluator for f in failures}))
        raise Problem(
            409,
            "gates-failed",
            "Evaluation gates failed",
            f"{model.name}@{alias.value} cannot move to {version.digest[:12]}: "
            + "; ".join(f.describe() for f in failures)
            + f". Have the platform evaluate it ({evaluators}: POST /v1/models/{model.name}/versions/"
            f"{version.digest}/evaluate, or `gpucloud weights evaluate {model.name} {version.digest[:12]} "
            "--evaluator ...`), or push a version that fixes what fails",
            failing_metrics=[f.model_dump() for f in failures],
        )


@router.put(
    "/models/{name}/aliases/{alias}",
    response_model=ModelAliasPublic,
    responses={409: {"description": "evaluation gates failed (`failing_metrics` names them)"}},
)
def move_alias(name: str, alias: AliasName, req: AliasMove, tenant: TenantDep, settings: SettingsDep):
    """Point an alias at a version; `staging` and `production` move only when the model's gates
    and the platform's pass (no failed evaluation, no NaN weight, and for `production` a passing
    platform sanity evaluation)."""
    with session_scope(settings.database_url) as session:
        # The model row lock serialises moves of one model's aliases (a no-op on SQLite, which
        # already holds the write lock), so two promotions cannot both pass against a stale production.
        model = model_row(session, tenant.tenant_id, name, for_update=True)
        version = resolve_version(session, model, req.version)
        if alias in GATED_ALIASES:
            require_sanity = settings.registry.production_requires_sanity
            _check_gates(session, tenant.tenant_id, model, alias, version, require_sanity=require_sanity)
        row = session.exec(
            select(ModelAlias).where(col(ModelAlias.model_id) == model.id, col(ModelAlias.name) == alias)
        ).first()
        row = row or ModelAlias(model_id=model.id, name=alias, version=version.digest, moved_by=tenant.id)
        row.version, row.moved_at, row.moved_by = version.digest, utcnow(), tenant.id
        session.add(row)
        return ModelAliasPublic(name=alias, version=row.version, moved_at=row.moved_at, moved_by=row.moved_by)


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
