"""Chunks: which of these the store lacks, upload (hashed on the way in), download (hashed on the way out)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from anyio import from_thread
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from gpucloud.api.deps import SettingsDep, TenantDep, VersionReaderDep, out_of_scope, scoped_versions
from gpucloud.api.routers.registry.common import (
    READ_BATCH,
    ChunkId,
    StoresDep,
    check_model,
    model_row,
    version_chunks,
)
from gpucloud.config import Settings
from gpucloud.db import read_scope
from gpucloud.models.registry_tables import (
    ChunkQuery,
    ChunkStored,
    MissingChunks,
)
from gpucloud.registry import promotion
from gpucloud.registry.integrity import ChunkDigestMismatchError
from gpucloud.registry.manifest import ChunkMissingError, IntegrityError
from gpucloud.registry.store import ChunkStore
from gpucloud.services import storage_quota
from gpucloud.storage.direct import AlignedPool
from gpucloud.web.problems import Problem, invalid, not_found

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
    """Store a chunk, hashed as it arrives and written once: straight from the connection into
    the store's temp file, which becomes the chunk only if the bytes hash to its id."""
    limit = settings.registry.max_chunk_size
    declared = request.headers.get("content-length", "")
    if not declared.isdigit():
        raise Problem(
            411, "length-required", "Length required", "send the chunk with a Content-Length header (its size in bytes)"
        )
    size = int(declared)
    if size > limit:
        raise Problem(413, "chunk-too-large", "Chunk too large", f"a chunk may have at most {limit} bytes")
    chunks = stores.chunks(tenant.tenant_id)
    reserved = await run_in_threadpool(_admit, settings, tenant.tenant_id, name, chunks, chunk_id, size)
    body = _RequestBody(request, size)
    stored = False
    try:
        stored = await run_in_threadpool(chunks.put, chunk_id, body)
        if not stored:
            await body.drain()  # the store had it: read the rest, so the connection can carry the next request
    except ChunkDigestMismatchError as exc:
        raise invalid(
            "chunk_id",
            f"the {size} bytes sent hash to {exc.actual}, not to {chunk_id}; nothing was stored",
            "chunk-digest-mismatch",
        ) from None
    finally:
        body.release()
        if reserved and not stored:  # nothing new was stored: the reservation goes back
            await run_in_threadpool(storage_quota.release, settings.database_url, tenant.tenant_id, reserved)
    return JSONResponse(
        ChunkStored(id=chunk_id, size=size, stored=stored).model_dump(), status_code=201 if stored else 200
    )


def _admit(settings: Settings, tenant_id: str, name: str, chunks: ChunkStore, chunk_id: str, size: int) -> int:
    """The model is the tenant's, and a chunk its store lacks has its size reserved against the
    quota (a chunk already stored costs nothing), before any byte of the body is taken: the
    bytes reserved, which the upload gives back if it stores nothing."""
    stored = chunks.has(chunk_id)  # before the session: on S3 this is a request of its own
    with read_scope(settings.database_url) as session:
        model_row(session, tenant_id, name)
    if stored:
        return 0
    storage_quota.reserve(settings.database_url, tenant_id, size, settings.registry.storage_quota_bytes)
    return size


class _RequestBody:
    """The request's body as a blocking `read()` for the store's writer thread: each call asks the
    event loop for the next `READ_BATCH` bytes (so the thread hops once per batch, not once per
    network read), whatever `read` is asked for, and returns a view of a buffer the next call
    overwrites (the store hashes and writes each piece before it reads the next). The buffers come
    from a pool, so an upload fills memory the process wrote a moment ago rather than fresh pages.
    The HTTP server frames the body by its Content-Length, and a client that goes away ends the
    stream with an error; the count is checked once more at the end, so that no server that frames
    it otherwise stores a short body. Call `release` once the store is done with it."""

    def __init__(self, request: Request, size: int) -> None:
        self._pieces = request.stream()
        self._size, self._received = size, 0
        self._buffer: memoryview | None = None
        self._leftover = memoryview(b"")

    async def _next(self) -> memoryview:
        if self._buffer is None:
            self._buffer = _BATCHES.take()
        batch, filled = self._buffer, 0
        while filled < len(batch):
            if not self._leftover:
                piece = await anext(self._pieces, None)
                if piece is None:
                    if self._received != self._size:
                        raise invalid("body", f"{self._received} bytes arrived, the Content-Length said {self._size}")
                    break
                self._received += len(piece)
                self._leftover = memoryview(piece)
            n = min(len(self._leftover), len(batch) - filled)
            batch[filled : filled + n] = self._leftover[:n]
            self._leftover, filled = self._leftover[n:], filled + n
        return batch[:filled]

    def read(self, size: int = -1, /) -> memoryview:
        return from_thread.run(self._next)

    async def drain(self) -> None:
        while await self._next():
            pass

    def release(self) -> None:
        if self._buffer is not None:
            _BATCHES.give(self._buffer)
            self._buffer = None


_BATCHES = AlignedPool(READ_BATCH, keep=8)  # aligned: the store writes a batch straight from it


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
def download_chunk(name: str, chunk_id: ChunkId, reader: VersionReaderDep, settings: SettingsDep, stores: StoresDep):
    """A chunk's bytes; an evaluation's token reads only the chunks its versions list."""
    assert reader.tenant_id is not None  # a tenant, or an evaluation for one (`get_version_reader`)
    tenant_id = reader.tenant_id
    check_model(settings, tenant_id, name)
    versions = scoped_versions(reader, name)
    if versions is not None and not any(chunk_id in version_chunks(stores, tenant_id, v) for v in versions):
        raise out_of_scope(f"chunk {chunk_id}: no version it may read lists it")
    failed: IntegrityError | None = None
    chunks = stores.chunks(tenant_id)
    try:
        size = chunks.stat(chunk_id).size
        pieces = chunks.stream(chunk_id)
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

    # A declared length lets the client read the body without chunked framing; bytes that fail
    # the store's check end the response short of it, which no client takes as complete.
    headers = {} if failed is not None else {"Content-Length": str(size)}
    return StreamingResponse(
        _served(tenant_id, chunk_id, body()), media_type="application/octet-stream", headers=headers
    )
