"""The node's chunks: loose copies on local disk, and regions of assembled versions' files.

    chunks/ab/<id>        loose chunks, each named by the BLAKE3 of its bytes

A chunk is checked (`verify_chunk`) before it is written (`put` refuses bytes that do not hash to
the id), and again every time it is read (`read`), which is what the peer service serves and
what assembly copies: a copy that rotted on disk is dropped, never served. A chunk goes to a
temp file and is renamed into place; loose chunks are not fsynced: a chunk torn by a crash fails
its check on the next read and is dropped and fetched again, which costs less than an fsync on
every chunk of every fan-out.

Once a version is assembled, its files hold every one of its chunks, so the store also serves
chunks from there (a `Region`: file, offset, size; the index is rebuilt by whoever knows the
versions, `agent/version_files.py`), and `prune_loose` deletes the loose copies: a node keeps
one copy of a version on disk, not two, and still seeds it to its peers.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpucloud.registry.integrity import ChunkDigestMismatchError, verify_chunk
from gpucloud.registry.manifest import ChunkMissingError, Manifest, is_digest


@dataclass(frozen=True, slots=True)
class Region:
    """A chunk inside an assembled version's file."""

    path: Path
    offset: int
    size: int


def add_regions(regions: dict[str, Region], root: Path, manifest: Manifest) -> None:
    """Index every chunk of the version assembled at root (the first copy found is kept)."""
    for relative, entry in manifest.files.items():
        for chunk in entry.chunks:
            regions.setdefault(chunk.id, Region(root / relative, chunk.offset, chunk.size))


def checked_digest(digest: str) -> str:
    if not is_digest(digest):
        raise ValueError(f"{digest!r} is not a BLAKE3 digest (64 lowercase hex digits)")
    return digest


def _pread(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        parts, remaining = [], size
        while remaining and (part := os.pread(f.fileno(), remaining, offset + size - remaining)):
            parts.append(part)
            remaining -= len(part)
    return b"".join(parts)  # short if the file was truncated: the check then fails


class NodeChunkStore:
    """Verified chunks under `root`, loose or in assembled versions; safe to use from several threads."""

    def __init__(self, root: Path, *, tmp: Path) -> None:
        self.root, self._tmp = root, tmp
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards the two indexes below
        self._loose = {p.name for p in root.glob("*/*") if is_digest(p.name)}
        self._regions: dict[str, Region] = {}

    def path(self, chunk_id: str) -> Path:
        return self.root / checked_digest(chunk_id)[:2] / chunk_id

    def has(self, chunk_id: str) -> bool:
        with self._lock:
            return chunk_id in self._loose or chunk_id in self._regions

    def held(self) -> set[str]:
        with self._lock:
            return self._loose | self._regions.keys()

    def put(self, chunk_id: str, data: bytes | bytearray | memoryview) -> bool:
        """Store verified bytes under chunk_id; False if already held. Bad bytes raise, unwritten."""
        path = self.path(chunk_id)
        verify_chunk(chunk_id, data, source="refused bytes that")
        if self.has(chunk_id):
            return False
        path.parent.mkdir(exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self._tmp, prefix=f"{chunk_id[:16]}.")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        with self._lock:
            self._loose.add(chunk_id)
        return True

    def read(self, chunk_id: str) -> bytes:
        """The chunk's bytes, checked just now. A copy that fails its check is dropped, not returned."""
        checked_digest(chunk_id)
        # Two rounds: `prune_loose` may delete a loose copy between our lookup and our open, and
        # the second round then finds the chunk in its version's file.
        for _ in range(2):
            with self._lock:
                loose = chunk_id in self._loose
                region = None if loose else self._regions.get(chunk_id)
            if not loose and region is None:
                break
            try:
                if region is None:
                    data = self.path(chunk_id).read_bytes()
                else:
                    data = _pread(region.path, region.offset, region.size)
            except FileNotFoundError:
                self._drop(chunk_id, region)
                continue
            where = "loose copy" if region is None else f"copy in {region.path}@{region.offset}"
            try:
                verify_chunk(chunk_id, data, source=f"dropped the cached {where}: its bytes")
            except ChunkDigestMismatchError:
                self._drop(chunk_id, region)
                raise
            return data
        raise ChunkMissingError("not in the cache", chunk_id=chunk_id)

    def _drop(self, chunk_id: str, region: Region | None) -> None:
        with self._lock:
            if region is None:
                self._loose.discard(chunk_id)
            elif self._regions.get(chunk_id) == region:
                del self._regions[chunk_id]  # the version file is left for `verify` to condemn
        if region is None:
            self.path(chunk_id).unlink(missing_ok=True)

    def add_regions(self, root: Path, manifest: Manifest) -> None:
        """Serve the chunks of the version just assembled at root from its files too."""
        with self._lock:
            add_regions(self._regions, root, manifest)

    def reindex(self, regions: Callable[[], dict[str, Region]]) -> None:
        """Serve chunks from the regions `regions()` finds, built under the lock, so an assembly
        that finishes meanwhile is either in them or added after them."""
        with self._lock:
            self._regions = regions()

    def prune_loose(self, regions: Callable[[], dict[str, Region]], *, needed: set[str]) -> tuple[int, int]:
        """Reindex, then delete every loose chunk that a region serves or no kept version needs;
        return how many chunks and bytes went."""
        with self._lock:
            self._regions = regions()
            doomed = {c for c in self._loose if c in self._regions or c not in needed}
            self._loose -= doomed
        freed = 0
        for chunk_id in doomed:
            path = self.path(chunk_id)
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
        return len(doomed), freed
