"""Chunks: which of these the store lacks, upload (hashed on the way in), download (hashed on the way out)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from gpucloud.api.deps import SettingsDep, TenantDep
from gpucloud.api.routers.registry.common import (
    SPOOL_IN_MEMORY,
    WRITE_BATCH,
    ChunkId,
    StoresDep,
    check_model,
    invalid,
)
from gpucloud.models.registry_tables import (
    ChunkQuery,
    ChunkStored,
    MissingChunks,
)
from gpucloud.registry import promotion
from gpucloud.registry.manifest import (
    ChunkCorruptedError,
    ChunkMissingError,
    IntegrityError,
)
from gpucloud.services import storage_quota
from gpucloud.web.problems import Problem, not_found

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["registry"])


@router.post("/models/{name}/chunks:missing", response_model=MissingChunks)
def missing_chunks(name: str, req: ChunkQuery, tenant: TenantDep, settings: SettingsDep, stores: StoresDep):
    """Which of these chunk ids the tenant's store lacks: upload only those (and resume with the rest)."""
    check_model(settings, tenant.tenant_id, name)
    return MissingChunks(missing=promotion.missing_chunks(stores.chunks(tenant.tenant_id), req.chunk_ids))


@router.put(
    "/models/{name}/chunks/{chunk_id}",
    status_code=201,
    response_model=ChunkStored,
    responses={200: {"description": "the store already had the chunk", "model": ChunkStored}},
)
async def upload_chunk(
    name: str, chunk_id: ChunkId, request: Request, tenant: TenantDep, settings: SettingsDep, stores: StoresDep
):
    await run_in_threadpool(check_model, settings, tenant.tenant_id, name)
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
        chunks = stores.chunks(tenant.tenant_id)
        if not await run_in_threadpool(chunks.has, chunk_id):  # a chunk already stored costs nothing
            quota = settings.registry.storage_quota_bytes
            await run_in_threadpool(storage_quota.admit, settings.database_url, tenant.tenant_id, size, quota)
        try:
            stored = await run_in_threadpool(chunks.put, chunk_id, spool)
        except ChunkCorruptedError as exc:
            raise invalid(
                "chunk_id",
                f"the {size} bytes sent hash to {exc.actual_id}, not to {chunk_id}; nothing was stored",
                "chunk-digest-mismatch",
            ) from None
    if stored:
        await run_in_threadpool(storage_quota.add, settings.database_url, tenant.tenant_id, size)
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
    check_model(settings, tenant.tenant_id, name)
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
