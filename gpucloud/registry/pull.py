"""Pull a model version into a directory, failing closed.

The manifest is fetched by digest (the store checks it still hashes to that digest) and its
signature verified against the tenant's keyring before a single chunk is fetched. Files are
assembled in a temp directory next to the destination (with direct I/O where the file system
allows it: `gpucloud.storage.direct`); every chunk is hashed while it is written and its size
counted, every file's chunk sequence and total size checked, everything fsynced,
and only then is the temp directory renamed onto the destination in one step. Any failure
removes the temp directory, so the destination holds a complete verified version or nothing.

What failed is reported as a specific `IntegrityError`: `ChunkMissingError`,
`ChunkCorruptedError`, `ChunkTruncatedError`, `ChunkSwappedError` (the store served another chunk
of the same version), `ChunkUnavailableError`, `FileMismatchError`, `ManifestTamperedError`,
`BadSignatureError` or `UnknownKeyError`, each naming the file, chunk id and offset (or the
version and key) involved.

Chunk fetches are retried (with tenacity, the project's one retry library) as `ChunkRetry` says:
a broken transfer (connection reset, cut-off body, a 5xx from the store) a few times with
backoff, then `ChunkUnavailableError`; bytes that arrive whole but hash wrong once more at most,
then the integrity error. Nothing unverified is ever kept: a retry rewrites the chunk's whole
range, and the version still lands only at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tenacity

from gpucloud.registry.manifest import (
    ChunkCorruptedError,
    ChunkError,
    ChunkMissingError,
    ChunkRef,
    ChunkSwappedError,
    ChunkTransferError,
    ChunkTruncatedError,
    ChunkUnavailableError,
    FileEntry,
    FileMismatchError,
    Keyring,
    Manifest,
)
from gpucloud.registry.push import ProgressCallback, TransferProgress
from gpucloud.registry.store import ChunkStore, ManifestStore
from gpucloud.storage.direct import range_writer
from gpucloud.storage.local import fsync_path


@dataclass(frozen=True, slots=True)
class PullResult:
    manifest: Manifest
    path: Path
    bytes_total: int
    chunks_total: int


@dataclass(frozen=True, slots=True)
class _Task:
    relative: str
    target: Path
    chunk: ChunkRef
    # The file's buffered writes take turns here (`RangeWriter`).
    write_lock: threading.Lock


# Linux only (and not in typeshed).
_sync_file_range: Callable[[int, int, int, int], None] | None = getattr(os, "sync_file_range", None)
_SYNC_FILE_RANGE_WRITE: int = getattr(os, "SYNC_FILE_RANGE_WRITE", 0)


def _start_writeback(fd: int, chunk: ChunkRef) -> None:
    """Have the kernel start writing what the chunk left in the page cache (its partial blocks,
    or all of it where direct I/O is refused) now, without waiting for it, so the fsync that
    makes the version durable finds little left to write."""
    if chunk.size and _sync_file_range is not None:  # a size of 0 would mean "to the end"
        _sync_file_range(fd, chunk.offset, chunk.size, _SYNC_FILE_RANGE_WRITE)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkRetry:
    """How hard a pull tries one chunk before it fails closed.

    A broken transfer (connection reset, timeout, body cut off, 5xx: `ChunkTransferError`,
    `ConnectionError`, `TimeoutError`) gets `attempts` tries in all, `first_delay` apart and
    doubling up to `max_delay`. Bytes that arrived whole but do not hash to the chunk id get
    `refetches_after_mismatch` more tries, at once (a flipped bit in flight heals on a re-fetch;
    a corrupt stored chunk does not, and retrying it longer would only delay the refusal).
    """

    attempts: int = 4
    first_delay: float = 0.25
    max_delay: float = 4.0
    refetches_after_mismatch: int = 1
    sleep: Callable[[float], None] = time.sleep

    def delay(self, failures: int) -> float:
        return min(self.max_delay, self.first_delay * 2 ** (failures - 1))


DEFAULT_RETRY = ChunkRetry()
_BROKEN_TRANSFER = (ChunkTransferError, ConnectionError, TimeoutError)


class _BrokenTransfer(Exception):
    """One try's transfer broke after `received` bytes; `cause` says how."""

    def __init__(self, cause: Exception, received: int) -> None:
        super().__init__(str(cause))
        self.cause, self.received = cause, received


class _ChunkTries:
    """One chunk's failed tries, counted by kind, for the tenacity loop that `ChunkRetry` sets up:
    the two kinds have budgets of their own, and only broken transfers back off."""

    def __init__(self, policy: ChunkRetry) -> None:
        self.policy = policy
        self.broken = self.mismatched = 0
        self._last_broken = False

    def retrying(self) -> tenacity.Retrying:
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((_BrokenTransfer, ChunkError))
            & tenacity.retry_if_not_exception_type(ChunkMissingError),
            after=self._count,
            stop=self._stop,
            wait=self._wait,
            sleep=self._sleep,
            reraise=True,
        )

    def _count(self, state: tenacity.RetryCallState) -> None:
        self._last_broken = isinstance(state.outcome and state.outcome.exception(), _BrokenTransfer)
        if self._last_broken:
            self.broken += 1
        else:
            self.mismatched += 1

    def _stop(self, state: tenacity.RetryCallState) -> bool:
        if self._last_broken:
            return self.broken >= self.policy.attempts
        return self.mismatched > self.policy.refetches_after_mismatch

    def _wait(self, state: tenacity.RetryCallState) -> float:
        return self.policy.delay(self.broken) if self._last_broken else 0.0

    def _sleep(self, seconds: float) -> None:
        if seconds:  # a re-fetch after a mismatch goes at once
            self.policy.sleep(seconds)


def _mismatch_error(task: _Task, actual: str, received: int, version_chunks: set[str]) -> ChunkError:
    """The integrity error that bytes of the wrong hash point to."""
    chunk = task.chunk
    where: dict[str, Any] = {"chunk_id": chunk.id, "path": task.relative, "offset": chunk.offset}
    if actual != chunk.id and actual in version_chunks:
        return ChunkSwappedError(f"store served chunk {actual} of this version instead", **where)
    if received < chunk.size:
        return ChunkTruncatedError(f"store returned {received} of {chunk.size} bytes", **where)
    return ChunkCorruptedError(f"{received} bytes that hash to {actual}", **where)


def _fetch_once(store: ChunkStore, task: _Task, version_chunks: set[str], read_limit: int) -> int:
    """Copy one chunk into place; return the bytes written (always the manifest's size)."""
    chunk = task.chunk
    where: dict[str, Any] = {"chunk_id": chunk.id, "path": task.relative, "offset": chunk.offset}
    received = 0
    try:
        with range_writer(task.target, chunk.offset, chunk.size, task.write_lock) as writer:
            # Bytes past the chunk's size are hashed but not written, up to the version's largest
            # chunk, so a swapped-in bigger chunk is still recognised for what it is.
            for piece in store.stream(chunk.id):
                if received < chunk.size:
                    writer.write(piece[: chunk.size - received])
                received += len(piece)
                if received > read_limit:
                    raise ChunkCorruptedError(f"store returned more than {read_limit} bytes", **where)
            _start_writeback(writer.fd, chunk)
    except ChunkMissingError:
        raise ChunkMissingError("not in the store", **where) from None
    except ChunkCorruptedError as exc:
        if exc.actual_id is None:
            raise
        raise _mismatch_error(task, exc.actual_id, received, version_chunks) from None
    except _BROKEN_TRANSFER as exc:
        raise _BrokenTransfer(exc, received) from exc
    if received != chunk.size:
        raise ChunkCorruptedError(f"{received} bytes, manifest lists {chunk.size}", **where)
    return received


def _fetch(store: ChunkStore, task: _Task, version_chunks: set[str], read_limit: int, retry: ChunkRetry) -> int:
    """`_fetch_once`, tried again after a broken transfer or a mismatch, as `retry` allows.

    A retry rewrites the chunk's whole range, so what a failed try left behind is overwritten.
    """
    tries = _ChunkTries(retry)
    try:
        return tries.retrying()(_fetch_once, store, task, version_chunks, read_limit)
    except _BrokenTransfer as exc:
        raise _gave_up(task, exc, tries.broken, version_chunks) from exc.cause


def _gave_up(task: _Task, broken: _BrokenTransfer, tries: int, version_chunks: set[str]) -> ChunkError:
    # A source that hashed the bytes before the break (the API client does: the registry cuts
    # off a chunk that fails its own check) says what they were; otherwise they were never judged.
    actual = getattr(broken.cause, "actual_id", None)
    if actual is not None and actual != task.chunk.id:
        return _mismatch_error(task, actual, broken.received, version_chunks)
    chunk = task.chunk
    return ChunkUnavailableError(
        f"transfer failed {tries} times, giving up; last error: {broken.cause!r}",
        chunk_id=chunk.id,
        path=task.relative,
        offset=chunk.offset,
    )


def _check_sequence(relative: str, entry: FileEntry) -> None:
    problem = entry.tiling_error()
    if problem is not None:
        raise FileMismatchError(f"file {relative!r}: {problem}")


def _assemble(
    manifest: Manifest,
    staging: Path,
    store: ChunkStore,
    *,
    concurrency: int,
    progress: ProgressCallback | None,
    retry: ChunkRetry,
) -> None:
    tasks: list[_Task] = []
    for relative, entry in manifest.files.items():
        _check_sequence(relative, entry)
        target = staging / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as f:
            f.truncate(entry.size)
        write_lock = threading.Lock()
        tasks.extend(_Task(relative, target, chunk, write_lock) for chunk in entry.chunks)

    version_chunks = manifest.chunk_ids()
    read_limit = max((task.chunk.size for task in tasks), default=0)
    written = dict.fromkeys(manifest.files, 0)
    done = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        pending: dict[Future[int], _Task] = {
            pool.submit(_fetch, store, task, version_chunks, read_limit, retry): task for task in tasks
        }
        try:
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    task = pending.pop(future)
                    size = future.result()
                    written[task.relative] += size
                    done += size
                    if progress is not None:
                        progress(TransferProgress("download", done, manifest.total_size))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise

    for relative, entry in manifest.files.items():
        target = staging / relative
        if written[relative] != entry.size or target.stat().st_size != entry.size:
            raise FileMismatchError(
                f"file {relative!r}: assembled {written[relative]} bytes "
                f"({target.stat().st_size} on disk), manifest lists {entry.size}"
            )
        fsync_path(target)
    for directory, _, _ in os.walk(staging):
        fsync_path(Path(directory))


def pull(
    digest: str,
    dest: str | Path,
    *,
    chunk_store: ChunkStore,
    manifest_store: ManifestStore,
    keyring: Keyring,
    tenant: str,
    concurrency: int = 4,
    progress: ProgressCallback | None = None,
    retry: ChunkRetry = DEFAULT_RETRY,
) -> PullResult:
    """Materialise version `digest` at dest (which must not exist yet); see the module doc."""
    manifest = keyring.verify(manifest_store.get(digest), tenant=tenant)
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
    try:
        _assemble(manifest, staging, chunk_store, concurrency=concurrency, progress=progress, retry=retry)
        staging.chmod(0o755)  # mkdtemp made it private; the version is meant to be read by others
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_path(dest.parent)
    return PullResult(manifest, dest, manifest.total_size, manifest.chunk_count)
