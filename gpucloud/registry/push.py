"""Push a directory of files as one signed model version.

A push runs in an order that makes it safe to interrupt and safe next to garbage collection:

1. chunk and hash every file (reading each once, in bounded buffers) and build the manifest;
2. write a push lease listing every chunk the version needs, so GC keeps the ones that already
   exist while this push relies on them;
3. upload only the chunks the store lacks (each store verifies the bytes against the id before
   they become visible), renewing the lease while the uploads run;
4. check that the chunks it reused are still there (re-uploading any a concurrent GC removed,
   see `gpucloud.registry.gc`), then write the signed manifest, last, and drop the lease.

A version exists once its manifest exists, and a manifest only lands after all its chunks did.
An interrupted push leaves verified chunks and no manifest: running it again re-hashes the files
and uploads only what is still missing.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from gpucloud.registry.chunking import DEFAULT_POLICY, ChunkPolicy, FileRegion, chunk_file
from gpucloud.registry.gc import LEASE_RENEW_SECONDS, LEASE_SETTLE_SECONDS
from gpucloud.registry.manifest import (
    ChunkCorruptedError,
    ChunkRef,
    FileEntry,
    Lineage,
    Manifest,
    PushLease,
    SignedManifest,
    Signer,
)
from gpucloud.registry.store import ChunkStore, ManifestStore


@dataclass(frozen=True, slots=True)
class TransferProgress:
    """Bytes done out of bytes total in one phase of a push or pull."""

    phase: Literal["hash", "upload", "download"]
    done: int
    total: int


ProgressCallback = Callable[[TransferProgress], None]


@dataclass(frozen=True, slots=True)
class PushResult:
    signed: SignedManifest
    bytes_total: int
    chunks_total: int
    chunks_uploaded: int
    bytes_uploaded: int
    hash_seconds: float
    upload_seconds: float

    @property
    def digest(self) -> str:
        return self.signed.digest

    @property
    def bytes_skipped(self) -> int:
        """Bytes not sent because the store (or an earlier file of this version) had them."""
        return self.bytes_total - self.bytes_uploaded


@dataclass(frozen=True, slots=True)
class _Source:
    path: Path
    relative: str
    chunk: ChunkRef


def source_files(root: Path) -> list[tuple[str, Path]]:
    """Regular files under root as (relative POSIX path, path), sorted; links are refused."""
    found = []
    for directory, subdirs, names in os.walk(root):
        for name in subdirs + names:
            path = Path(directory, name)
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise ValueError(f"{path} is not a regular file or directory; refusing to push it")
        found.extend((Path(directory, n).relative_to(root).as_posix(), Path(directory, n)) for n in names)
    return sorted(found)


def _upload(store: ChunkStore, source: _Source) -> bool:
    chunk = source.chunk
    try:
        with FileRegion(source.path, chunk.offset, chunk.size) as region:
            return store.put(chunk.id, region)
    except ChunkCorruptedError as exc:
        raise ChunkCorruptedError(
            f"file changed while it was being pushed ({exc})",
            chunk_id=chunk.id,
            path=source.relative,
            offset=chunk.offset,
        ) from None


class _Uploader:
    """Runs one pass of uploads on a thread pool and renews the lease while it waits."""

    def __init__(
        self,
        store: ChunkStore,
        manifest_store: ManifestStore,
        lease: PushLease,
        *,
        concurrency: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.store, self.manifest_store, self.lease = store, manifest_store, lease
        self.concurrency, self.progress = concurrency, progress
        self.chunks_uploaded = self.bytes_uploaded = 0
        self._renewed = time.monotonic()

    def run(self, sources: list[_Source], *, report: bool = True) -> list[_Source]:
        """Put every source (a put skips what the store has); return those it already had."""
        total, done, present = sum(s.chunk.size for s in sources), 0, []
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            pending: dict[Future[bool], _Source] = {pool.submit(_upload, self.store, s): s for s in sources}
            try:
                while pending:
                    finished, _ = wait(pending, timeout=LEASE_RENEW_SECONDS, return_when=FIRST_COMPLETED)
                    for future in finished:
                        source = pending.pop(future)
                        if future.result():
                            self.chunks_uploaded += 1
                            self.bytes_uploaded += source.chunk.size
                        else:
                            present.append(source)
                        done += source.chunk.size
                        if report and self.progress is not None:
                            self.progress(TransferProgress("upload", done, total))
                    self._renew_if_due()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return present

    def _renew_if_due(self) -> None:
        if time.monotonic() - self._renewed >= LEASE_RENEW_SECONDS:
            self.lease = self.lease.model_copy(update={"renewed_at": datetime.now(UTC)})
            self.manifest_store.put_lease(self.lease)
            self._renewed = time.monotonic()


def push(
    source_dir: str | Path,
    *,
    model: str,
    chunk_store: ChunkStore,
    manifest_store: ManifestStore,
    signer: Signer,
    lineage: Lineage | None = None,
    created_at: datetime | None = None,
    policy: ChunkPolicy = DEFAULT_POLICY,
    concurrency: int = 4,
    progress: ProgressCallback | None = None,
    settle_seconds: float = LEASE_SETTLE_SECONDS,
) -> PushResult:
    """Push every regular file under source_dir as one version of model; see the module doc."""
    root = Path(source_dir)
    files = source_files(root)
    bytes_to_hash = sum(path.stat().st_size for _, path in files)

    started = time.perf_counter()
    hashed = 0

    def on_chunk(size: int) -> None:
        nonlocal hashed
        hashed += size
        if progress is not None:
            progress(TransferProgress("hash", hashed, bytes_to_hash))

    entries: dict[str, FileEntry] = {
        relative: chunk_file(path, policy=policy, on_chunk=on_chunk) for relative, path in files
    }
    signed = signer.sign(Manifest.build(model=model, files=entries, lineage=lineage, created_at=created_at))
    hash_seconds = time.perf_counter() - started

    unique: dict[str, _Source] = {}
    for relative, path in files:
        for chunk in entries[relative].chunks:
            unique.setdefault(chunk.id, _Source(path, relative, chunk))
    now = datetime.now(UTC)
    lease = PushLease(
        lease_id=uuid.uuid4().hex,
        model=model,
        chunk_ids=sorted(unique),
        created_at=now,
        renewed_at=now,
    )

    started = time.perf_counter()
    manifest_store.put_lease(lease)
    leased_at = time.monotonic()
    try:
        uploader = _Uploader(chunk_store, manifest_store, lease, concurrency=concurrency, progress=progress)
        reused = uploader.run(list(unique.values()))
        if reused:
            # A GC pass that read the leases before ours existed may still be deleting; once
            # the settle time has passed it has finished its batch, and we re-check what we reused.
            time.sleep(max(0.0, leased_at + settle_seconds - time.monotonic()))
            uploader.run(reused, report=False)
        manifest_store.put(signed)
    finally:
        manifest_store.delete_lease(lease.lease_id)
    return PushResult(
        signed=signed,
        bytes_total=signed.manifest.total_size,
        chunks_total=signed.manifest.chunk_count,
        chunks_uploaded=uploader.chunks_uploaded,
        bytes_uploaded=uploader.bytes_uploaded,
        hash_seconds=hash_seconds,
        upload_seconds=time.perf_counter() - started,
    )
