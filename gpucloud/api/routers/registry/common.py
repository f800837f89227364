"""What the registry's routers share: the stores, the caller's model and version lookups, problems,
and idempotent creates."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi import Path as PathParam

from gpucloud.db import Database
from gpucloud.models.registry_tables import DIGEST_PATTERN
from gpucloud.registry.manifest import (
    ManifestTamperedError,
    VersionNotFoundError,
)
from gpucloud.registry.stores import RegistryStores
from gpucloud.services.registry_models import model_row

READ_BATCH = 4 << 20  # an upload reaches the store's writer thread in pieces of about this size

ChunkId = Annotated[str, PathParam(pattern=DIGEST_PATTERN, description="BLAKE3 hex of the chunk's bytes")]
VersionRef = Annotated[str, PathParam(description="a digest, a unique digest prefix (8+ hex digits) or an alias")]


async def get_stores(request: Request) -> RegistryStores:
    return request.app.state.registry_stores


StoresDep = Annotated[RegistryStores, Depends(get_stores)]


# ---------------------------------------------------------------- helpers


def check_model(db: Database, tenant_id: str, name: str) -> None:
    with db.reads() as session:
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
