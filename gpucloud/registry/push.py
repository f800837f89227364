"""Push a directory of files as one signed model version: the one push path, whatever receives
it. `gpucloud weights push` pushes over the registry API (`client.registry.RegistryPushTarget`);
tools and tests that hold the stores push straight into them (`StoreTarget`).

A push runs in an order that makes it safe to interrupt and safe next to garbage collection:

1. chunk and hash every file (reading each once, in bounded buffers); every few dozen chunks,
   tell the target which chunks the version needs and learn which ones it lacks (a store target
   names them in a push lease first, so GC keeps the chunks that already exist while the push
   relies on them; the API keeps fresh uploads through GC's grace period);
2. upload only the missing chunks while hashing goes on (the target verifies the bytes against
   the id before they count as stored), keeping the target's hold alive while the uploads run;
3. sign the manifest and commit it, last. A target that finds a reused chunk gone by then (a
   concurrent GC) says which (`ChunksMissing`): they are sent again, once, and the commit retried.

A version exists once its manifest exists, and a manifest only lands after all its chunks did.
An interrupted push leaves verified chunks and no manifest: running it again re-hashes the files
and uploads only what is still missing.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

from gpucloud.registry.chunking import DEFAULT_POLICY, ChunkPolicy, FileRegion, chunk_file
from gpucloud.registry.gc import LEASE_RENEW_SECONDS, LEASE_SETTLE_SECONDS
from gpucloud.registry.manifest import (
    ChunkCorruptedError,
    ChunkRef,
    Lineage,
    Manifest,
    PushLease,
    SignedManifest,
    Signer,
)
from gpucloud.registry.store import ChunkStore, ManifestStore


@dataclass(frozen=True, slots=True)
class TransferProgress:
    """Bytes done out of bytes total in one phase of a pull."""

    phase: Literal["hash", "upload", "download"]
    done: int
    total: int


ProgressCallback = Callable[[TransferProgress], None]


@dataclass
class PushStats:
    """What a push did; `bytes_skipped` were not sent because the target (or this push) had them."""

    bytes_total: int = 0
    chunks_total: int = 0
    bytes_hashed: int = 0
    bytes_to_upload: int = 0
    chunks_to_upload: int = 0
    bytes_uploaded: int = 0
    uploaded_ids: list[str] = field(default_factory=list)

    @property
    def chunks_uploaded(self) -> int:
        return len(self.uploaded_ids)

    @property
    def bytes_skipped(self) -> int:
        return self.bytes_total - self.bytes_to_upload

    def as_dict(self) -> dict[str, Any]:
        """The figures, derived ones included (what `--output json` prints)."""
        return asdict(self) | {"chunks_uploaded": self.chunks_uploaded, "bytes_skipped": self.bytes_skipped}


PushReport = Callable[[Literal["hash", "upload"], PushStats], None]


@dataclass(frozen=True)
class PushResult:
    signed: SignedManifest
    stats: PushStats
    version: dict[str, Any]  # the target's record of the version (the API's answer)
    hash_seconds: float
    upload_seconds: float

    @property
    def digest(self) -> str:
        """The version's digest as the target answered it: a push of content it already held is
        the version registered first, not the manifest signed here."""
        return str(self.version.get("digest") or self.signed.digest)

    @property
    def existed(self) -> bool:
        """The target already held this version (the registry answered 200): nothing new was registered."""
        return bool(self.version.get("existed"))

    @property
    def bytes_total(self) -> int:
        return self.stats.bytes_total

    @property
    def chunks_total(self) -> int:
        return self.stats.chunks_total

    @property
    def chunks_uploaded(self) -> int:
        return self.stats.chunks_uploaded

    @property
    def bytes_uploaded(self) -> int:
        return self.stats.bytes_uploaded

    @property
    def bytes_skipped(self) -> int:
        return self.stats.bytes_skipped


class ChunksMissing(Exception):
    """The commit found chunks of the version gone from the target (a concurrent GC)."""

    def __init__(self, chunk_ids: list[str]) -> None:
        super().__init__(f"{len(chunk_ids)} chunks of the version are missing")
        self.chunk_ids = chunk_ids


class PushTarget(Protocol):
    """Where a push goes: the registry API or a pair of stores."""

    def begin(self, model: str, signer: Signer) -> None:
        """Get ready for a version of `model` signed by `signer`."""

    def missing(self, model: str, chunk_ids: list[str]) -> list[str]:
        """The version needs these chunks too: the ones the target lacks (a store target names
        them in its push lease first)."""

    def upload(self, model: str, chunk: ChunkRef, path: Path) -> None: ...

    def keep_alive(self) -> None:
        """Called now and then while hashing and uploads run (a store target renews its lease)."""

    def commit(self, model: str, signed: SignedManifest) -> dict[str, Any]:
        """Store the signed manifest; `ChunksMissing` if some chunks are gone."""

    def end(self) -> None:
        """After the push, done or failed."""


def source_files(root: Path) -> list[tuple[str, Path]]:
    """Regular files under root as (relative POSIX path, path), sorted; links are refused."""
    found: list[tuple[str, Path]] = []
    for directory, subdirs, names in os.walk(root):
        for name in subdirs + names:
            path = Path(directory, name)
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise ValueError(f"{path} is not a regular file or directory; refusing to push it")
        found.extend((Path(directory, n).relative_to(root).as_posix(), Path(directory, n)) for n in names)
    return sorted(found)


def push(
    source_dir: str | Path,
    *,
    model: str,
    target: PushTarget,
    signer: Signer,
    lineage: Lineage | None = None,
    created_at: datetime | None = None,
    policy: ChunkPolicy = DEFAULT_POLICY,
    concurrency: int = 8,
    report: PushReport = lambda phase, stats: None,
) -> PushResult:
    """Push every regular file under source_dir as one signed version of model; see the module doc.

    Hashing and uploading overlap: every `ASK_BATCH` chunks hashed, the target is asked which of
    them it lacks, and those start uploading (`concurrency` at a time) while hashing goes on.
    """
    files = source_files(Path(source_dir))
    stats = PushStats(bytes_total=sum(path.stat().st_size for _, path in files))
    uploads = _Uploads(target, model, stats, report, concurrency)
    started = time.perf_counter()
    target.begin(model, signer)
    try:
        with uploads:
            entries = {
                relative: chunk_file(path, policy=policy, on_chunk=functools.partial(uploads.hashed, path))
                for relative, path in files
            }
            uploads.ask()
            hash_seconds = time.perf_counter() - started
        signed = signer.sign(Manifest.build(model=model, files=entries, lineage=lineage, created_at=created_at))
        stats.chunks_total = signed.manifest.chunk_count
        try:
            version = target.commit(model, signed)
        except ChunksMissing as gone:
            with uploads:
                uploads.start(gone.chunk_ids)
            version = target.commit(model, signed)
    finally:
        target.end()
    return PushResult(
        signed=signed,
        stats=stats,
        version=version,
        hash_seconds=hash_seconds,
        upload_seconds=time.perf_counter() - started,
    )


ASK_BATCH = 32  # chunks hashed between two questions to the target


class _Uploads:
    """The upload side of a push: chunks as they are hashed, asked about in batches, the missing
    ones uploaded by a thread pool. Leaving the `with` block waits for every upload, renewing the
    target's hold meanwhile; the first failure stops the push, and what was stored stays for a
    resume."""

    def __init__(self, target: PushTarget, model: str, stats: PushStats, report: PushReport, concurrency: int) -> None:
        self.target, self.model, self.stats, self.report = target, model, stats, report
        self.concurrency = concurrency
        self.sources: dict[str, tuple[Path, ChunkRef]] = {}
        self._unasked: list[str] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: set[Future[None]] = set()

    def __enter__(self) -> _Uploads:
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="push-upload")
        return self

    def hashed(self, path: Path, chunk: ChunkRef) -> None:
        with self._lock:
            self.stats.bytes_hashed += chunk.size
        self.report("hash", self.stats)
        if chunk.id not in self.sources:  # a chunk repeated within the version is sent once
            self.sources[chunk.id] = (path, chunk)
            self._unasked.append(chunk.id)
        if len(self._unasked) >= ASK_BATCH:
            self.ask()

    def ask(self) -> None:
        """Ask the target about the chunks hashed since the last time; upload what it lacks."""
        batch, self._unasked = self._unasked, []
        self.target.keep_alive()
        for future in [f for f in self._pending if f.done()]:  # fail fast on a failed upload
            self._pending.discard(future)
            future.result()
        if batch:
            self.start(self.target.missing(self.model, batch))

    def start(self, chunk_ids: list[str]) -> None:
        assert self._pool is not None
        with self._lock:
            self.stats.chunks_to_upload += len(chunk_ids)
            self.stats.bytes_to_upload += sum(self.sources[chunk_id][1].size for chunk_id in chunk_ids)
        self.report("upload", self.stats)
        self._pending |= {self._pool.submit(self._one, *self.sources[chunk_id]) for chunk_id in chunk_ids}

    def _one(self, path: Path, chunk: ChunkRef) -> None:
        self.target.upload(self.model, chunk, path)
        with self._lock:
            self.stats.bytes_uploaded += chunk.size
            self.stats.uploaded_ids.append(chunk.id)
        self.report("upload", self.stats)

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        assert self._pool is not None
        pool, self._pool = self._pool, None
        try:
            while exc_type is None and self._pending:
                finished, self._pending = wait(self._pending, timeout=LEASE_RENEW_SECONDS, return_when=FIRST_COMPLETED)
                self.target.keep_alive()
                for future in finished:
                    future.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True, cancel_futures=exc_type is not None)


class StoreTarget:
    """A push straight into a chunk store and a manifest store, safe next to their GC: a push
    lease names every chunk the version needs until the manifest is written."""

    def __init__(
        self, chunks: ChunkStore, manifests: ManifestStore, *, settle_seconds: float = LEASE_SETTLE_SECONDS
    ) -> None:
        self.chunks, self.manifests, self.settle_seconds = chunks, manifests, settle_seconds
        self._lease: PushLease | None = None
        self._leased_at = self._renewed = 0.0
        self._reused: list[str] = []

    def begin(self, model: str, signer: Signer) -> None:
        now = datetime.now(UTC)
        self._lease = PushLease(lease_id=uuid.uuid4().hex, model=model, chunk_ids=[], created_at=now, renewed_at=now)
        self.manifests.put_lease(self._lease)
        self._leased_at = self._renewed = time.monotonic()

    def missing(self, model: str, chunk_ids: list[str]) -> list[str]:
        # The lease names the chunks before they are looked at, so a GC that reads it keeps them.
        assert self._lease is not None
        named = sorted(set(self._lease.chunk_ids) | set(chunk_ids))
        self._lease = self._lease.model_copy(update={"chunk_ids": named, "renewed_at": datetime.now(UTC)})
        self.manifests.put_lease(self._lease)
        self._leased_at = self._renewed = time.monotonic()
        present = {chunk_id for chunk_id in chunk_ids if self.chunks.has(chunk_id)}
        self._reused += sorted(present)
        return [chunk_id for chunk_id in chunk_ids if chunk_id not in present]

    def upload(self, model: str, chunk: ChunkRef, path: Path) -> None:
        try:
            with FileRegion(path, chunk.offset, chunk.size) as region:
                self.chunks.put(chunk.id, region)
        except ChunkCorruptedError as exc:
            raise ChunkCorruptedError(
                f"file changed while it was being pushed ({exc})",
                chunk_id=chunk.id,
                path=str(path),
                offset=chunk.offset,
            ) from None

    def keep_alive(self) -> None:
        if self._lease is not None and time.monotonic() - self._renewed >= LEASE_RENEW_SECONDS:
            self._lease = self._lease.model_copy(update={"renewed_at": datetime.now(UTC)})
            self.manifests.put_lease(self._lease)
            self._renewed = time.monotonic()

    def commit(self, model: str, signed: SignedManifest) -> dict[str, Any]:
        if self._reused:
            # A GC pass that read the leases before ours existed may still be deleting; once the
            # settle time has passed it has finished its batch, and what we reused is checked.
            time.sleep(max(0.0, self._leased_at + self.settle_seconds - time.monotonic()))
            gone, self._reused = [c for c in self._reused if not self.chunks.has(c)], []
            if gone:
                raise ChunksMissing(gone)
        return {"model": model, "digest": self.manifests.put(signed)}

    def end(self) -> None:
        if self._lease is not None:
            self.manifests.delete_lease(self._lease.lease_id)
            self._lease = None
