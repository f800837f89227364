"""The node's weight cache: one root on local disk, made of three parts, and the housekeeping
that spans them.

Layout under the cache root:

    chunks/ab/<id>        loose chunks (`agent/chunk_store.py`: `NodeChunkStore`)
    manifests/<digest>    signed manifests of the versions this node has been asked to hold
    versions/<digest>/    a version's files, laid out from its chunks (`agent/version_files.py`)
    current, previous     the active version and the one before it (`agent/active_version.py`)
    tmp/                  temp files and staging directories, emptied when the cache opens

Integrity fails closed, as ARCHITECTURE.md "Weights" asks: every chunk is checked before it is
written and whenever it is read, every manifest's signature whenever it is loaded, and every
file of a version against its signed manifest before the version becomes current.

`ChunkCache` is the face the agent's services (the weights API, the peer service, the tenant
caches) and the simulator use: each method hands over to the part that does it. `discard` and
`prune` are its own: they remove versions and chunks with the pointers held still.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpucloud.agent.active_version import ActiveVersion, NoPreviousVersionError
from gpucloud.agent.chunk_store import NodeChunkStore
from gpucloud.agent.version_files import VersionFiles, remove_tree
from gpucloud.registry.chunking import MiB
from gpucloud.registry.manifest import ChunkRef, Keyring, Manifest, SignedManifest

__all__ = ["ChunkCache", "NoPreviousVersionError", "PruneResult"]


@dataclass(frozen=True, slots=True)
class PruneResult:
    versions_removed: list[str]
    chunks_removed: int
    bytes_removed: int


class ChunkCache:
    """One node's chunks and versions under `root`; safe to use from several threads.

    One instance per root: opening it clears tmp/, which another live instance may be writing to.
    """

    def __init__(self, root: str | Path, *, keyring: Keyring, tenant: str, read_size: int = 8 * MiB) -> None:
        self.root = Path(root)
        self.tenant = tenant
        tmp = self.root / "tmp"
        remove_tree(tmp)  # leftovers of writes a crash interrupted
        tmp.mkdir(parents=True, exist_ok=True)
        self.chunks = NodeChunkStore(self.root / "chunks", tmp=tmp)
        self.files = VersionFiles(
            self.root, chunks=self.chunks, keyring=keyring, tenant=tenant, tmp=tmp, read_size=read_size
        )
        self.pointers = ActiveVersion(self.root, verify=self.files.verify)
        self.chunks.reindex(self.files.regions)

    # Chunks ----------------------------------------------------------------------------------

    def chunk_path(self, chunk_id: str) -> Path:
        return self.chunks.path(chunk_id)

    def has(self, chunk_id: str) -> bool:
        return self.chunks.has(chunk_id)

    def held(self) -> set[str]:
        return self.chunks.held()

    def put(self, chunk_id: str, data: bytes | bytearray | memoryview) -> bool:
        return self.chunks.put(chunk_id, data)

    def read(self, chunk_id: str) -> bytes:
        return self.chunks.read(chunk_id)

    # Manifests and versions ------------------------------------------------------------------

    def add_manifest(self, signed: SignedManifest) -> Manifest:
        return self.files.add_manifest(signed)

    def manifest(self, digest: str) -> Manifest:
        return self.files.manifest(digest)

    def missing(self, digest: str) -> list[ChunkRef]:
        return self.files.missing(digest)

    def version_path(self, digest: str) -> Path:
        return self.files.path(digest)

    def versions(self) -> list[str]:
        return self.files.digests()

    def assemble(self, digest: str) -> Path:
        return self.files.assemble(digest)

    def verify(self, digest: str) -> Manifest:
        return self.files.verify(digest)

    # The active version ----------------------------------------------------------------------

    def active(self) -> str | None:
        return self.pointers.active()

    def previous(self) -> str | None:
        return self.pointers.previous()

    @property
    def current_path(self) -> Path:
        return self.pointers.current_path

    def activate(self, digest: str) -> Path:
        return self.pointers.activate(digest)

    def rollback(self) -> str:
        return self.pointers.rollback()

    def deactivate(self, digest: str) -> bool:
        return self.pointers.deactivate(digest)

    # Housekeeping ----------------------------------------------------------------------------

    def discard(self, digest: str) -> None:
        """Remove an assembled version that is neither current nor previous (e.g. one that failed
        verification), so the next `assemble` rebuilds it from verified chunks."""
        with self.pointers.switch:
            if digest in self.pointers.in_use():
                raise ValueError(f"version {digest} is in use on this node")
            self.files.remove(digest)
            self.chunks.reindex(self.files.regions)

    def prune(self, *, keep: Iterable[str] = ()) -> PruneResult:
        """Drop versions other than current, previous and `keep`, and every loose chunk that is
        either served from a kept version's files or needed by no kept version.

        `keep` must name the versions being prefetched, or their fresh chunks go too.
        """
        with self.pointers.switch:
            kept = self.pointers.in_use() | set(keep)
            removed = [d for d in self.files.digests() if d not in kept]
            for digest in removed:
                self.files.remove(digest)
            self.files.forget_manifests(keep=kept)
            needed = set().union(*(self.files.chunk_ids(d) for d in kept))
            chunks_removed, bytes_removed = self.chunks.prune_loose(self.files.regions, needed=needed)
        return PruneResult(versions_removed=removed, chunks_removed=chunks_removed, bytes_removed=bytes_removed)
