"""The registry's stores, on the one object store (`gpucloud.storage.objects`).

`ChunkStore` is content-addressed: a chunk is stored under its BLAKE3 id (key
`<prefix>chunks/ab/cd/<id>`), and the bytes are checked against that id twice: on the way in (a
put whose bytes do not hash to the id raises and leaves nothing behind: the object store runs
the check before the object becomes visible) and on the way out (`stream` hashes while it
yields and raises after the last piece if the bytes were not the chunk). Readers therefore
consume a stream to its end before they trust it.

`ManifestStore` keeps the small records of the registry (signed manifests by version digest,
signed evaluation records per version, push leases, GC runs) under `<prefix>`; it checks on
every read that a manifest still hashes to the digest it is stored under.

`LocalChunkStore` and friends build the same stores over a directory or a bucket of their own,
for tools and tests that hold no settings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from gpucloud.registry.chunking import MiB
from gpucloud.registry.integrity import ChunkCheck
from gpucloud.registry.manifest import (
    ChunkMissingError,
    ChunkTransferError,
    ManifestTamperedError,
    PushLease,
    SignedEvaluation,
    SignedManifest,
    VersionNotFoundError,
    is_digest,
)
from gpucloud.storage.local import LocalObjectStore
from gpucloud.storage.objects import ObjectMissingError, ObjectStore, ObjectTransferError
from gpucloud.storage.s3 import S3ObjectStore


class Readable(Protocol):
    """A source of bytes read to EOF (a file, a file region, an upload's body); a piece returned
    may be a view that the next `read` overwrites (the store uses each before it reads on)."""

    def read(self, size: int = -1, /) -> bytes | memoryview | None: ...


class ChunkSource(Protocol):
    """What serving a chunk needs of a store: its verified bytes (a `ChunkStore`, or a view
    over several, as the tracker's origin is)."""

    def get(self, chunk_id: str) -> bytes: ...


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    id: str
    size: int
    modified: datetime


def _checked_id(chunk_id: str) -> str:
    if not is_digest(chunk_id):
        raise ValueError(f"{chunk_id!r} is not a chunk id (64 lowercase hex digits)")
    return chunk_id


def _prefix(prefix: str) -> str:
    return f"{prefix.strip('/')}/" if prefix.strip("/") else ""


class ChunkStore:
    """Content-addressed chunks. Every method is safe to call from several threads."""

    def __init__(self, objects: ObjectStore, *, prefix: str = "", read_size: int = MiB) -> None:
        self.objects = objects
        self._prefix = _prefix(prefix) + "chunks/"
        self._read_size = read_size

    def key(self, chunk_id: str) -> str:
        _checked_id(chunk_id)
        return f"{self._prefix}{chunk_id[:2]}/{chunk_id[2:4]}/{chunk_id}"

    def has(self, chunk_id: str) -> bool:
        return self.objects.exists(self.key(chunk_id))

    def put(self, chunk_id: str, data: bytes | bytearray | memoryview | Readable) -> bool:
        """Store the bytes (read to EOF) under chunk_id; False if it was already there."""
        key = self.key(chunk_id)
        if self.objects.exists(key):
            return False
        check = _serial_check(chunk_id)

        def pieces() -> Iterator[bytes | memoryview]:
            if isinstance(data, (bytes, bytearray, memoryview)):
                check.update(data)
                yield bytes(data)
                return
            while piece := data.read(self._read_size):
                check.update(piece)
                yield piece

        self.objects.put_stream(key, pieces(), check=lambda: check.verify(source="refused to store bytes that"))
        return True

    def stream(self, chunk_id: str) -> Iterator[bytes]:
        """The chunk in bounded pieces; `ChunkCorruptedError` after a bad last piece,
        `ChunkMissingError` if absent, `ChunkTransferError` if the store failed on the way."""
        try:
            pieces = self.objects.read_stream(self.key(chunk_id), piece_size=self._read_size)
        except ObjectMissingError:
            raise ChunkMissingError("not in the store", chunk_id=chunk_id) from None
        except ObjectTransferError as exc:
            raise ChunkTransferError(str(exc), chunk_id=chunk_id) from exc
        return _verified(chunk_id, pieces)

    def get(self, chunk_id: str) -> bytes:
        return b"".join(self.stream(chunk_id))

    def stat(self, chunk_id: str) -> ChunkInfo:
        try:
            info = self.objects.stat(self.key(chunk_id))
        except ObjectMissingError:
            raise ChunkMissingError("not in the store", chunk_id=chunk_id) from None
        return ChunkInfo(chunk_id, info.size, info.modified)

    def list(self) -> Iterator[ChunkInfo]:
        for info in self.objects.scan(self._prefix):
            name = info.key.rsplit("/", 1)[-1]
            if is_digest(name):
                yield ChunkInfo(name, info.size, info.modified)

    def delete(self, chunk_id: str) -> None:
        """Remove the chunk; removing an absent chunk is not an error."""
        self.objects.delete(self.key(chunk_id))

    def abort_incomplete(self, *, older_than: datetime) -> int:
        """Clean up writes abandoned before older_than (temp files, multipart uploads)."""
        return self.objects.abort_incomplete(prefix=self._prefix, older_than=older_than)


def _serial_check(chunk_id: str) -> ChunkCheck:
    """One thread per hash: a store serves many chunks at once (an API's uploads and downloads), so
    spreading each over every core only adds wake-ups between hashing threads on busy cores."""
    return ChunkCheck(chunk_id, size_hint=1)


def _verified(chunk_id: str, pieces: Iterator[bytes]) -> Iterator[bytes]:
    check = _serial_check(chunk_id)
    try:
        for piece in pieces:
            check.update(piece)
            yield piece
    except ObjectTransferError as exc:
        raise ChunkTransferError(str(exc), chunk_id=chunk_id) from exc
    check.verify(source="stored bytes")


class ManifestStore:
    """Signed manifests by version digest, signed evaluations per version, and push leases."""

    def __init__(self, objects: ObjectStore, *, prefix: str = "") -> None:
        self.objects = objects
        self._prefix = _prefix(prefix)

    def _write(self, name: str, data: bytes) -> None:
        self.objects.put(self._prefix + name, data)

    def _read(self, name: str) -> bytes:
        return self.objects.get(self._prefix + name)

    def _names(self, under: str) -> Iterator[str]:
        for key in self.objects.list_keys(self._prefix + under):
            if key.endswith(".json"):
                yield key[len(self._prefix) :]

    def _remove(self, name: str) -> None:
        self.objects.delete(self._prefix + name)

    def put(self, signed: SignedManifest) -> str:
        """Store the signed manifest under its digest; an intact one already there is kept."""
        digest = signed.digest
        try:
            self.get(digest)
            return digest  # versions are immutable: a second signature does not replace the first
        except (VersionNotFoundError, ManifestTamperedError):
            pass
        self._write(f"manifests/{digest}.json", signed.model_dump_json().encode())
        return digest

    def get(self, digest: str) -> SignedManifest:
        """The signed manifest stored under digest, checked to still hash to it (not verified)."""
        _checked_id(digest)
        try:
            raw = self._read(f"manifests/{digest}.json")
        except ObjectMissingError:
            raise VersionNotFoundError(f"no manifest for version {digest}") from None
        signed = SignedManifest.parse(raw, digest, source="stored")
        return signed

    def uri(self, digest: str) -> str:
        """Where the signed manifest of a version lives, recorded on its row for operators."""
        return self.objects.uri(f"{self._prefix}manifests/{_checked_id(digest)}.json")

    def digests(self) -> Iterator[str]:
        for name in self._names("manifests/"):
            digest = name.rsplit("/", 1)[-1].removesuffix(".json")
            if is_digest(digest):
                yield digest

    def delete(self, digest: str) -> None:
        self._remove(f"manifests/{_checked_id(digest)}.json")

    def add_evaluation(self, signed: SignedEvaluation) -> str:
        record = signed.record
        self._write(f"evaluations/{record.version}/{record.digest}.json", signed.model_dump_json().encode())
        return record.digest

    def evaluations(self, digest: str) -> list[SignedEvaluation]:
        """The version's stored evaluations, each checked to hash to its key (not verified)."""
        found = []
        for name in self._names(f"evaluations/{_checked_id(digest)}/"):
            try:
                signed = SignedEvaluation.model_validate_json(self._read(name))
            except ValidationError as exc:
                raise ManifestTamperedError(f"evaluation record {name} is unreadable: {exc}") from None
            if name != f"evaluations/{digest}/{signed.record.digest}.json":
                raise ManifestTamperedError(f"evaluation record {name} does not hash to its name")
            found.append(signed)
        return found

    def put_lease(self, lease: PushLease) -> None:
        self._write(f"leases/{lease.lease_id}.json", lease.model_dump_json().encode())

    def leases(self) -> list[PushLease]:
        leases = []
        for name in self._names("leases/"):
            try:
                leases.append(PushLease.model_validate_json(self._read(name)))
            except ObjectMissingError:
                continue  # the push finished between listing and reading
        return leases

    def delete_lease(self, lease_id: str) -> None:
        self._remove(f"leases/{lease_id}.json")

    def put_gc_run(self, run_id: str, started_at: datetime) -> None:
        """Mark a deleting GC run as started (see `gpucloud.registry.gc.holding`)."""
        self._write(f"gc-runs/{run_id}.json", started_at.isoformat().encode())

    def gc_runs(self) -> list[datetime]:
        """When each GC run still marked as running started."""
        started = []
        for name in self._names("gc-runs/"):
            try:
                started.append(datetime.fromisoformat(self._read(name).decode()))
            except ObjectMissingError:
                continue  # the run finished between listing and reading
        return started

    def delete_gc_run(self, run_id: str) -> None:
        self._remove(f"gc-runs/{run_id}.json")


class LocalChunkStore(ChunkStore):
    """Chunks under a directory of their own (`root/chunks/ab/cd/<id>`, temp files in `root/tmp`)."""

    def __init__(self, root: str | Path, *, read_size: int = MiB) -> None:
        self.local = LocalObjectStore(root)
        self.root = self.local.root
        super().__init__(self.local, read_size=read_size)

    def path(self, chunk_id: str) -> Path:
        return self.local.path(self.key(chunk_id))


class LocalManifestStore(ManifestStore):
    def __init__(self, root: str | Path) -> None:
        super().__init__(LocalObjectStore(root))


class S3ChunkStore(ChunkStore):
    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        prefix: str = "",
        multipart_threshold: int = 16 * MiB,
        part_size: int = 8 * MiB,
        read_size: int = MiB,
    ) -> None:
        objects = S3ObjectStore(client, bucket, multipart_threshold=multipart_threshold, part_size=part_size)
        super().__init__(objects, prefix=prefix, read_size=read_size)


class S3ManifestStore(ManifestStore):
    def __init__(self, client: Any, bucket: str, *, prefix: str = "") -> None:
        super().__init__(S3ObjectStore(client, bucket), prefix=prefix)
