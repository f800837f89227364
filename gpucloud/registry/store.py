"""Where chunks and manifests live: a local directory or an S3 bucket, behind one interface each.

`ChunkStore` is content-addressed: a chunk is stored under its BLAKE3 id, and every store checks
the bytes against that id twice: on the way in (a put whose bytes do not hash to the id raises
and leaves nothing behind) and on the way out (`stream` hashes while it yields and raises after
the last piece if the bytes were not the chunk). Readers therefore consume a stream to its end
before they trust it. Writes are atomic: a reader sees the whole verified chunk or nothing
(`LocalChunkStore`: temp file, fsync, rename; `S3ChunkStore`: one PUT, or a multipart upload that
is completed only after the hash matched and aborted otherwise).

`ManifestStore` keeps the small records of the registry (signed manifests by version digest,
signed evaluation records per version, push leases) on a tiny key/value backend, a directory
(`LocalManifestStore`) or a bucket prefix (`S3ManifestStore`); it checks on every read that a
manifest still hashes to the digest it is stored under.

boto3 is not imported here: S3 stores take a ready client, built where the deployment is chosen.
"""

from __future__ import annotations

import io
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import ValidationError

from gpucloud.registry.chunking import MiB, new_hasher
from gpucloud.registry.manifest import (
    ChunkCorruptedError,
    ChunkMissingError,
    ChunkTransferError,
    ManifestTamperedError,
    PushLease,
    SignedEvaluation,
    SignedManifest,
    VersionNotFoundError,
    is_digest,
)

S3_MIN_PART_SIZE = 5 * MiB  # S3 rejects smaller parts (except the last)


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    id: str
    size: int
    modified: datetime


def _checked_id(chunk_id: str) -> str:
    if not is_digest(chunk_id):
        raise ValueError(f"{chunk_id!r} is not a chunk id (64 lowercase hex digits)")
    return chunk_id


def _as_stream(data: bytes | bytearray | memoryview | BinaryIO) -> BinaryIO:
    return io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data


def _verified(chunk_id: str, pieces: Iterator[bytes]) -> Iterator[bytes]:
    hasher = new_hasher(MiB)
    for piece in pieces:
        hasher.update(piece)
        yield piece
    actual = hasher.hexdigest()
    if actual != chunk_id:
        raise ChunkCorruptedError(f"stored bytes hash to {actual}", chunk_id=chunk_id, actual_id=actual)


def _mismatch(chunk_id: str, actual: str) -> ChunkCorruptedError:
    return ChunkCorruptedError(f"refused to store bytes that hash to {actual}", chunk_id=chunk_id, actual_id=actual)


class ChunkStore(ABC):
    """Content-addressed chunk storage. Every method is safe to call from several threads."""

    @abstractmethod
    def has(self, chunk_id: str) -> bool: ...

    @abstractmethod
    def put(self, chunk_id: str, data: bytes | BinaryIO) -> bool:
        """Store the bytes (read to EOF) under chunk_id; False if it was already there."""

    @abstractmethod
    def stream(self, chunk_id: str) -> Iterator[bytes]:
        """Yield the chunk in bounded pieces; raise ChunkCorruptedError after a bad last piece."""

    def get(self, chunk_id: str) -> bytes:
        return b"".join(self.stream(chunk_id))

    @abstractmethod
    def stat(self, chunk_id: str) -> ChunkInfo: ...

    @abstractmethod
    def list(self) -> Iterator[ChunkInfo]: ...

    @abstractmethod
    def delete(self, chunk_id: str) -> None:
        """Remove the chunk; removing an absent chunk is not an error."""

    @abstractmethod
    def abort_incomplete(self, *, older_than: datetime) -> int:
        """Clean up writes abandoned before older_than (temp files, multipart uploads)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_atomically(path: Path, tmp_dir: Path, data: bytes) -> None:
    """Small records: temp file in tmp_dir, fsync, rename over path, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=tmp_dir, prefix=f"{path.name[:16]}.")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o644)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_name, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


class LocalChunkStore(ChunkStore):
    """Chunks as files under root/chunks/ab/cd/<id>; temp files in root/tmp."""

    def __init__(self, root: str | Path, *, read_size: int = 8 * MiB) -> None:
        self.root = Path(root)
        self._chunks = self.root / "chunks"
        self._tmp = self.root / "tmp"
        self._read_size = read_size
        self._chunks.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)

    def path(self, chunk_id: str) -> Path:
        _checked_id(chunk_id)
        return self._chunks / chunk_id[:2] / chunk_id[2:4] / chunk_id

    def has(self, chunk_id: str) -> bool:
        return self.path(chunk_id).is_file()

    def put(self, chunk_id: str, data: bytes | BinaryIO) -> bool:
        path = self.path(chunk_id)
        if path.is_file():
            return False
        source = _as_stream(data)
        fd, tmp_name = tempfile.mkstemp(dir=self._tmp, prefix=f"{chunk_id[:16]}.")
        try:
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), 0o644)  # mkstemp's 0600 would hide chunks from readers
                hasher, buffer = new_hasher(self._read_size), memoryview(bytearray(self._read_size))
                while count := source.readinto(buffer):
                    hasher.update(buffer[:count])
                    out.write(buffer[:count])
                if (actual := hasher.hexdigest()) != chunk_id:
                    raise _mismatch(chunk_id, actual)
                out.flush()
                os.fsync(out.fileno())
            new_dirs = not path.parent.is_dir()
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp_name, path)
            _fsync_dir(path.parent)
            if new_dirs:  # make the fan-out directories themselves durable
                _fsync_dir(path.parent.parent)
                _fsync_dir(self._chunks)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return True

    def stream(self, chunk_id: str) -> Iterator[bytes]:
        try:
            f = open(self.path(chunk_id), "rb", buffering=0)
        except FileNotFoundError:
            raise ChunkMissingError("not in the store", chunk_id=chunk_id) from None

        def pieces() -> Iterator[bytes]:
            with f:
                while piece := f.read(self._read_size):
                    yield piece

        return _verified(chunk_id, pieces())

    def stat(self, chunk_id: str) -> ChunkInfo:
        try:
            st = self.path(chunk_id).stat()
        except FileNotFoundError:
            raise ChunkMissingError("not in the store", chunk_id=chunk_id) from None
        return ChunkInfo(chunk_id, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def list(self) -> Iterator[ChunkInfo]:
        for first in sorted(self._chunks.iterdir()):
            for second in sorted(first.iterdir()):
                for entry in os.scandir(second):
                    if not is_digest(entry.name):
                        continue
                    try:
                        st = entry.stat()
                    except FileNotFoundError:  # deleted while we listed
                        continue
                    yield ChunkInfo(entry.name, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def delete(self, chunk_id: str) -> None:
        self.path(chunk_id).unlink(missing_ok=True)

    def abort_incomplete(self, *, older_than: datetime) -> int:
        removed = 0
        for entry in os.scandir(self._tmp):
            if datetime.fromtimestamp(entry.stat().st_mtime, UTC) < older_than:
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
        return removed


def _s3_error_code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _s3_status(exc: Exception) -> int:
    return int(getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


_S3_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_S3_TRANSIENT = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"}


def _s3_transport_errors() -> tuple[type[BaseException], ...]:
    """What botocore raises for a lost connection, a timeout or a body cut off mid-way."""
    from botocore import exceptions  # present wherever an S3 client was built

    return (
        exceptions.HTTPClientError,
        exceptions.ConnectionError,
        exceptions.IncompleteReadError,
        ConnectionError,
        TimeoutError,
    )


def _read_up_to(source: BinaryIO, size: int) -> bytes:
    pending = bytearray()
    while len(pending) < size and (more := source.read(size - len(pending))):
        pending += more
    return bytes(pending)


def _parts(head: bytes, source: BinaryIO, part_size: int) -> Iterator[bytes]:
    """Re-cut head + the rest of source into pieces of exactly part_size (the last may be short)."""
    pending = bytearray(head)
    while True:
        pending += _read_up_to(source, part_size - len(pending))
        if not pending:
            return
        yield bytes(pending[:part_size])
        del pending[:part_size]


class S3ChunkStore(ChunkStore):
    """Chunks as objects <prefix>chunks/ab/cd/<id> in one bucket.

    A chunk up to multipart_threshold goes up in one PUT (held in memory, at most that size);
    a larger one as a multipart upload of part_size parts, hashed as the parts go by, completed
    only if the hash matches, so a bad upload never becomes visible.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        prefix: str = "",
        multipart_threshold: int = 16 * MiB,
        part_size: int = 8 * MiB,
        read_size: int = 8 * MiB,
    ) -> None:
        if part_size < S3_MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {S3_MIN_PART_SIZE} bytes")
        self._client, self._bucket = client, bucket
        self._transport_errors = _s3_transport_errors()
        self._prefix = f"{prefix.rstrip('/')}/chunks/" if prefix else "chunks/"
        self._threshold, self._part_size, self._read_size = (
            multipart_threshold,
            part_size,
            read_size,
        )

    def key(self, chunk_id: str) -> str:
        _checked_id(chunk_id)
        return f"{self._prefix}{chunk_id[:2]}/{chunk_id[2:4]}/{chunk_id}"

    def _head(self, chunk_id: str) -> dict | None:
        try:
            return self._client.head_object(Bucket=self._bucket, Key=self.key(chunk_id))
        except self._client.exceptions.ClientError as exc:
            if _s3_error_code(exc) in _S3_NOT_FOUND:
                return None
            raise

    def has(self, chunk_id: str) -> bool:
        return self._head(chunk_id) is not None

    def put(self, chunk_id: str, data: bytes | BinaryIO) -> bool:
        if self.has(chunk_id):
            return False
        source = _as_stream(data)
        head = _read_up_to(source, self._threshold + 1)
        if len(head) <= self._threshold:
            hasher = new_hasher(len(head))
            hasher.update(head)
            if (actual := hasher.hexdigest()) != chunk_id:
                raise _mismatch(chunk_id, actual)
            self._client.put_object(Bucket=self._bucket, Key=self.key(chunk_id), Body=head)
        else:
            self._put_multipart(chunk_id, head, source)
        return True

    def _put_multipart(self, chunk_id: str, head: bytes, source: BinaryIO) -> None:
        key = self.key(chunk_id)
        upload_id = self._client.create_multipart_upload(Bucket=self._bucket, Key=key)["UploadId"]
        try:
            hasher, parts = new_hasher(self._part_size), []
            for number, part in enumerate(_parts(head, source, self._part_size), start=1):
                hasher.update(part)
                response = self._client.upload_part(
                    Bucket=self._bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=part
                )
                parts.append({"PartNumber": number, "ETag": response["ETag"]})
            if (actual := hasher.hexdigest()) != chunk_id:
                raise _mismatch(chunk_id, actual)
            self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
            raise

    def stream(self, chunk_id: str) -> Iterator[bytes]:
        """The chunk's pieces; a 5xx, a lost connection or a body cut off mid-way raises
        `ChunkTransferError` (worth another try), a missing object `ChunkMissingError`."""
        try:
            body = self._client.get_object(Bucket=self._bucket, Key=self.key(chunk_id))["Body"]
        except self._client.exceptions.ClientError as exc:
            if _s3_error_code(exc) in _S3_NOT_FOUND:
                raise ChunkMissingError("not in the store", chunk_id=chunk_id) from None
            if _s3_status(exc) >= 500 or _s3_error_code(exc) in _S3_TRANSIENT:
                raise ChunkTransferError(f"S3 answered {_s3_error_code(exc)}", chunk_id=chunk_id) from exc
            raise
        except self._transport_errors as exc:
            raise ChunkTransferError(f"S3 unreachable: {exc!r}", chunk_id=chunk_id) from exc

        def pieces() -> Iterator[bytes]:
            with body:
                try:
                    yield from body.iter_chunks(self._read_size)
                except self._transport_errors as exc:
                    raise ChunkTransferError(f"S3 body cut off: {exc!r}", chunk_id=chunk_id) from exc

        return _verified(chunk_id, pieces())

    def stat(self, chunk_id: str) -> ChunkInfo:
        head = self._head(chunk_id)
        if head is None:
            raise ChunkMissingError("not in the store", chunk_id=chunk_id)
        return ChunkInfo(chunk_id, head["ContentLength"], head["LastModified"])

    def list(self) -> Iterator[ChunkInfo]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=self._prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"].rsplit("/", 1)[-1]
                if is_digest(name):
                    yield ChunkInfo(name, obj["Size"], obj["LastModified"])

    def delete(self, chunk_id: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=self.key(chunk_id))

    def abort_incomplete(self, *, older_than: datetime) -> int:
        aborted = 0
        pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self._bucket, Prefix=self._prefix)
        for page in pages:
            for upload in page.get("Uploads", []):
                if upload["Initiated"] < older_than:
                    self._client.abort_multipart_upload(
                        Bucket=self._bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
        return aborted


class RecordBackend(ABC):
    """A few small objects by key: the registry's records, not its chunks."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def read(self, key: str) -> bytes:
        """The object's bytes; KeyError if there is none."""

    @abstractmethod
    def keys(self, prefix: str) -> Iterator[str]: ...

    @abstractmethod
    def remove(self, key: str) -> None: ...


class LocalRecords(RecordBackend):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def write(self, key: str, data: bytes) -> None:
        _write_file_atomically(self.root / key, self._tmp, data)

    def read(self, key: str) -> bytes:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def keys(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix
        if base.is_dir():
            for path in sorted(base.rglob("*.json")):
                yield path.relative_to(self.root).as_posix()

    def remove(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)


class S3Records(RecordBackend):
    def __init__(self, client: Any, bucket: str, *, prefix: str = "") -> None:
        self._client, self._bucket = client, bucket
        self._prefix = f"{prefix.rstrip('/')}/" if prefix else ""

    def write(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self._bucket, Key=self._prefix + key, Body=data)

    def read(self, key: str) -> bytes:
        try:
            response = self._client.get_object(Bucket=self._bucket, Key=self._prefix + key)
        except self._client.exceptions.ClientError as exc:
            if _s3_error_code(exc) in _S3_NOT_FOUND:
                raise KeyError(key) from None
            raise
        with response["Body"] as body:
            return body.read()

    def keys(self, prefix: str) -> Iterator[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=self._prefix + prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"][len(self._prefix) :]

    def remove(self, key: str) -> None:
        self._client.delete_object(Bucket=self._bucket, Key=self._prefix + key)


class ManifestStore:
    """Signed manifests by version digest, signed evaluations per version, and push leases."""

    def __init__(self, records: RecordBackend) -> None:
        self.records = records

    def put(self, signed: SignedManifest) -> str:
        """Store the signed manifest under its digest; an intact one already there is kept."""
        digest = signed.digest
        try:
            self.get(digest)
            return digest  # versions are immutable: a second signature does not replace the first
        except (VersionNotFoundError, ManifestTamperedError):
            pass
        self.records.write(f"manifests/{digest}.json", signed.model_dump_json().encode())
        return digest

    def get(self, digest: str) -> SignedManifest:
        """The signed manifest stored under digest, checked to still hash to it (not verified)."""
        _checked_id(digest)
        try:
            raw = self.records.read(f"manifests/{digest}.json")
        except KeyError:
            raise VersionNotFoundError(f"no manifest for version {digest}") from None
        try:
            signed = SignedManifest.model_validate_json(raw)
        except ValidationError as exc:
            raise ManifestTamperedError(f"manifest of version {digest} is unreadable: {exc}") from None
        if signed.digest != digest:
            raise ManifestTamperedError(f"manifest stored as version {digest} now hashes to {signed.digest}")
        return signed

    def list(self) -> Iterator[str]:
        for key in self.records.keys("manifests/"):
            name = key.rsplit("/", 1)[-1].removesuffix(".json")
            if is_digest(name):
                yield name

    def delete(self, digest: str) -> None:
        self.records.remove(f"manifests/{_checked_id(digest)}.json")

    def add_evaluation(self, signed: SignedEvaluation) -> str:
        record = signed.record
        key = f"evaluations/{record.version}/{record.digest}.json"
        self.records.write(key, signed.model_dump_json().encode())
        return record.digest

    def evaluations(self, digest: str) -> list[SignedEvaluation]:
        """The version's stored evaluations, each checked to hash to its key (not verified)."""
        found = []
        for key in self.records.keys(f"evaluations/{_checked_id(digest)}/"):
            try:
                signed = SignedEvaluation.model_validate_json(self.records.read(key))
            except ValidationError as exc:
                raise ManifestTamperedError(f"evaluation record {key} is unreadable: {exc}") from None
            if key != f"evaluations/{digest}/{signed.record.digest}.json":
                raise ManifestTamperedError(f"evaluation record {key} does not hash to its name")
            found.append(signed)
        return found

    def put_lease(self, lease: PushLease) -> None:
        self.records.write(f"leases/{lease.lease_id}.json", lease.model_dump_json().encode())

    def leases(self) -> list[PushLease]:
        leases = []
        for key in self.records.keys("leases/"):
            try:
                leases.append(PushLease.model_validate_json(self.records.read(key)))
            except KeyError:
                continue  # the push finished between listing and reading
        return leases

    def delete_lease(self, lease_id: str) -> None:
        self.records.remove(f"leases/{lease_id}.json")

    def put_gc_run(self, run_id: str, started_at: datetime) -> None:
        """Mark a deleting GC run as started (see `gpucloud.registry.gc.holding`)."""
        self.records.write(f"gc-runs/{run_id}.json", started_at.isoformat().encode())

    def gc_runs(self) -> list[datetime]:
        """When each GC run still marked as running started."""
        started = []
        for key in self.records.keys("gc-runs/"):
            try:
                started.append(datetime.fromisoformat(self.records.read(key).decode()))
            except KeyError:
                continue  # the run finished between listing and reading
        return started

    def delete_gc_run(self, run_id: str) -> None:
        self.records.remove(f"gc-runs/{run_id}.json")


class LocalManifestStore(ManifestStore):
    def __init__(self, root: str | Path) -> None:
        super().__init__(LocalRecords(root))


class S3ManifestStore(ManifestStore):
    def __init__(self, client: Any, bucket: str, *, prefix: str = "") -> None:
        super().__init__(S3Records(client, bucket, prefix=prefix))
