"""Object stores behind one interface: an S3 bucket (boto3 client built by the caller) or a
local directory. Both hand out presigned URLs for a single key; nothing here knows tenants.

The local backend signs its URLs itself (HMAC-SHA256 over method, key and expiry) and checks
them in `resolve_presigned`, which whatever serves the directory to nodes calls first.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

PRESIGN_METHODS = {"GET": "get_object", "PUT": "put_object"}


class ObjectMissingError(KeyError):
    """No object is stored under the key."""


class PresignedUrlError(PermissionError):
    """A presigned URL that is forged, altered or expired."""


class ObjectBackend(ABC):
    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def list_keys(self, prefix: str) -> list[str]: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing one is not an error."""

    @abstractmethod
    def presign(self, key: str, *, method: str, expires_s: int) -> str:
        """A URL that allows `method` (GET or PUT) on exactly `key` until it expires."""


class S3Backend(ObjectBackend):
    def __init__(self, client: Any, bucket: str) -> None:
        self._client = client
        self.bucket = bucket

    def put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self._client.exceptions.NoSuchKey:
            raise ObjectMissingError(key) from None

    def list_keys(self, prefix: str) -> list[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", ())]

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=key)

    def presign(self, key: str, *, method: str, expires_s: int) -> str:
        return self._client.generate_presigned_url(
            PRESIGN_METHODS[method],
            Params={"Bucket": self.bucket, "Key": key},
            ExpiresIn=expires_s,
        )


class LocalBackend(ObjectBackend):
    """Objects as files under `root`; presigned URLs are `<base_url>/<key>?method&expires&signature`."""

    def __init__(self, root: str | Path, *, signing_key: bytes, base_url: str = "local://objects") -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._signing_key = signing_key
        self._base_url = base_url.rstrip("/")

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"key {key!r} leaves the store's directory")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissingError(key) from None

    def list_keys(self, prefix: str) -> list[str]:
        keys = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(k for k in keys if k.startswith(prefix) and not Path(k).name.startswith(".tmp-"))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _signature(self, method: str, key: str, expires: int) -> str:
        message = f"{method}\n{key}\n{expires}".encode()
        return hmac.new(self._signing_key, message, hashlib.sha256).hexdigest()

    def presign(self, key: str, *, method: str, expires_s: int) -> str:
        if method not in PRESIGN_METHODS:
            raise ValueError(f"cannot presign {method}; only {sorted(PRESIGN_METHODS)}")
        expires = int(time.time()) + expires_s
        signature = self._signature(method, key, expires)
        return f"{self._base_url}/{quote(key)}?method={method}&expires={expires}&signature={signature}"

    def resolve_presigned(self, url: str, *, method: str, now: float | None = None) -> str:
        """The key a presigned URL grants `method` on; raises `PresignedUrlError` otherwise."""
        parts = urlsplit(url)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        key = unquote(url[len(self._base_url) + 1 :].split("?", 1)[0])
        try:
            expires = int(query["expires"])
            valid = query["method"] == method and hmac.compare_digest(
                query["signature"], self._signature(method, key, expires)
            )
        except (KeyError, ValueError):
            valid = False
        if not url.startswith(self._base_url + "/") or not valid:
            raise PresignedUrlError(f"the URL does not grant {method} on {key!r}")
        if (time.time() if now is None else now) > expires:
            raise PresignedUrlError(f"the URL for {key!r} expired")
        return key
