"""Pull a model version into a directory, failing closed.

The manifest is fetched by digest (the store checks it still hashes to that digest) and its
signature verified against the tenant's keyring before a single chunk is fetched. Files are
assembled in a temp directory next to the destination; every chunk is hashed while it is written
and its size counted, every file's chunk sequence and total size checked, everything fsynced,
and only then is the temp directory renamed onto the destination in one step. Any failure
removes the temp directory, so the destination holds a complete verified version or nothing.

What failed is reported as a specific `IntegrityError`: `ChunkMissingError`,
`ChunkCorruptedError`, `ChunkTruncatedError`, `ChunkSwappedError` (the store served another chunk
of the same version), `FileMismatchError`, `ManifestTamperedError`, `BadSignatureError` or
`UnknownKeyError`, each naming the file, chunk id and offset (or the version and key) involved.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from gpucloud.registry.manifest import (
    ChunkCorruptedError,
    ChunkMissingError,
    ChunkRef,
    ChunkSwappedError,
    ChunkTruncatedError,
    FileEntry,
    FileMismatchError,
    Keyring,
    Manifest,
)
from gpucloud.registry.push import ProgressCallback, TransferProgress
from gpucloud.registry.store import ChunkStore, ManifestStore


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


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _fetch(store: ChunkStore, task: _Task, version_chunks: set[str], read_limit: int) -> int:
    """Copy one chunk into place; return the bytes written (always the manifest's size)."""
    chunk = task.chunk
    where = {"chunk_id": chunk.id, "path": task.relative, "offset": chunk.offset}
    received = 0
    fd = os.open(task.target, os.O_WRONLY)
    try:
        # Bytes past the chunk's size are hashed but not written, up to the version's largest
        # chunk, so a swapped-in bigger chunk is still recognised for what it is.
        for piece in store.stream(chunk.id):
            if received < chunk.size:
                _write_all(fd, piece[: chunk.size - received], chunk.offset + received)
            received += len(piece)
            if received > read_limit:
                raise ChunkCorruptedError(f"store returned more than {read_limit} bytes", **where)
    except ChunkMissingError:
        raise ChunkMissingError("not in the store", **where) from None
    except ChunkCorruptedError as exc:
        actual = exc.actual_id
        if actual is None:
            raise
        if actual != chunk.id and actual in version_chunks:
            raise ChunkSwappedError(
                f"store served chunk {actual} of this version instead", **where
            ) from None
        if received < chunk.size:
            raise ChunkTruncatedError(
                f"store returned {received} of {chunk.size} bytes", **where
            ) from None
        raise ChunkCorruptedError(f"{received} bytes that hash to {actual}", **where) from None
    finally:
        os.close(fd)
    if received != chunk.size:
        raise ChunkCorruptedError(f"{received} bytes, manifest lists {chunk.size}", **where)
    return received


def _check_sequence(relative: str, entry: FileEntry) -> None:
    position = 0
    for chunk in entry.chunks:
        if chunk.offset != position:
            raise FileMismatchError(
                f"file {relative!r}: chunk {chunk.id} at {chunk.offset}, expected {position}"
            )
        position += chunk.size
    if position != entry.size:
        raise FileMismatchError(f"file {relative!r}: chunks cover {position} of {entry.size} bytes")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _assemble(
    manifest: Manifest,
    staging: Path,
    store: ChunkStore,
    *,
    concurrency: int,
    progress: ProgressCallback | None,
) -> None:
    tasks = []
    for relative, entry in manifest.files.items():
        _check_sequence(relative, entry)
        target = staging / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as f:
            f.truncate(entry.size)
        tasks.extend(_Task(relative, target, chunk) for chunk in entry.chunks)

    version_chunks = manifest.chunk_ids()
    read_limit = max((task.chunk.size for task in tasks), default=0)
    written = dict.fromkeys(manifest.files, 0)
    done = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        pending: dict[Future[int], _Task] = {
            pool.submit(_fetch, store, task, version_chunks, read_limit): task for task in tasks
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
        _fsync_path(target)
    for directory, _, _ in os.walk(staging):
        _fsync_path(Path(directory))


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
) -> PullResult:
    """Materialise version `digest` at dest (which must not exist yet); see the module doc."""
    manifest = keyring.verify(manifest_store.get(digest), tenant=tenant)
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
    try:
        _assemble(manifest, staging, chunk_store, concurrency=concurrency, progress=progress)
        staging.chmod(0o755)  # mkdtemp made it private; the version is meant to be read by others
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_path(dest.parent)
    return PullResult(manifest, dest, manifest.total_size, manifest.chunk_count)
