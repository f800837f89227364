"""Where the registry keeps chunks and signed manifests: chosen once, here, from `GPUCLOUD_REGISTRY_*`.

`backend=local` (the embedded default) keeps everything under `<data dir>/registry`;
`backend=s3` uses one bucket at `endpoint_url` (any S3-compatible store), with credentials from
`GPUCLOUD_REGISTRY_ACCESS_KEY_ID` / `GPUCLOUD_REGISTRY_SECRET_ACCESS_KEY` when set, else from
boto3's usual chain (`AWS_*` variables, profiles, instance roles).

Every tenant gets its own prefix (`tenants/<tenant id>/`) holding its chunks and manifests, as the
architecture asks of storage ("a bucket or prefix per tenant"). Deduplication is therefore within
a tenant only: a shared content-addressed pool would let any tenant learn whether another holds
a given file by asking whether its chunk ids exist, and would let one tenant's garbage collection
weigh on another's data.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Literal

from pydantic import SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpucloud.registry.chunking import MiB
from gpucloud.registry.store import (
    ChunkStore,
    LocalChunkStore,
    LocalManifestStore,
    ManifestStore,
    S3ChunkStore,
    S3ManifestStore,
)

_TENANT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RegistrySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUCLOUD_REGISTRY_", extra="ignore")

    backend: Literal["local", "s3"] = "local"
    local_dir: Path | None = None
    endpoint_url: str | None = None
    bucket: str | None = None
    prefix: str = "registry"
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None
    # The largest chunk the API accepts in one upload: the chunker's own maximum (64 MiB).
    max_chunk_size: int = 64 * MiB

    @model_validator(mode="after")
    def _s3_needs_a_bucket(self) -> RegistrySettings:
        if self.backend == "s3" and not self.bucket:
            raise ValueError("GPUCLOUD_REGISTRY_BUCKET is required when GPUCLOUD_REGISTRY_BACKEND=s3")
        return self


class RegistryStores:
    """The chunk and manifest stores of each tenant, built on first use and then reused."""

    def __init__(self, settings: RegistrySettings, *, data_dir: Path) -> None:
        self.settings = settings
        self._root = (settings.local_dir or data_dir / "registry").resolve()
        self._client = _s3_client(settings) if settings.backend == "s3" else None
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
        s3_prefix = f"{self.settings.prefix.strip('/')}/{prefix}".lstrip("/")
        return (
            S3ChunkStore(self._client, self.settings.bucket, prefix=s3_prefix),
            S3ManifestStore(self._client, self.settings.bucket, prefix=s3_prefix),
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
        s3_prefix = f"{self.settings.prefix.strip('/')}/{prefix}".lstrip("/")
        return f"s3://{self.settings.bucket}/{s3_prefix}/manifests/{digest}.json"


def _s3_client(settings: RegistrySettings):
    import boto3  # only an S3 deployment pays for importing boto3

    credentials = {}
    if settings.access_key_id and settings.secret_access_key:
        credentials = {
            "aws_access_key_id": settings.access_key_id,
            "aws_secret_access_key": settings.secret_access_key.get_secret_value(),
        }
    return boto3.client("s3", endpoint_url=settings.endpoint_url, region_name=settings.region, **credentials)


def build_stores(settings: RegistrySettings | None = None, *, data_dir: Path) -> RegistryStores:
    """The one place that turns configuration into stores (from the environment unless given)."""
    return RegistryStores(settings or RegistrySettings(), data_dir=data_dir)
