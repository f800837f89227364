"""Envelope encryption: a master key wraps each tenant's data keys; data keys encrypt the blobs
the control plane stores for the tenant. Both layers are AES-256-GCM.

A tenant's key record (`control/keys/<tenant>.json`, outside every tenant prefix, so no presigned
URL can reach it) holds its data keys, each wrapped under a master key and bound by associated
data to the tenant and the key's version; a record copied to another tenant does not unwrap.
A blob is `MAGIC | data key version (4 bytes) | nonce (12) | ciphertext`, and its associated
data names the tenant and the caller's context, so tenant B's key never opens tenant A's blob.

Rotation: `rotate_data_key` adds a version that new blobs use (old versions stay to decrypt old
blobs); `rewrap` re-wraps every data key under the active master key after a master rotation,
leaving blobs untouched. Deleting the record (`forget`) crypto-shreds whatever is left.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from collections.abc import Mapping

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpucloud.storage.objects import ObjectMissingError, ObjectStore

MAGIC = b"GCE1"
NONCE_BYTES = 12
KEY_RECORDS = "control/keys/"


class UnknownTenantKeyError(LookupError):
    """The tenant has no data key (never created, or forgotten at deletion)."""


class UnknownMasterKeyError(KeyError):
    """A data key is wrapped under a master key this process does not hold."""


class MasterKeys:
    """Master keys by id; `active` wraps new and re-wrapped data keys, the rest only unwrap."""

    def __init__(self, keys: Mapping[str, bytes], *, active: str) -> None:
        if active not in keys:
            raise ValueError(f"active master key {active!r} is not among {sorted(keys)}")
        self._keys = dict(keys)
        self.active = active

    @staticmethod
    def generate_key() -> bytes:
        return AESGCM.generate_key(bit_length=256)

    def with_active(self, key_id: str, key: bytes) -> MasterKeys:
        return MasterKeys({**self._keys, key_id: key}, active=key_id)

    def cipher(self, key_id: str) -> AESGCM:
        if key_id not in self._keys:
            raise UnknownMasterKeyError(f"master key {key_id!r} is not loaded (have {sorted(self._keys)})")
        return AESGCM(self._keys[key_id])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _wrap_aad(tenant_id: str, version: int) -> bytes:
    return f"gpucloud-data-key\0{tenant_id}\0{version}".encode()


def _blob_aad(tenant_id: str, context: str) -> bytes:
    return f"gpucloud-blob\0{tenant_id}\0{context}".encode()


class TenantKeys:
    def __init__(self, backend: ObjectStore, masters: MasterKeys) -> None:
        self._backend = backend
        self.masters = masters

    def _record_key(self, tenant_id: str) -> str:
        return f"{KEY_RECORDS}{tenant_id}.json"

    def _load(self, tenant_id: str) -> dict:
        try:
            return json.loads(self._backend.get(self._record_key(tenant_id)))
        except ObjectMissingError:
            raise UnknownTenantKeyError(f"tenant {tenant_id} has no data key") from None

    def _save(self, tenant_id: str, record: dict) -> None:
        self._backend.put(self._record_key(tenant_id), json.dumps(record, sort_keys=True).encode())

    def _wrapped(self, tenant_id: str, version: int, data_key: bytes) -> dict:
        nonce = os.urandom(NONCE_BYTES)
        wrapped = self.masters.cipher(self.masters.active).encrypt(nonce, data_key, _wrap_aad(tenant_id, version))
        return {
            "version": version,
            "master_key_id": self.masters.active,
            "nonce": _b64(nonce),
            "wrapped": _b64(wrapped),
        }

    def _data_key(self, tenant_id: str, entry: dict) -> bytes:
        cipher = self.masters.cipher(entry["master_key_id"])
        nonce, wrapped = base64.b64decode(entry["nonce"]), base64.b64decode(entry["wrapped"])
        return cipher.decrypt(nonce, wrapped, _wrap_aad(tenant_id, entry["version"]))

    def ensure(self, tenant_id: str) -> int:
        """Create the tenant's first data key unless it has one (onboarding); its active version."""
        try:
            return self._load(tenant_id)["active_version"]
        except UnknownTenantKeyError:
            data_key = AESGCM.generate_key(bit_length=256)
            self._save(tenant_id, {"active_version": 1, "keys": [self._wrapped(tenant_id, 1, data_key)]})
            return 1

    def rotate_data_key(self, tenant_id: str) -> int:
        record = self._load(tenant_id)
        version = max(entry["version"] for entry in record["keys"]) + 1
        record["keys"].append(self._wrapped(tenant_id, version, AESGCM.generate_key(bit_length=256)))
        record["active_version"] = version
        self._save(tenant_id, record)
        return version

    def rewrap(self, tenant_id: str) -> None:
        """Re-wrap every data key of the tenant under the active master key."""
        record = self._load(tenant_id)
        record["keys"] = [
            self._wrapped(tenant_id, entry["version"], self._data_key(tenant_id, entry)) for entry in record["keys"]
        ]
        self._save(tenant_id, record)

    def tenants(self) -> list[str]:
        return [k[len(KEY_RECORDS) : -len(".json")] for k in self._backend.list_keys(KEY_RECORDS)]

    def master_key_ids(self, tenant_id: str) -> set[str]:
        return {entry["master_key_id"] for entry in self._load(tenant_id)["keys"]}

    def forget(self, tenant_id: str) -> None:
        self._backend.delete(self._record_key(tenant_id))

    def encrypt(self, tenant_id: str, plaintext: bytes, *, context: str = "") -> bytes:
        record = self._load(tenant_id)
        version = record["active_version"]
        entry = next(e for e in record["keys"] if e["version"] == version)
        nonce = os.urandom(NONCE_BYTES)
        ciphertext = AESGCM(self._data_key(tenant_id, entry)).encrypt(nonce, plaintext, _blob_aad(tenant_id, context))
        return MAGIC + struct.pack(">I", version) + nonce + ciphertext

    def decrypt(self, tenant_id: str, blob: bytes, *, context: str = "") -> bytes:
        """Raises `cryptography.exceptions.InvalidTag` for another tenant's or a tampered blob."""
        if blob[:4] != MAGIC:
            raise ValueError("not an envelope-encrypted blob")
        (version,) = struct.unpack(">I", blob[4:8])
        nonce, ciphertext = blob[8 : 8 + NONCE_BYTES], blob[8 + NONCE_BYTES :]
        entries = [e for e in self._load(tenant_id)["keys"] if e["version"] == version]
        if not entries:
            raise UnknownTenantKeyError(f"tenant {tenant_id} has no data key version {version}")
        return AESGCM(self._data_key(tenant_id, entries[0])).decrypt(nonce, ciphertext, _blob_aad(tenant_id, context))
