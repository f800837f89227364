"""The weight registry API, tenant-scoped: models, signing keys, chunks, versions, evaluations,
aliases and lineage.

A push is: `POST .../chunks:missing` (which of these chunk ids does the store lack?), one
`PUT .../chunks/{id}` per missing chunk (hashed with BLAKE3 on the way in; bytes that do not hash
to the id are refused and leave nothing behind), then `POST .../versions` with the signed manifest.
The manifest is verified against the tenant's registered keys and every chunk it lists must be in
the store before the version row is written, so a listed version is always complete; an
interrupted push resumes by asking again which chunks are missing.

Every query is scoped to the caller's tenant, and a name or id of another tenant gets the same 404
as one that does not exist. Each tenant's chunks live under its own store prefix
(`gpucloud.registry.stores`), so chunk ids are never looked up across tenants either.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from datetime import timedelta
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from nacl.signing import VerifyKey
from pydantic import BaseModel, Field
from sqlmodel import Session, select

from gpucloud.api import pagination
from gpucloud.api.deps import OperatorDep, SessionDep, SettingsDep, TenantDep
from gpucloud.api.idempotency import run_idempotent
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.registry_tables import (
    DIGEST_PATTERN,
    GATED_ALIASES,
    AliasMove,
    AliasName,
    ChunkQuery,
    ChunkStored,
    EvaluationResult,
    EvaluationResultPublic,
    GatesUpdate,
    LineageEntry,
    LineagePage,
    MissingChunks,
    ModelAlias,
    ModelAliasPublic,
    ModelPage,
    ModelPublic,
    ModelVersion,
    ModelVersionPublic,
    RegistryModel,
    RegistryModelCreate,
    SigningKey,
    SigningKeyCreate,
    SigningKeyList,
    SigningKeyPublic,
    VersionPage,
)
from gpucloud.models.tables import utcnow
from gpucloud.registry import gc, promotion
from gpucloud.registry.manifest import (
    BadSignatureError,
    ChunkCorruptedError,
    ChunkMissingError,
    IntegrityError,
    ManifestTamperedError,
    SignedEvaluation,
    SignedManifest,
    UnknownKeyError,
    VersionNotFoundError,
    is_digest,
    key_id_of,
)
from gpucloud.registry.stores import RegistryStores
from gpucloud.web.problems import Problem, not_found

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["registry"])

SPOOL_IN_MEMORY = 8 << 20  # an upload larger than this spills to a temp file, so memory stays bounded
WRITE_BATCH = 1 << 20

ChunkId = Annotated[str, PathParam(pattern=DIGEST_PATTERN, description="BLAKE3 hex of the chunk's bytes")]
VersionRef = Annotated[str, PathParam(description="a digest, a unique digest prefix (8+ hex digits) or an alias")]


def get_stores(request: Request) -> RegistryStores:
    return request.app.state.registry_stores


StoresDep = Annotated[RegistryStores, Depends(get_stores)]


# ---------------------------------------------------------------- helpers


def _invalid(field: str, message: str, type_: str = "invalid-request") -> Problem:
    return Problem(
        422, type_, "The request is invalid", f"{field}: {message}", errors=[{"field": field, "message": message}]
    )


def _model(session: Session, tenant_id: str, name: str, *, for_update: bool = False) -> RegistryModel:
    query = select(RegistryModel).where(RegistryModel.tenant_id == tenant_id, RegistryModel.name == name)
    model = session.exec(query.with_for_update() if for_update else query).first()
    if model is None:
        raise not_found("model", name)
    return model


def _resolve(session: Session, model: RegistryModel, ref: str, *, field: str = "version") -> ModelVersion:
    query = select(ModelVersion).where(ModelVersion.model_id == model.id)
    if ref in {a.value for a in AliasName}:
        alias = session.exec(select(ModelAlias).where(ModelAlias.model_id == model.id, ModelAlias.name == ref)).first()
        if alias is None:
            raise not_found("alias", f"{model.name}@{ref}")
        query = query.where(ModelVersion.digest == alias.version)
    elif is_digest(ref):
        query = query.where(ModelVersion.digest == ref)
    elif re.fullmatch(r"[0-9a-f]{8,63}", ref):
        query = query.where(ModelVersion.digest.startswith(ref))
    else:
        raise _invalid(
            field,
            f"{ref!r} is not a digest, a digest prefix of at least 8 hex digits, or an alias "
            f"({', '.join(a.value for a in AliasName)})",
        )
    rows = session.exec(query.limit(2)).all()
    if len(rows) > 1:
        raise _invalid(field, f"prefix {ref!r} matches several versions; give more digits")
    if not rows:
        raise not_found("version", f"{model.name}@{ref}")
    return rows[0]


def _signature_problem(exc: IntegrityError) -> Problem:
    if isinstance(exc, UnknownKeyError):
        return _invalid(
            "key_id", f"{exc}; register the public key with POST /v1/signing-keys first", "unknown-signing-key"
        )
    return _invalid(
        "signature", f"{exc}: the signed content was changed after signing, or another key signed it", "bad-signature"
    )


async def _idempotent(request: Request, settings: Settings, caller: str, key: str | None, handler) -> Response:
    return await run_idempotent(
        db_url=settings.database_url,
        caller=caller,
        key=key,
        method=request.method,
        path=request.url.path,
        body=await request.body(),
        handler=handler,
    )


IdempotencyKey = Annotated[str | None, Header()]


# ---------------------------------------------------------------- models and gates


def _create_model(settings: Settings, tenant_id: str, req: RegistryModelCreate) -> ModelPublic:
    try:
        with session_scope(settings.database_url) as session:
            model = RegistryModel(tenant_id=tenant_id, name=req.name, description=req.description)
            session.add(model)
            session.flush()
            promotion.replace_gates(session, model, req.gates)
            session.flush()
            return promotion.publish_models(session, [model])[0]
    except sa.exc.IntegrityError as exc:
        raise Problem(409, "model-exists", "Model exists", f"a model named {req.name!r} already exists") from exc


@router.post("/models", status_code=201, response_model=ModelPublic)
async def create_model(
    request: Request,
    req: RegistryModelCreate,
    tenant: TenantDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        model = await run_in_threadpool(_create_model, settings, tenant.tenant_id, req)
        return JSONResponse(
            model.model_dump(mode="json"), status_code=201, headers={"Location": f"/v1/models/{model.name}"}
        )

    return await _idempotent(request, settings, tenant.id, idempotency_key, handler)


@router.get("/models", response_model=ModelPage)
def list_models(
    tenant: TenantDep,
    session: SessionDep,
    page_size: Annotated[int, Query(ge=1, le=pagination.MAX_PAGE_SIZE)] = pagination.DEFAULT_PAGE_SIZE,
    page_token: str | None = None,
):
    filters = {"tenant": tenant.tenant_id}
    cursor = pagination.decode(page_token, filters)
    query = (
        select(RegistryModel)
        .where(RegistryModel.tenant_id == tenant.tenant_id)
        .order_by(RegistryModel.seq)
        .limit(page_size + 1)
    )
    if cursor.after is not None:
        query = query.where(RegistryModel.seq > cursor.after)
    rows, token = pagination.page(list(session.exec(query).all()), page_size, lambda m: m.seq, filters)
    return ModelPage(items=promotion.publish_models(session, rows), next_page_token=token)


@router.get("/models/{name}", response_model=ModelPublic)
def get_model(name: str, tenant: TenantDep, session: SessionDep):
    return promotion.publish_models(session, [_model(session, tenant.tenant_id, name)])[0]


@router.put("/models/{name}/gates", response_model=ModelPublic)
def set_gates(name: str, req: GatesUpdate, tenant: TenantDep, settings: SettingsDep):
    with session_scope(settings.database_url) as session:
        model = _model(session, tenant.tenant_id, name, for_update=True)
        promotion.replace_gates(session, model, req.gates)
        session.flush()
        return promotion.publish_models(session, [model])[0]


# ---------------------------------------------------------------- signing keys


def _register_key(settings: Settings, tenant_id: str, req: SigningKeyCreate) -> tuple[SigningKey, bool]:
    key_id = key_id_of(VerifyKey(bytes.fromhex(req.public_key)))
    query = select(SigningKey).where(SigningKey.tenant_id == tenant_id, SigningKey.key_id == key_id)
    try:
        with session_scope(settings.database_url) as session:
            existing = session.exec(query).first()
            if existing is None:
                key = SigningKey(tenant_id=tenant_id, key_id=key_id, public_key=req.public_key)
                session.add(key)
                return key, True
    except sa.exc.IntegrityError:  # registered concurrently: the other request's row is the answer
        with session_scope(settings.database_url) as session:
            existing = session.exec(query).one()
    if existing.revoked_at is not None:
        raise Problem(
            409,
            "signing-key-revoked",
            "Signing key revoked",
            f"key {key_id} was revoked and cannot be registered again; generate a new key",
        )
    return existing, False


@router.post("/signing-keys", status_code=201, response_model=SigningKeyPublic)
async def register_signing_key(
    request: Request,
    req: SigningKeyCreate,
    tenant: TenantDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        key, created = await run_in_threadpool(_register_key, settings, tenant.tenant_id, req)
        body = SigningKeyPublic.model_validate(key, from_attributes=True).model_dump(mode="json")
        return JSONResponse(body, status_code=201 if created else 200)

    return await _idempotent(request, settings, tenant.id, idempotency_key, handler)


@router.get("/signing-keys", response_model=SigningKeyList)
def list_signing_keys(tenant: TenantDep, session: SessionDep):
    """The public keys the registry trusts for this tenant: what a pull verifies manifests against."""
    keys = session.exec(
        select(SigningKey)
        .where(SigningKey.tenant_id == tenant.tenant_id, SigningKey.revoked_at.is_(None))
        .order_by(SigningKey.seq)
    )
    return SigningKeyList(
        tenant_id=tenant.tenant_id, items=[SigningKeyPublic.model_validate(k, from_attributes=True) for k in keys]
    )


@router.delete("/signing-keys/{key_id}", response_model=SigningKeyPublic)
def revoke_signing_key(key_id: str, tenant: TenantDep, settings: SettingsDep):
    """Revoke a key: versions it signed no longer verify on pull and cannot be promoted."""
    with session_scope(settings.database_url) as session:
        key = session.exec(
            select(SigningKey).where(SigningKey.tenant_id == tenant.tenant_id, SigningKey.key_id == key_id)
        ).first()
        if key is None:
            raise not_found("signing key", key_id)
        key.revoked_at = key.revoked_at or utcnow()
        session.add(key)
        return SigningKeyPublic.model_validate(key, from_attributes=True)


# ---------------------------------------------------------------- chunks


def _check_model(settings: Settings, tenant_id: str, name: str) -> None:
    with session_scope(settings.database_url) as session:
        _model(session, tenant_id, name)


@router.post("/models/{name}/chunks:missing", response_model=MissingChunks)
def missing_chunks(name: str, req: ChunkQuery, tenant: TenantDep, settings: SettingsDep, stores: StoresDep):
    """Which of these chunk ids the tenant's store lacks: upload only those (and resume with the rest)."""
    _check_model(settings, tenant.tenant_id, name)
    return MissingChunks(missing=promotion.missing_chunks(stores.chunks(tenant.tenant_id), req.chunk_ids))


@router.put(
    "/models/{name}/chunks/{chunk_id}",
    status_code=201,
    response_model=ChunkStored,
    responses={200: {"description": "the store already had the chunk"}},
)
async def upload_chunk(
    name: str, chunk_id: ChunkId, request: Request, tenant: TenantDep, settings: SettingsDep, stores: StoresDep
):
    await run_in_threadpool(_check_model, settings, tenant.tenant_id, name)
    limit = settings.registry.max_chunk_size
    too_large = Problem(413, "chunk-too-large", "Chunk too large", f"a chunk may have at most {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY) as spool:
        size, pending = 0, bytearray()
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise too_large
            pending += piece
            if len(pending) >= WRITE_BATCH:  # past the in-memory part these are disk writes: off the loop
                await run_in_threadpool(spool.write, bytes(pending))
                pending.clear()
        await run_in_threadpool(spool.write, bytes(pending))
        spool.seek(0)
        try:
            stored = await run_in_threadpool(stores.chunks(tenant.tenant_id).put, chunk_id, spool)
        except ChunkCorruptedError as exc:
            raise _invalid(
                "chunk_id",
                f"the {size} bytes sent hash to {exc.actual_id}, not to {chunk_id}; nothing was stored",
                "chunk-digest-mismatch",
            ) from None
    body = ChunkStored(id=chunk_id, size=size, stored=stored)
    return JSONResponse(body.model_dump(), status_code=201 if stored else 200)


def _served(tenant_id: str, chunk_id: str, pieces: Iterator[bytes]) -> Iterator[bytes]:
    # The store hashes while it reads and raises after the last piece if the bytes are not the
    # chunk. Re-raising aborts the chunked response, so no client ever sees it complete.
    try:
        yield from pieces
    except IntegrityError:
        log.error("chunk %s of tenant %s failed verification while being served", chunk_id, tenant_id)
        raise


@router.get(
    "/models/{name}/chunks/{chunk_id}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def download_chunk(name: str, chunk_id: ChunkId, tenant: TenantDep, settings: SettingsDep, stores: StoresDep):
    _check_model(settings, tenant.tenant_id, name)
    failed: IntegrityError | None = None
    try:
        pieces = stores.chunks(tenant.tenant_id).stream(chunk_id)
        first = next(pieces, b"")  # a missing chunk raises here, while a 404 can still be sent
    except ChunkMissingError:
        raise not_found("chunk", chunk_id) from None
    except IntegrityError as exc:  # e.g. a chunk truncated to nothing: fail it like any other
        failed, first, pieces = exc, b"", iter(())

    def body() -> Iterator[bytes]:
        if failed is not None:
            raise failed
        yield first
        yield from pieces

    return StreamingResponse(_served(tenant.tenant_id, chunk_id, body()), media_type="application/octet-stream")


# ---------------------------------------------------------------- versions


def _register_version(
    settings: Settings, stores: RegistryStores, tenant_id: str, name: str, signed: SignedManifest
) -> tuple[ModelVersionPublic, bool]:
    manifest, digest = signed.manifest, signed.digest
    with session_scope(settings.database_url) as session:
        model = _model(session, tenant_id, name)
        if manifest.model != name:
            raise _invalid("manifest.model", f"the manifest is for model {manifest.model!r}, posted to {name!r}")
        if (existing := promotion.version_row(session, tenant_id, digest)) is not None:
            return promotion.publish_versions(session, tenant_id, [existing])[0], False
        try:
            promotion.keyring_for(session, tenant_id).verify(signed, tenant=tenant_id)
        except (UnknownKeyError, BadSignatureError) as exc:
            raise _signature_problem(exc) from None
        parent = manifest.lineage.parent
        if parent is not None and promotion.version_row(session, tenant_id, parent) is None:
            raise _invalid("manifest.lineage.parent", f"no version {parent} visible to this caller")
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
        parent=parent,
        base_model=manifest.lineage.base_model,
        training_run=manifest.lineage.training_run,
        dataset_digests=list(manifest.lineage.dataset_digests),
        total_size=manifest.total_size,
        chunk_count=manifest.chunk_count,
        file_count=len(manifest.files),
        key_id=signed.key_id,
        created_at=manifest.created_at,
        manifest_uri=stores.manifest_uri(tenant_id, digest),
    )
    try:
        with session_scope(settings.database_url) as session:
            session.add(row)
            session.flush()
            return promotion.publish_versions(session, tenant_id, [row])[0], True
    except sa.exc.IntegrityError:  # the same version posted concurrently
        with session_scope(settings.database_url) as session:
            existing = promotion.version_row(session, tenant_id, digest)
            return promotion.publish_versions(session, tenant_id, [existing])[0], False


@router.post(
    "/models/{name}/versions",
    status_code=201,
    response_model=ModelVersionPublic,
    responses={
        200: {"description": "the version was already registered"},
        409: {"description": "chunks missing from the store (listed)"},
        422: {"description": "invalid manifest, unknown key or bad signature"},
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

    return await _idempotent(request, settings, tenant.id, idempotency_key, handler)


@router.get("/models/{name}/versions", response_model=VersionPage)
def list_versions(
    name: str,
    tenant: TenantDep,
    session: SessionDep,
    page_size: Annotated[int, Query(ge=1, le=pagination.MAX_PAGE_SIZE)] = pagination.DEFAULT_PAGE_SIZE,
    page_token: str | None = None,
):
    model = _model(session, tenant.tenant_id, name)
    filters = {"tenant": tenant.tenant_id, "model": model.id}
    cursor = pagination.decode(page_token, filters)
    query = select(ModelVersion).where(ModelVersion.model_id == model.id).order_by(ModelVersion.seq)
    if cursor.after is not None:
        query = query.where(ModelVersion.seq > cursor.after)
    rows, token = pagination.page(
        list(session.exec(query.limit(page_size + 1)).all()), page_size, lambda v: v.seq, filters
    )
    return VersionPage(items=promotion.publish_versions(session, tenant.tenant_id, rows), next_page_token=token)


@router.get("/models/{name}/versions/{ref}", response_model=ModelVersionPublic)
def get_version(name: str, ref: VersionRef, tenant: TenantDep, session: SessionDep):
    row = _resolve(session, _model(session, tenant.tenant_id, name), ref)
    return promotion.publish_versions(session, tenant.tenant_id, [row])[0]


@router.get("/models/{name}/versions/{ref}/manifest", response_model=SignedManifest)
def get_manifest(name: str, ref: VersionRef, tenant: TenantDep, settings: SettingsDep, stores: StoresDep):
    """The signed manifest exactly as pushed; clients verify it against the published keys."""
    with session_scope(settings.database_url) as session:
        digest = _resolve(session, _model(session, tenant.tenant_id, name), ref).digest
    try:
        signed = stores.manifests(tenant.tenant_id).get(digest)
    except (ManifestTamperedError, VersionNotFoundError) as exc:
        log.error("stored manifest of version %s (tenant %s) failed its check: %s", digest, tenant.tenant_id, exc)
        raise Problem(500, "manifest-tampered", "Stored manifest failed verification", str(exc)) from None
    return Response(signed.model_dump_json(), media_type="application/json")


# ---------------------------------------------------------------- evaluations and aliases


def _record_evaluation(
    settings: Settings, stores: RegistryStores, tenant_id: str, name: str, ref: str, signed: SignedEvaluation
) -> tuple[EvaluationResult, bool]:
    record = signed.record
    query = select(EvaluationResult).where(
        EvaluationResult.tenant_id == tenant_id, EvaluationResult.record_digest == record.digest
    )
    with session_scope(settings.database_url) as session:
        digest = _resolve(session, _model(session, tenant_id, name), ref).digest
        if record.version != digest:
            raise _invalid("record.version", f"the record is about version {record.version}, posted for {digest}")
        try:
            promotion.keyring_for(session, tenant_id).verify_evaluation(signed, tenant=tenant_id)
        except (UnknownKeyError, BadSignatureError) as exc:
            raise _signature_problem(exc) from None
        if (existing := session.exec(query).first()) is not None:
            return existing, False
    stores.manifests(tenant_id).add_evaluation(signed)  # the signed record, beside the manifest
    row = EvaluationResult(
        tenant_id=tenant_id,
        version=digest,
        evaluator=record.evaluator,
        results=record.results,
        recorded_at=record.recorded_at,
        record_digest=record.digest,
        key_id=signed.key_id,
        signature=signed.signature,
    )
    try:
        with session_scope(settings.database_url) as session:
            session.add(row)
            return row, True
    except sa.exc.IntegrityError:
        with session_scope(settings.database_url) as session:
            return session.exec(query).one(), False


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
    """Record signed evaluation results for a version (signed by one of the tenant's keys)."""

    async def handler() -> JSONResponse:
        row, created = await run_in_threadpool(
            _record_evaluation, settings, stores, tenant.tenant_id, name, ref, signed
        )
        body = EvaluationResultPublic.model_validate(row, from_attributes=True).model_dump(mode="json")
        return JSONResponse(body, status_code=201 if created else 200)

    return await _idempotent(request, settings, tenant.id, idempotency_key, handler)


def _check_gates(
    session: Session, tenant_id: str, model: RegistryModel, alias: AliasName, version: ModelVersion
) -> None:
    if version.key_id not in promotion.active_key_ids(session, tenant_id):
        raise Problem(
            409,
            "signing-key-revoked",
            "Signing key revoked",
            f"version {version.digest} was signed by key {version.key_id}, which is no longer trusted",
        )
    if failures := promotion.promotion_failures(session, tenant_id, model.id, version.digest):
        raise Problem(
            409,
            "gates-failed",
            "Evaluation gates failed",
            f"{model.name}@{alias.value} cannot move to {version.digest[:12]}: "
            + "; ".join(f.describe() for f in failures),
            failing_metrics=[f.model_dump() for f in failures],
        )


@router.put(
    "/models/{name}/aliases/{alias}",
    response_model=ModelAliasPublic,
    responses={409: {"description": "evaluation gates failed (`failing_metrics` names them)"}},
)
def move_alias(name: str, alias: AliasName, req: AliasMove, tenant: TenantDep, settings: SettingsDep):
    """Point an alias at a version; `staging` and `production` move only when the model's gates pass."""
    with session_scope(settings.database_url) as session:
        # The model row lock serialises moves of one model's aliases (a no-op on SQLite, which
        # already holds the write lock), so two promotions cannot both pass against a stale production.
        model = _model(session, tenant.tenant_id, name, for_update=True)
        version = _resolve(session, model, req.version)
        if alias in GATED_ALIASES:
            _check_gates(session, tenant.tenant_id, model, alias, version)
        row = session.exec(select(ModelAlias).where(ModelAlias.model_id == model.id, ModelAlias.name == alias)).first()
        row = row or ModelAlias(model_id=model.id, name=alias, version=version.digest, moved_by=tenant.id)
        row.version, row.moved_at, row.moved_by = version.digest, utcnow(), tenant.id
        session.add(row)
        return ModelAliasPublic(name=alias, version=row.version, moved_at=row.moved_at, moved_by=row.moved_by)


# ---------------------------------------------------------------- lineage


@router.get("/models/{name}/versions/{ref}/ancestors", response_model=LineagePage)
def get_ancestors(name: str, ref: VersionRef, tenant: TenantDep, session: SessionDep):
    """Parent, grandparent, ... (nearest first), across the tenant's models."""
    row = _resolve(session, _model(session, tenant.tenant_id, name), ref)
    found = promotion.ancestors(session, tenant.tenant_id, row.digest)
    published = promotion.publish_versions(session, tenant.tenant_id, found)
    return LineagePage(items=[LineageEntry(**v.model_dump(), depth=i) for i, v in enumerate(published, start=1)])


@router.get("/models/{name}/versions/{ref}/descendants", response_model=LineagePage)
def get_descendants(name: str, ref: VersionRef, tenant: TenantDep, session: SessionDep):
    """Every version derived from this one, breadth first, across the tenant's models."""
    row = _resolve(session, _model(session, tenant.tenant_id, name), ref)
    found = promotion.descendants(session, tenant.tenant_id, row.digest)
    published = promotion.publish_versions(session, tenant.tenant_id, [r for r, _ in found])
    return LineagePage(
        items=[LineageEntry(**v.model_dump(), depth=d) for v, (_, d) in zip(published, found, strict=True)]
    )


# ---------------------------------------------------------------- garbage collection (operators)


MIN_GC_GRACE_SECONDS = 3600
"""A push over the API holds no lease while it uploads: only the grace period keeps its fresh
chunks, so the API refuses one shorter than this (a push slower than the grace period loses
chunks and re-sends them when the manifest is refused with `chunks-missing`)."""
MAX_LISTED_IDS = 1000


class GcRequest(BaseModel):
    tenant_id: str | None = Field(None, description="one tenant; default: every tenant with a model")
    grace_period_seconds: int = Field(
        int(gc.GRACE_PERIOD.total_seconds()),
        ge=MIN_GC_GRACE_SECONDS,
        description="unreferenced chunks younger than this are kept",
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


@router.post("/registry/gc", response_model=GcReport)
def collect_garbage(req: GcRequest, operator: OperatorDep, session: SessionDep, stores: StoresDep):
    """Remove (or with `dry_run`, list) chunks no version references, older than the grace period;
    chunks of pushes in progress are kept (`gpucloud.registry.gc`)."""
    tenant_ids = list(session.exec(select(RegistryModel.tenant_id).distinct().order_by(RegistryModel.tenant_id)))
    session.rollback()  # end the read transaction: the run below may take a while
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
