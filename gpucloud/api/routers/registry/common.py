"""What the registry's routers share: the stores, the caller's model and version lookups, problems,
and idempotent creates."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Depends, Request
from fastapi import Path as PathParam
from sqlmodel import Session, col, select

from gpucloud.config import Settings
from gpucloud.db import read_scope
from gpucloud.models.registry_tables import DIGEST_PATTERN, ModelAlias, ModelVersion, RegistryModel
from gpucloud.registry.manifest import (
    IntegrityError,
    ManifestTamperedError,
    UnknownKeyError,
    VersionNotFoundError,
    is_digest,
)
from gpucloud.registry.names import AliasName
from gpucloud.registry.stores import RegistryStores
from gpucloud.web.problems import Problem, invalid, not_found

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
    query = select(ModelVersion).where(col(ModelVersion.model_id) == model.id)
    if ref in {a.value for a in AliasName}:
        alias = session.exec(
            select(ModelAlias).where(col(ModelAlias.model_id) == model.id, col(ModelAlias.name) == ref)
        ).first()
        if alias is None:
            raise not_found("alias", f"{model.name}@{ref}")
        query = query.where(col(ModelVersion.digest) == alias.version)
    elif is_digest(ref):
        query = query.where(col(ModelVersion.digest) == ref)
    elif re.fullmatch(r"[0-9a-f]{8,63}", ref):
        query = query.where(col(ModelVersion.digest).startswith(ref))
    else:
        raise invalid(
            field,
            f"{ref!r} is not a digest, a digest prefix of at least 8 hex digits, or an alias "
            f"({', '.join(a.value for a in AliasName)})",
        )
    rows = session.exec(query.limit(2)).all()
    if len(rows) > 1:
        raise invalid(field, f"prefix {ref!r} matches several versions; give more digits")
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
