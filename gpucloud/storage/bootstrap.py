"""Which object store holds tenant storage, decided from the settings in one place.

S3 when `storage_bucket` is set (boto3's usual credential chain; `storage_endpoint_url` for an
S3-compatible store), else a local directory in the data dir. The master key comes from
`storage_master_key`, else from a file kept in the data dir; its id is derived from the key
itself, so a different key can never pass for the one that wrapped a tenant's data key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

from gpucloud.config import Settings, load_or_create_secret
from gpucloud.storage.backends import LocalBackend, ObjectBackend, S3Backend
from gpucloud.storage.envelope import MasterKeys, TenantKeys
from gpucloud.storage.tenant import TenantStorage


@dataclass(frozen=True)
class TenantStore:
    backend: ObjectBackend
    keys: TenantKeys

    def tenant(self, tenant_id: str) -> TenantStorage:
        return TenantStorage(self.backend, tenant_id, keys=self.keys)


def master_key(settings: Settings) -> bytes:
    encoded = settings.storage_master_key or load_or_create_secret(
        settings.data_dir / "storage_master_key", lambda: base64.b64encode(MasterKeys.generate_key()).decode()
    )
    key = base64.b64decode(encoded)
    if len(key) != 32:
        raise ValueError("the storage master key must be base64 of 32 bytes")
    return key


def open_tenant_store(settings: Settings) -> TenantStore:
    key = master_key(settings)
    key_id = "mk-" + hashlib.sha256(key).hexdigest()[:12]
    masters = MasterKeys({key_id: key}, active=key_id)
    if settings.storage_bucket:
        import boto3

        client = boto3.client("s3", endpoint_url=settings.storage_endpoint_url)
        backend: ObjectBackend = S3Backend(client, settings.storage_bucket)
    else:
        # Presigned URLs of the local store are signed with a key derived from the master key.
        signing_key = hmac.new(key, b"gpucloud-local-presign", hashlib.sha256).digest()
        backend = LocalBackend(settings.data_dir / "objects", signing_key=signing_key)
    return TenantStore(backend=backend, keys=TenantKeys(backend, masters))
