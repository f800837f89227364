"""One tenant's view of an object store: every key lives under `tenants/<tenant id>/`.

Callers name objects by keys relative to the prefix. A key that would leave it (`..`, a leading
`/`, empty or `.` segments, a backslash) raises `KeyOutsidePrefixError` before anything is
stored or signed. Nodes get a presigned URL for one key (`presigned_url`), never credentials;
blobs the control plane keeps for the tenant are sealed with the tenant's data key
(`put_encrypted` / `get_encrypted`, see `gpucloud.storage.envelope`).

A bucket per tenant is the same class over a backend per tenant: the prefix stays, so a key
names its tenant wherever it ends up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpucloud.models.tenant_messages import TENANT_ID_PATTERN
from gpucloud.storage.envelope import TenantKeys
from gpucloud.storage.objects import ObjectStore

TENANT_ID = re.compile(TENANT_ID_PATTERN)
MAX_PRESIGN_S = 3600


class KeyOutsidePrefixError(ValueError):
    """The key would reach outside the tenant's prefix."""


def tenant_prefix(tenant_id: str) -> str:
    if not TENANT_ID.match(tenant_id):
        raise ValueError(f"tenant id {tenant_id!r} is not 1-64 letters, digits, '-' or '_'")
    return f"tenants/{tenant_id}/"


class TenantStorage:
    def __init__(self, backend: ObjectStore, tenant_id: str, *, keys: TenantKeys | None = None) -> None:
        self.prefix = tenant_prefix(tenant_id)
        self.tenant_id = tenant_id
        self._backend = backend
        self._keys = keys

    def object_key(self, key: str) -> str:
        """The full key of `key`; raises `KeyOutsidePrefixError` for one that leaves the prefix."""
        segments = key.split("/")
        if not key or "\\" in key or any(s in ("", ".", "..") for s in segments) or not key.isprintable():
            raise KeyOutsidePrefixError(
                f"key {key!r} is outside tenant {self.tenant_id}'s prefix {self.prefix}: keys are "
                "relative, with no empty, '.' or '..' segments"
            )
        return self.prefix + key

    def put(self, key: str, data: bytes) -> None:
        self._backend.put(self.object_key(key), data)

    def get(self, key: str) -> bytes:
        return self._backend.get(self.object_key(key))

    def delete(self, key: str) -> None:
        self._backend.delete(self.object_key(key))

    def keys(self, prefix: str = "") -> list[str]:
        """Keys under the tenant's prefix (relative), optionally under a sub-prefix."""
        return [k[len(self.prefix) :] for k in self._backend.list_keys(self.prefix + prefix)]

    def presigned_url(self, key: str, *, method: str = "GET", expires_s: int = 900) -> str:
        """A URL a node uses for exactly this key, for at most an hour."""
        if not 1 <= expires_s <= MAX_PRESIGN_S:
            raise ValueError(f"expires_s must lie in 1-{MAX_PRESIGN_S}, not {expires_s}")
        return self._backend.presign(self.object_key(key), method=method, expires_s=expires_s)

    def _tenant_keys(self) -> TenantKeys:
        if self._keys is None:
            raise RuntimeError("this TenantStorage was built without TenantKeys")
        return self._keys

    def put_encrypted(self, key: str, plaintext: bytes) -> None:
        full_key = self.object_key(key)
        # The object's key is the associated data: a blob moved to another key does not open.
        self._backend.put(full_key, self._tenant_keys().encrypt(self.tenant_id, plaintext, context=full_key))

    def get_encrypted(self, key: str) -> bytes:
        full_key = self.object_key(key)
        return self._tenant_keys().decrypt(self.tenant_id, self._backend.get(full_key), context=full_key)


@dataclass(frozen=True)
class TenantStore:
    """Every tenant's storage on one object store, with the keys that seal it."""

    backend: ObjectStore
    keys: TenantKeys

    def tenant(self, tenant_id: str) -> TenantStorage:
        return TenantStorage(self.backend, tenant_id, keys=self.keys)
