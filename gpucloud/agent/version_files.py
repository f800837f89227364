"""The versions a node holds: their signed manifests, and their files assembled and verified.

    manifests/<digest>    signed manifests of the versions this node has been asked to hold
    versions/<digest>/    a version's files, laid out from its chunks (files read-only)

A manifest's signature is checked against the tenant's keyring when it is added and every time
it is loaded. `assemble` lays a version out from chunks the node's `NodeChunkStore` checks as it
reads them, in a staging directory under tmp/ that is fsynced and renamed into versions/ in one
step. `verify` re-hashes every file of an assembled version against the signed manifest
(`ChunkCheck`, chunk by chunk) and refuses extra or missing files: what activation runs first.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path

from gpucloud.agent.chunk_store import NodeChunkStore, Region, add_regions, checked_digest
from gpucloud.registry.integrity import ChunkCheck
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


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class VersionFiles:
    """Manifests and assembled versions under `root`, built from the chunks of `chunks`."""

    def __init__(
        self, root: Path, *, chunks: NodeChunkStore, keyring: Keyring, tenant: str, tmp: Path, read_size: int
    ) -> None:
        self._chunks, self._keyring, self._tenant = chunks, keyring, tenant
        self._tmp, self._read_size = tmp, read_size
        self._manifests, self._versions = root / "manifests", root / "versions"
        for directory in (self._manifests, self._versions):
            directory.mkdir(parents=True, exist_ok=True)

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
            raw = (self._manifests / checked_digest(digest)).read_bytes()
        except FileNotFoundError:
            raise VersionNotFoundError(f"no manifest for version {digest} on this node") from None
        signed = SignedManifest.parse(raw, digest, source="kept on this node")
        return self._keyring.verify(signed, tenant=self._tenant)

    def chunk_ids(self, digest: str) -> set[str]:
        """The chunks the version lists; none if its manifest is gone or no longer verifies."""
        try:
            return self.manifest(digest).chunk_ids()
        except (VersionNotFoundError, IntegrityError):
            return set()

    def missing(self, digest: str) -> list[ChunkRef]:
        """The version's distinct chunks this node does not hold yet."""
        held, lacking = self._chunks.held(), dict[str, ChunkRef]()
        for entry in self.manifest(digest).files.values():
            for chunk in entry.chunks:
                if chunk.id not in held:
                    lacking.setdefault(chunk.id, chunk)
        return list(lacking.values())

    def forget_manifests(self, *, keep: Iterable[str]) -> None:
        kept = set(keep)
        for path in self._manifests.iterdir():
            if path.name not in kept:
                path.unlink(missing_ok=True)

    # Versions --------------------------------------------------------------------------------

    def path(self, digest: str) -> Path:
        return self._versions / checked_digest(digest)

    def digests(self) -> list[str]:
        """Assembled versions on disk."""
        return sorted(p.name for p in self._versions.iterdir() if is_digest(p.name))

    def assemble(self, digest: str) -> Path:
        """Lay the version's files out from verified cached chunks (idempotent); see module doc."""
        manifest, target = self.manifest(digest), self.path(digest)
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
                        out.write(self._chunks.read(chunk.id))
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
                remove_tree(staging)  # another thread assembled it first; theirs is as good
            fsync_path(self._versions)
        except BaseException:
            remove_tree(staging)
            raise
        self._chunks.add_regions(target, manifest)
        return target

    def verify(self, digest: str) -> Manifest:
        """Re-hash every file of the assembled version; raise an IntegrityError on any mismatch."""
        manifest, root = self.manifest(digest), self.path(digest)
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

    def remove(self, digest: str) -> None:
        """Delete an assembled version (gone in one step: renamed into tmp/, then deleted)."""
        path = self.path(digest)
        if path.is_dir():
            trash = self._tmp / f"{digest[:16]}.removed.{uuid.uuid4().hex}"
            os.rename(path, trash)
            remove_tree(trash)

    def regions(self) -> dict[str, Region]:
        """Where each chunk of every assembled version with a verifiable manifest sits."""
        regions: dict[str, Region] = {}
        for digest in self.digests():
            try:
                manifest = self.manifest(digest)
            except (VersionNotFoundError, IntegrityError):
                continue  # cannot say what is in it, so it serves nothing
            add_regions(regions, self.path(digest), manifest)
        return regions
