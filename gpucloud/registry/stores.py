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

from gpucloud.models.tenant_messages import TENANT_ID_PATTERN
from gpucloud.registry.store import ChunkStore, ManifestStore
from gpucloud.storage.objects import ObjectStore

_TENANT_ID = re.compile(TENANT_ID_PATTERN)


class RegistryStores:
    """The chunk and manifest stores of each tenant, built on first use and then reused."""

    def __init__(self, objects: ObjectStore, *, prefix: str = "registry") -> None:
        """Every tenant's stores on `objects`, under `<prefix>/tenants/<tenant id>/`."""
        self.objects = objects
        self._prefix = prefix.strip("/")
        self._lock = threading.Lock()
        self._stores: dict[str, tuple[ChunkStore, ManifestStore]] = {}

    def _tenant_prefix(self, tenant_id: str) -> str:
        if not _TENANT_ID.match(tenant_id):
            raise ValueError(f"{tenant_id!r} is not a tenant id")
        return f"{self._prefix}/tenants/{tenant_id}/".lstrip("/")

    def _for(self, tenant_id: str) -> tuple[ChunkStore, ManifestStore]:
        with self._lock:
            if tenant_id not in self._stores:
                prefix = self._tenant_prefix(tenant_id)
                self._stores[tenant_id] = (
                    ChunkStore(self.objects, prefix=prefix),
                    ManifestStore(self.objects, prefix=prefix),
                )
            return self._stores[tenant_id]

    def chunks(self, tenant_id: str) -> ChunkStore:
        return self._for(tenant_id)[0]

    def manifests(self, tenant_id: str) -> ManifestStore:
        return self._for(tenant_id)[1]

    def manifest_uri(self, tenant_id: str, digest: str) -> str:
        """Where the signed manifest of a version lives, recorded on its row for operators."""
        return self.manifests(tenant_id).uri(digest)
