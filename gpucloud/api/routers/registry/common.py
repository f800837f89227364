"""What the registry's routers share: the stores, the caller's model and version lookups, problems,
and idempotent creates."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi import Path as PathParam
from sqlmodel import Session, col, select

from gpucloud.config import Settings
from gpucloud.db import read_scope
from gpucloud.models.registry_names import RefKind, ref_kind
from gpucloud.models.registry_tables import DIGEST_PATTERN, ModelAlias, ModelVersion, RegistryModel
from gpucloud.registry.manifest import (
    IntegrityError,
    ManifestTamperedError,
    UnknownKeyError,
    VersionNotFoundError,
)
from gpucloud.registry.stores import RegistryStores
from gpucloud.web.problems import Problem, invalid, not_found

# An ambiguous digest prefix names at most this many of the versions it matches.
_CANDIDATES_NAMED = 5
READ_BATCH = 4 << 20  # an upload reaches the store's writer thread in pieces of about this size

ChunkId = Annotated[str, PathParam(pattern=DIGEST_PATTERN, description="BLAKE3 hex of the chunk's bytes")]
VersionRef = Annotated[str, PathParam(description="a digest, a unique digest prefix (8+ hex digits) or an alias")]


async def get_stores(request: Request) -> RegistryStores:
    return request.app.state.registry_stores


StoresDep = Annotated[RegistryStores, Depends(get_stores)]


# ---------------------------------------------------------------- helpers


def model_row(session: Session, tenant_id: str, name: str, *, for_update: bool = False) -> RegistryModel:
    query = select(RegistryModel).where(col(RegistryModel.tenant_id) == tenant_id, col(RegistryModel.name) == name)
    model = session.exec(query.with_for_update() if for_update else query).first()
    if model is None:
        raise not_found("model", name)
    return model


def resolve_version(session: Session, model: RegistryModel, ref: str, *, field: str = "version") -> ModelVersion:
    """The version REF names (`names.ref_kind`): 404 where none does, 422 where the ref is not one
    or a digest prefix matches several versions (naming them, so the caller can pick)."""
    query = select(ModelVersion).where(col(ModelVersion.model_id) == model.id)
    try:
        kind = ref_kind(ref)
    except ValueError as exc:
        raise invalid(field, str(exc)) from None
    if kind == RefKind.ALIAS:
        alias = session.exec(
            select(ModelAlias).where(col(ModelAlias.model_id) == model.id, col(ModelAlias.name) == ref)
        ).first()
        if alias is None:
            raise not_found("alias", f"{model.name}@{ref}")
        query = query.where(col(ModelVersion.digest) == alias.version)
    elif kind == RefKind.DIGEST:
        query = query.where(col(ModelVersion.digest) == ref)
    else:
        query = query.where(col(ModelVersion.digest).startswith(ref))
    rows = session.exec(query.order_by(col(ModelVersion.digest)).limit(_CANDIDATES_NAMED + 1)).all()
    if len(rows) > 1:
        named = ", ".join(r.digest for r in rows[:_CANDIDATES_NAMED]) + (
            ", ..." if len(rows) > _CANDIDATES_NAMED else ""
        )
        raise invalid(
            field,
            f"prefix {ref!r} matches several versions of {model.name} ({named}); give more digits",
            "ambiguous-version",
        )
    if not rows:
        raise not_found("version", f"{model.name}@{ref}")
    return rows[0]


def signature_problem(exc: IntegrityError) -> Problem:
    if isinstance(exc, UnknownKeyError):
        return invalid(
            "key_id", f"{exc}; register the public key with POST /v1/signing-keys first", "unknown-signing-key"
        )
    return invalid(
        "signature", f"{exc}: the signed content was changed after signing, or another key signed it", "bad-signature"
    )


def check_model(settings: Settings, tenant_id: str, name: str) -> None:
    with read_scope(settings.database_url) as session:
        model_row(session, tenant_id, name)


# The chunk ids of a version, by (tenant, digest): a manifest is addressed by its digest, so what
# it lists never changes; bounded, as each entry is a whole version's list.
_VERSION_CHUNKS: dict[tuple[str, str], frozenset[str]] = {}
_VERSIONS_CACHED = 64


def version_chunks(stores: RegistryStores, tenant_id: str, digest: str) -> frozenset[str]:
    """The chunks version `digest` of the tenant lists (none if its manifest is gone)."""
    known = _VERSION_CHUNKS.get((tenant_id, digest))
    if known is None:
        try:
            known = frozenset(stores.manifests(tenant_id).get(digest).manifest.chunk_ids())
        except (VersionNotFoundError, ManifestTamperedError):
            return frozenset()
        if len(_VERSION_CHUNKS) >= _VERSIONS_CACHED:
            _VERSION_CHUNKS.pop(next(iter(_VERSION_CHUNKS), ("", "")), None)
        _VERSION_CHUNKS[(tenant_id, digest)] = known
    return known
