"""The object store behind everything gpucloud keeps as objects: registry chunks and signed
manifests, and tenant storage. One interface; a local directory (`local.LocalObjectStore`) and
an S3 bucket (`s3.S3ObjectStore`) implement it, and `gpucloud.bootstrap` picks one.

Every write is atomic and durable: a reader sees the whole object or none of it. A streamed
write (`put_stream`) runs the caller's `check` after the last piece and before the object
becomes visible, so content-addressed callers can refuse bytes that do not hash to their key
and leave nothing behind. Failures reaching the store are `ObjectTransferError` (worth another
try); a missing object is `ObjectMissingError`; a store that is not there at all (its bucket or
directory never made) is `StoreMissingError`, which only an operator fixes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

PRESIGN_METHODS = frozenset({"GET", "PUT"})


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    modified: datetime


class ObjectMissingError(KeyError):
    """No object is stored under the key."""


class StoreMissingError(LookupError):
    """The store itself is missing (an S3 bucket that does not exist): a deployment not prepared.
    The message names the bucket and that `gpucloud prepare` creates it."""

    def __init__(self, where: str, code: str) -> None:
        super().__init__(f"{where} does not exist ({code}): run `gpucloud prepare` to create it")
        self.where, self.code = where, code


class ObjectTransferError(ConnectionError):
    """The store could not be reached, or failed in a way another try can get past."""


class PresignedUrlError(PermissionError):
    """A presigned URL that is forged, altered or expired."""


class ObjectStore(ABC):
    """Objects by key (`a/b/c`, no `..`). Every method is safe to call from several threads."""

    @abstractmethod
    def put_stream(
        self, key: str, pieces: Iterable[bytes | memoryview], *, check: Callable[[], None] | None = None
    ) -> None:
        """Store the pieces as one object. Each piece is used before the next is drawn (a piece
        may be a view its source overwrites next). `check` runs after the last piece, before the
        object is visible; if it raises, nothing is stored and the error propagates."""

    def put(self, key: str, data: bytes) -> None:
        self.put_stream(key, [data])

    @abstractmethod
    def read_stream(self, key: str, *, piece_size: int) -> Iterator[bytes]:
        """The object's bytes in pieces of at most `piece_size`."""

    def get(self, key: str) -> bytes:
        return b"".join(self.read_stream(key, piece_size=8 << 20))

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo: ...

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except ObjectMissingError:
            return False
        return True

    @abstractmethod
    def scan(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order."""

    def list_keys(self, prefix: str) -> list[str]:
        return [info.key for info in self.scan(prefix)]

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing one is not an error."""

    @abstractmethod
    def presign(self, key: str, *, method: str, expires_s: int) -> str:
        """A URL that allows `method` (GET or PUT) on exactly `key` until it expires."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """Where the object lives, for operators (`file://...`, `s3://bucket/key`)."""

    @abstractmethod
    def abort_incomplete(self, *, prefix: str, older_than: datetime) -> int:
        """Clean up writes under `prefix` abandoned before `older_than`; how many."""

    @abstractmethod
    def probe(self) -> None:
        """Raise unless the store can be used now: `StoreMissingError` when it does not exist,
        `ObjectTransferError` when it does not answer (`/readyz` asks this)."""
