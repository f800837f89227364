"""The registry's stores of each tenant: chunks and signed manifests, local or on S3.

Every tenant gets its own prefix (`tenants/<tenant id>/`) holding its chunks and manifests, as the
architecture asks of storage ("a bucket or prefix per tenant"). Deduplication is therefore within
a tenant only: a shared content-addressed pool would let any tenant learn whether another holds
a given file by asking whether its chunk ids exist, and would let one tenant's garbage collection
weigh on another's data. Which store (and its client) is chosen by `gpucloud.bootstrap`.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from gpucloud.registry.store import (
    ChunkStore,
    LocalChunkStore,
    LocalManifestStore,
    ManifestStore,
    S3ChunkStore,
    S3ManifestStore,
)

_TENANT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RegistryStores:
    """The chunk and manifest stores of each tenant, built on first use and then reused."""

    def __init__(self, *, root: Path, s3_client=None, bucket: str | None = None, prefix: str = "registry") -> None:
        """Local stores under `root`, or with an `s3_client`, stores in `bucket` under `prefix`."""
        self._root = root.resolve()
        self._client = s3_client
        self._bucket = bucket
        self._s3_prefix = prefix.strip("/")
        self._lock = threading.Lock()
        self._stores: dict[str, tuple[ChunkStore, ManifestStore]] = {}

    def _prefix(self, tenant_id: str) -> str:
        if not _TENANT_ID.fullmatch(tenant_id):
            raise ValueError(f"{tenant_id!r} is not a tenant id")
        return f"tenants/{tenant_id}"

    def _build(self, tenant_id: str) -> tuple[ChunkStore, ManifestStore]:
        prefix = self._prefix(tenant_id)
        if self._client is None:
            root = self._root / prefix
            return LocalChunkStore(root), LocalManifestStore(root)
        s3_prefix = f"{self._s3_prefix}/{prefix}".lstrip("/")
        return (
            S3ChunkStore(self._client, self._bucket, prefix=s3_prefix),
            S3ManifestStore(self._client, self._bucket, prefix=s3_prefix),
        )

    def _for(self, tenant_id: str) -> tuple[ChunkStore, ManifestStore]:
        with self._lock:
            if tenant_id not in self._stores:
                self._stores[tenant_id] = self._build(tenant_id)
            return self._stores[tenant_id]

    def chunks(self, tenant_id: str) -> ChunkStore:
        return self._for(tenant_id)[0]

    def manifests(self, tenant_id: str) -> ManifestStore:
        return self._for(tenant_id)[1]

    def manifest_uri(self, tenant_id: str, digest: str) -> str:
        """Where the signed manifest of a version lives, recorded on its row for operators."""
        prefix = self._prefix(tenant_id)
        if self._client is None:
            return (self._root / prefix / "manifests" / f"{digest}.json").as_uri()
        s3_prefix = f"{self._s3_prefix}/{prefix}".lstrip("/")
        return f"s3://{self._bucket}/{s3_prefix}/manifests/{digest}.json"
