"""The object store as an S3 bucket (any S3-compatible server), through one boto3 client.

A streamed write up to `multipart_threshold` goes up in one PUT (held in memory, at most that
size); a larger one as a multipart upload of `part_size` parts, completed only after the
caller's check passed and aborted otherwise, so a refused object never becomes visible. A lost
connection, a timeout, a body cut off mid-way, a 5xx or throttling is `ObjectTransferError`; a
bucket that does not exist is `StoreMissingError`, naming the bucket, from every call. Other
refusals (access denied, say) pass through as boto3 raised them.

boto3 is not imported here: the store takes a ready client, built by `gpucloud.bootstrap`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from gpucloud.storage.objects import (
    ObjectInfo,
    ObjectMissingError,
    ObjectStore,
    ObjectTransferError,
    StoreMissingError,
)

MiB = 1 << 20
S3_MIN_PART_SIZE = 5 * MiB  # S3 rejects smaller parts (except the last)
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_NO_BUCKET = "NoSuchBucket"
_TRANSIENT = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"}


def _error_code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _status(exc: Exception) -> int:
    return int(getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What botocore raises for a lost connection, a timeout or a body cut off mid-way."""
    from botocore import exceptions  # present wherever an S3 client was built

    return (
        exceptions.HTTPClientError,
        exceptions.ConnectionError,
        exceptions.IncompleteReadError,
        ConnectionError,
        TimeoutError,
    )


def _recut(pieces: Iterable[bytes | memoryview], size: int) -> Iterator[bytes]:
    """The same bytes in pieces of exactly `size` (the last may be short)."""
    pending = bytearray()
    for piece in pieces:
        pending += piece
        while len(pending) >= size:
            yield bytes(pending[:size])
            del pending[:size]
    if pending:
        yield bytes(pending)


class S3ObjectStore(ObjectStore):
    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        multipart_threshold: int = 16 * MiB,
        part_size: int = 8 * MiB,
    ) -> None:
        if part_size < S3_MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {S3_MIN_PART_SIZE} bytes")
        self.client, self.bucket = client, bucket
        self._threshold, self._part_size = multipart_threshold, part_size
        self._transport_errors = _transport_errors()

    def _classified(self, exc: Exception, key: str) -> Exception | None:
        """What S3's refusal means to a caller; None for one that passes through as it is."""
        if _error_code(exc) == _NO_BUCKET:
            return self._missing(_NO_BUCKET)
        if _error_code(exc) in _NOT_FOUND:
            return ObjectMissingError(key)
        if _status(exc) >= 500 or _error_code(exc) in _TRANSIENT:
            return ObjectTransferError(f"S3 answered {_error_code(exc) or _status(exc)} for {key}")
        return None

    def _missing(self, code: str) -> StoreMissingError:
        endpoint = getattr(getattr(self.client, "meta", None), "endpoint_url", None) or "S3"
        return StoreMissingError(f"bucket {self.bucket} at {endpoint}", code)

    @contextmanager
    def _calling(self, key: str) -> Iterator[None]:
        """Around each call of the client: its errors as the store's. An error it passes through
        is re-raised as it is, never raised `from` itself: a cause that is the error itself is a
        cycle, and whatever walks the causes (Temporal's failure converter, turning an
        activity's error into what its history records) recurses until RecursionError, which
        is all that would be recorded."""
        try:
            yield
        except self.client.exceptions.ClientError as exc:
            classified = self._classified(exc, key)
            if classified is None:
                raise
            raise classified from exc
        except self._transport_errors as exc:
            raise ObjectTransferError(f"S3 unreachable: {exc!r}") from exc

    def put_stream(
        self, key: str, pieces: Iterable[bytes | memoryview], *, check: Callable[[], None] | None = None
    ) -> None:
        parts = _recut(pieces, self._threshold + 1)
        head = next(parts, b"")
        rest = next(parts, None)
        if rest is None:
            if check is not None:
                check()
            with self._calling(key):
                self.client.put_object(Bucket=self.bucket, Key=key, Body=head)
            return
        self._put_multipart(key, _recut(_chain(head, rest, parts), self._part_size), check)

    def _put_multipart(self, key: str, parts: Iterator[bytes], check: Callable[[], None] | None) -> None:
        with self._calling(key):
            upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            done = []
            for number, part in enumerate(parts, start=1):
                with self._calling(key):
                    response = self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=part
                    )
                done.append({"PartNumber": number, "ETag": response["ETag"]})
            if check is not None:
                check()
            with self._calling(key):
                self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}
                )
        except BaseException:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def read_stream(self, key: str, *, piece_size: int) -> Iterator[bytes]:
        with self._calling(key):
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]

        def pieces() -> Iterator[bytes]:
            with body:
                try:
                    yield from body.iter_chunks(piece_size)
                except self._transport_errors as exc:
                    raise ObjectTransferError(f"S3 body of {key} cut off: {exc!r}") from exc

        return pieces()

    def stat(self, key: str) -> ObjectInfo:
        # A HEAD answer has no body, so a missing bucket reads as a missing object here ("404").
        with self._calling(key):
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        return ObjectInfo(key, head["ContentLength"], head["LastModified"])

    def scan(self, prefix: str) -> Iterator[ObjectInfo]:
        pages = iter(self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix))
        while True:
            with self._calling(prefix):
                page = next(pages, None)
            if page is None:
                return
            for obj in page.get("Contents", ()):
                yield ObjectInfo(obj["Key"], obj["Size"], obj["LastModified"])

    def delete(self, key: str) -> None:
        with self._calling(key):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def presign(self, key: str, *, method: str, expires_s: int) -> str:
        operation = {"GET": "get_object", "PUT": "put_object"}[method]
        return self.client.generate_presigned_url(
            operation, Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires_s
        )

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def probe(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self.client.exceptions.ClientError as exc:
            if _error_code(exc) in ("404", "NotFound", _NO_BUCKET):
                raise self._missing(_NO_BUCKET) from exc
            raise
        except self._transport_errors as exc:
            raise ObjectTransferError(f"S3 unreachable: {exc!r}") from exc

    def abort_incomplete(self, *, prefix: str, older_than: datetime) -> int:
        aborted = 0
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            for upload in page.get("Uploads", ()):
                if upload["Initiated"] < older_than:
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    aborted += 1
        return aborted


def _chain(head: bytes, rest: bytes, more: Iterator[bytes]) -> Iterator[bytes]:
    yield head
    yield rest
    yield from more
