"""The node's weight cache: content-addressed chunks on local disk, assembled versions, activation.

Layout under the cache root:

    chunks/ab/<id>        loose chunks, each named by the BLAKE3 of its bytes
    manifests/<digest>    signed manifests of the versions this node has been asked to hold
    versions/<digest>/    a version's files, laid out from its chunks (files read-only)
    current -> versions/<digest>    the active version: what a model server loads
    previous -> versions/<digest>   the version before it, kept on disk for rollback
    tmp/                  temp files and staging directories, emptied when the cache opens

Integrity fails closed, as ARCHITECTURE.md "Weights" asks. A chunk is hashed before it is
written (`put` refuses bytes that do not hash to the id), and hashed again every time it is read
(`read`), which is what the peer service serves and what assembly copies: a copy that rotted on
disk is dropped, never served. A manifest's signature is checked against the tenant's keyring
when it is added and every time it is loaded. `activate` re-hashes every file of the version
against the signed manifest (and refuses extra or missing files) before it switches.

Writes are atomic: a chunk goes to a temp file and is renamed into place; a version is
assembled in a staging directory, fsynced and renamed into versions/; `current` and `previous`
are symlinks replaced with `os.replace`, so a reader opening `current/<file>` sees the old
version or the new one, never a mix. Loose chunks are not fsynced: a chunk torn by a crash fails
its hash on the next read and is dropped and fetched again, which costs less than an fsync on
every chunk of every fan-out.

Once a version is assembled, its files hold every one of its chunks, so the cache also serves
chunks from there (a region: file, offset, size) and `prune` deletes the loose copies: a node
keeps one copy of a version on disk, not two, and still seeds it to its peers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpucloud.registry.chunking import MiB
from gpucloud.registry.integrity import ChunkCheck, ChunkDigestMismatchError, verify_chunk
from gpucloud.registry.manifest import (
    ChunkMissingError,
    ChunkRef,
    FileEntry,
    FileMismatchError,
    IntegrityError,
    Keyring,
    Manifest,
    SignedManifest,
    VersionNotFoundError,
    is_digest,
)
from gpucloud.storage.local import fsync_path

CURRENT = "current"
PREVIOUS = "previous"


class NoPreviousVersionError(LookupError):
    """Rollback was asked for, but no previous version is kept."""


@dataclass(frozen=True, slots=True)
class _Region:
    """A chunk inside an assembled version's file."""

    path: Path
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class PruneResult:
    versions_removed: list[str]
    chunks_removed: int
    bytes_removed: int


def _checked(digest: str) -> str:
    if not is_digest(digest):
        raise ValueError(f"{digest!r} is not a BLAKE3 digest (64 lowercase hex digits)")
    return digest


def _pread(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        parts, remaining = [], size
        while remaining and (part := os.pread(f.fileno(), remaining, offset + size - remaining)):
            parts.append(part)
            remaining -= len(part)
    return b"".join(parts)  # short if the file was truncated: the hash check then fails


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class ChunkCache:
    """One node's chunks and versions under `root`; safe to use from several threads.

    One instance per root: opening it clears tmp/, which another live instance may be writing to.
    """

    def __init__(self, root: str | Path, *, keyring: Keyring, tenant: str, read_size: int = 8 * MiB) -> None:
        self.root = Path(root)
        self._keyring, self._tenant, self._read_size = keyring, tenant, read_size
        self.tenant = tenant
        self._chunks, self._tmp = self.root / "chunks", self.root / "tmp"
        self._manifests, self._versions = self.root / "manifests", self.root / "versions"
        _remove_tree(self._tmp)  # leftovers of writes a crash interrupted
        for directory in (self._chunks, self._tmp, self._manifests, self._versions):
            directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards the two indexes below
        self._switch = threading.Lock()  # serialises activate / rollback / prune
        self._loose = {p.name for p in self._chunks.glob("*/*") if is_digest(p.name)}
        self._regions = self._build_regions()

    # Chunks ----------------------------------------------------------------------------------

    def chunk_path(self, chunk_id: str) -> Path:
        return self._chunks / _checked(chunk_id)[:2] / chunk_id

    def has(self, chunk_id: str) -> bool:
        with self._lock:
            return chunk_id in self._loose or chunk_id in self._regions

    def held(self) -> set[str]:
        with self._lock:
            return self._loose | self._regions.keys()

    def put(self, chunk_id: str, data: bytes | bytearray | memoryview) -> bool:
        """Store verified bytes under chunk_id; False if already held. Bad bytes raise, unwritten."""
        path = self.chunk_path(chunk_id)
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
        """The chunk's bytes, hashed just now. A copy that fails its hash is dropped, not returned."""
        _checked(chunk_id)
        # Two rounds: `prune` may delete a loose copy between our lookup and our open, and the
        # second round then finds the chunk in its version's file.
        for _ in range(2):
            with self._lock:
                loose = chunk_id in self._loose
                region = None if loose else self._regions.get(chunk_id)
            if not loose and region is None:
                break
            try:
                if region is None:
                    data = self.chunk_path(chunk_id).read_bytes()
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

    def _drop(self, chunk_id: str, region: _Region | None) -> None:
        with self._lock:
            if region is None:
                self._loose.discard(chunk_id)
            elif self._regions.get(chunk_id) == region:
                del self._regions[chunk_id]  # the version file is left for `verify` to condemn
        if region is None:
            self.chunk_path(chunk_id).unlink(missing_ok=True)

    # Manifests -------------------------------------------------------------------------------

    def add_manifest(self, signed: SignedManifest) -> Manifest:
        """Keep a version's signed manifest once a key the tenant trusts has signed it."""
        manifest = self._keyring.verify(signed, tenant=self._tenant)
        path = self._manifests / signed.digest
        if not path.is_file():
            fd, tmp_name = tempfile.mkstemp(dir=self._tmp, prefix="manifest.")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(signed.model_dump_json().encode())
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp_name, path)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
        return manifest

    def manifest(self, digest: str) -> Manifest:
        """The version's manifest, checked to hash to digest and verified against the keyring."""
        try:
            raw = (self._manifests / _checked(digest)).read_bytes()
        except FileNotFoundError:
            raise VersionNotFoundError(f"no manifest for version {digest} on this node") from None
        signed = SignedManifest.parse(raw, digest, source="kept on this node")
        return self._keyring.verify(signed, tenant=self._tenant)

    def missing(self, digest: str) -> list[ChunkRef]:
        """The version's distinct chunks this node does not hold yet."""
        held, lacking = self.held(), dict[str, ChunkRef]()
        for entry in self.manifest(digest).files.values():
            for chunk in entry.chunks:
                if chunk.id not in held:
                    lacking.setdefault(chunk.id, chunk)
        return list(lacking.values())

    # Versions --------------------------------------------------------------------------------

    def version_path(self, digest: str) -> Path:
        return self._versions / _checked(digest)

    def versions(self) -> list[str]:
        """Assembled versions on disk."""
        return sorted(p.name for p in self._versions.iterdir() if is_digest(p.name))

    def assemble(self, digest: str) -> Path:
        """Lay the version's files out from verified cached chunks (idempotent); see module doc."""
        manifest, target = self.manifest(digest), self.version_path(digest)
        if target.is_dir():
            return target
        if lacking := self.missing(digest):
            raise ChunkMissingError(
                f"{len(lacking)} chunks of version {digest} are not in the cache", chunk_id=lacking[0].id
            )
        staging = Path(tempfile.mkdtemp(dir=self._tmp, prefix=f"{digest[:16]}."))
        try:
            for relative, entry in manifest.files.items():
                path = staging / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "xb", buffering=0) as out:
                    for chunk in entry.chunks:
                        out.write(self.read(chunk.id))
                    os.fsync(out.fileno())
                path.chmod(0o444)  # a loader that writes into a version would corrupt it for peers
            staging.chmod(0o755)
            for directory, _, _ in os.walk(staging):
                fsync_path(Path(directory))
            try:
                os.rename(staging, target)
            except OSError:
                if not target.is_dir():
                    raise
                _remove_tree(staging)  # another thread assembled it first; theirs is as good
            fsync_path(self._versions)
        except BaseException:
            _remove_tree(staging)
            raise
        with self._lock:
            self._add_regions(target, manifest)
        return target

    def verify(self, digest: str) -> Manifest:
        """Re-hash every file of the assembled version; raise an IntegrityError on any mismatch."""
        manifest, root = self.manifest(digest), self.version_path(digest)
        if not root.is_dir():
            raise VersionNotFoundError(f"version {digest} is not assembled on this node")
        found: set[str] = set()
        for directory, subdirs, names in os.walk(root):
            for name in subdirs + names:
                path = Path(directory, name)
                if path.is_symlink() or not (path.is_dir() or path.is_file()):
                    raise FileMismatchError(f"version {digest}: {path} is not a regular file")
            found.update(Path(directory, n).relative_to(root).as_posix() for n in names)
        if extra := found - manifest.files.keys():
            raise FileMismatchError(f"version {digest}: files not in the manifest: {sorted(extra)}")
        if absent := manifest.files.keys() - found:
            raise FileMismatchError(f"version {digest}: files missing: {sorted(absent)}")
        for relative, entry in manifest.files.items():
            self._verify_file(root / relative, relative, entry)
        return manifest

    def _verify_file(self, path: Path, relative: str, entry: FileEntry) -> None:
        with open(path, "rb", buffering=0) as f:
            if (size := os.fstat(f.fileno()).st_size) != entry.size:
                raise FileMismatchError(f"file {relative!r}: {size} bytes, manifest lists {entry.size}")
            buffer = memoryview(bytearray(min(self._read_size, max(entry.size, 1))))
            for chunk in entry.chunks:
                check, remaining = ChunkCheck(chunk.id, size_hint=chunk.size), chunk.size
                while remaining:
                    count = f.readinto(buffer[: min(remaining, len(buffer))])
                    if not count:
                        break
                    check.update(buffer[:count])
                    remaining -= count
                check.verify(source="bytes on disk", path=relative, offset=chunk.offset)

    def active(self) -> str | None:
        return self._target(CURRENT)

    def previous(self) -> str | None:
        return self._target(PREVIOUS)

    @property
    def current_path(self) -> Path:
        """Where a model server loads the active version from."""
        return self.root / CURRENT

    def activate(self, digest: str) -> Path:
        """Verify the version, then make it current; the version it replaces becomes previous."""
        with self._switch:
            self.verify(digest)
            current = self.active()
            if current == digest:
                return self.current_path
            # previous first: a crash between the two switches leaves previous == current, which
            # a rollback turns into a no-op, never into an unknown version.
            if current is not None:
                self._point(PREVIOUS, current)
            self._point(CURRENT, digest)
        return self.current_path

    def rollback(self) -> str:
        """Make the previous version current again (verified first); return its digest."""
        with self._switch:
            previous = self.previous()
            if previous is None:
                raise NoPreviousVersionError("no previous version is kept on this node")
            self.verify(previous)
            self._point(CURRENT, previous)
            (self.root / PREVIOUS).unlink()
            fsync_path(self.root)
        return previous

    def deactivate(self, digest: str) -> bool:
        """Stop serving `digest` where no previous version is kept to go back to (the node ran
        nothing before it): `current` goes, the files stay. False if `digest` is not current."""
        with self._switch:
            if self.active() != digest:
                return False
            (self.root / CURRENT).unlink()
            fsync_path(self.root)
        return True

    def _target(self, name: str) -> str | None:
        try:
            return Path(os.readlink(self.root / name)).name
        except FileNotFoundError:
            return None

    def _point(self, name: str, digest: str) -> None:
        link = self.root / f".{name}.{uuid.uuid4().hex}"
        os.symlink(f"versions/{digest}", link)  # relative, so the cache root may move
        os.replace(link, self.root / name)
        fsync_path(self.root)

    # Housekeeping ----------------------------------------------------------------------------

    def discard(self, digest: str) -> None:
        """Remove an assembled version that is neither current nor previous (e.g. one that failed
        verification), so the next `assemble` rebuilds it from verified chunks."""
        with self._switch:
            if digest in (self.active(), self.previous()):
                raise ValueError(f"version {digest} is in use on this node")
            self._remove_version(digest)
            with self._lock:
                self._regions = self._build_regions()

    def prune(self, *, keep: Iterable[str] = ()) -> PruneResult:
        """Drop versions other than current, previous and `keep`, and every loose chunk that is
        either served from a kept version's files or needed by no kept version.

        `keep` must name the versions being prefetched, or their fresh chunks go too.
        """
        with self._switch:
            kept = {d for d in (self.active(), self.previous(), *keep) if d is not None}
            removed = [d for d in self.versions() if d not in kept]
            for digest in removed:
                self._remove_version(digest)
            for path in self._manifests.iterdir():
                if path.name not in kept:
                    path.unlink(missing_ok=True)
            needed = set().union(*(self._manifest_ids(d) for d in kept))
            with self._lock:
                self._regions = self._build_regions()
                doomed = {c for c in self._loose if c in self._regions or c not in needed}
                self._loose -= doomed
            freed = 0
            for chunk_id in doomed:
                path = self.chunk_path(chunk_id)
                try:
                    freed += path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    continue
        return PruneResult(versions_removed=removed, chunks_removed=len(doomed), bytes_removed=freed)

    def _remove_version(self, digest: str) -> None:
        path = self.version_path(digest)
        if path.is_dir():
            trash = self._tmp / f"{digest[:16]}.removed.{uuid.uuid4().hex}"
            os.rename(path, trash)  # vanish in one step, then delete at leisure
            _remove_tree(trash)

    def _manifest_ids(self, digest: str) -> set[str]:
        try:
            return self.manifest(digest).chunk_ids()
        except (VersionNotFoundError, IntegrityError):
            return set()

    def _build_regions(self) -> dict[str, _Region]:
        regions: dict[str, _Region] = {}
        for digest in self.versions():
            try:
                manifest = self.manifest(digest)
            except (VersionNotFoundError, IntegrityError):
                continue  # cannot say what is in it, so it serves nothing
            self._add_regions(self.version_path(digest), manifest, regions)
        return regions

    def _add_regions(self, root: Path, manifest: Manifest, regions: dict[str, _Region] | None = None) -> None:
        regions = self._regions if regions is None else regions
        for relative, entry in manifest.files.items():
            for chunk in entry.chunks:
                regions.setdefault(chunk.id, _Region(root / relative, chunk.offset, chunk.size))
