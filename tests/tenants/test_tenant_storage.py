"""Per-tenant storage over moto's S3 server (real HTTP) and a local directory: prefix scoping,
presigned URLs for one key, envelope encryption and rotation, tenants kept apart, retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import httpx
import pytest
from cryptography.exceptions import InvalidTag

from gpucloud.storage.envelope import MasterKeys, TenantKeys, UnknownMasterKeyError, UnknownTenantKeyError
from gpucloud.storage.local import LocalObjectStore
from gpucloud.storage.objects import ObjectMissingError, PresignedUrlError
from gpucloud.storage.retention import mark_for_deletion, pending_deletions, purge_due
from gpucloud.storage.s3 import S3ObjectStore
from gpucloud.storage.tenant import KeyOutsidePrefixError, TenantStorage
from support.s3 import new_bucket

pytestmark = pytest.mark.integration

NOW = datetime(2025, 6, 1, tzinfo=UTC)


@pytest.fixture(params=["s3", "local"])
def backend(request, tmp_path):
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects", signing_key=b"k" * 32)
    client, bucket = new_bucket(request.getfixturevalue("s3_endpoint"), "tenants")
    return S3ObjectStore(client, bucket)


@pytest.fixture
def keys(backend):
    return TenantKeys(backend, MasterKeys({"m1": MasterKeys.generate_key()}, active="m1"))


def fetch(backend, url: str, *, method: str = "GET", content: bytes | None = None) -> httpx.Response | bytes:
    """Use a presigned URL as a node would: over HTTP for S3, through the signer for local."""
    if isinstance(backend, S3ObjectStore):
        return httpx.request(method, url, content=content)
    key = backend.resolve_presigned(url, method=method)
    if method == "PUT":
        backend.put(key, content)
        return b""
    return backend.get(key)


@pytest.mark.parametrize("bad", ["../globex/secret", "/etc/passwd", "a//b", "./x", "a/../../b", "", "a\\..\\b", "x\ny"])
def test_keys_outside_the_prefix_are_refused(backend, bad):
    acme = TenantStorage(backend, "acme")
    with pytest.raises(KeyOutsidePrefixError, match="outside tenant acme's prefix"):
        acme.put(bad, b"x")
    with pytest.raises(KeyOutsidePrefixError):
        acme.presigned_url(bad)


def test_objects_live_under_the_tenant_prefix_and_tenants_do_not_see_each_other(backend):
    acme, globex = TenantStorage(backend, "acme"), TenantStorage(backend, "globex")
    acme.put("ckpt/step-1", b"acme weights")
    globex.put("ckpt/step-1", b"globex weights")
    assert backend.list_keys("tenants/acme/") == ["tenants/acme/ckpt/step-1"]
    assert acme.keys() == ["ckpt/step-1"] and globex.keys("ckpt/") == ["ckpt/step-1"]
    assert acme.get("ckpt/step-1") == b"acme weights"
    assert globex.get("ckpt/step-1") == b"globex weights"
    with pytest.raises(KeyOutsidePrefixError):
        acme.get("../globex/ckpt/step-1")
    with pytest.raises(ObjectMissingError):
        acme.get("tenants/globex/ckpt/step-1")
    with pytest.raises(ValueError, match="tenant id"):
        TenantStorage(backend, "../globex")


def test_presigned_url_grants_its_key_only(backend):
    acme = TenantStorage(backend, "acme")
    acme.put("data/shard-0", b"shard zero")
    backend.put("tenants/globex/data/shard-0", b"globex shard")
    url = acme.presigned_url("data/shard-0")
    assert "tenants/acme/data/shard-0" in url
    answer = fetch(backend, url)
    assert (answer.content if isinstance(answer, httpx.Response) else answer) == b"shard zero"

    upload = acme.presigned_url("out/result", method="PUT")
    answer = fetch(backend, upload, method="PUT", content=b"result")
    assert not isinstance(answer, httpx.Response) or answer.status_code == 200
    assert acme.get("out/result") == b"result"

    forged = url.replace("tenants/acme/data/shard-0", "tenants/globex/data/shard-0")
    if isinstance(backend, S3ObjectStore):
        # moto serves a presigned URL without checking its signature (a forged one gets 200 there;
        # real S3 answers 403 SignatureDoesNotMatch), so what is checked here is that the URL
        # signs exactly this one key, and above and below that no key outside the prefix is signed.
        assert urlsplit(url).path.endswith("/tenants/acme/data/shard-0") and forged != url
    else:
        with pytest.raises(PresignedUrlError):
            fetch(backend, forged)
        with pytest.raises(PresignedUrlError):
            backend.resolve_presigned(url, method="PUT")
        with pytest.raises(PresignedUrlError, match="expired"):
            backend.resolve_presigned(url, method="GET", now=datetime.now(UTC).timestamp() + 3600)
    with pytest.raises(ValueError, match="expires_s"):
        acme.presigned_url("data/shard-0", expires_s=7 * 24 * 3600)


def test_envelope_encryption_round_trip_and_tenant_separation(backend, keys):
    keys.ensure("acme")
    keys.ensure("globex")
    assert keys.ensure("acme") == 1
    acme = TenantStorage(backend, "acme", keys=keys)
    globex = TenantStorage(backend, "globex", keys=keys)
    acme.put_encrypted("secrets/ssh", b"acme private key")
    stored = backend.get("tenants/acme/secrets/ssh")
    assert b"acme private key" not in stored
    assert acme.get_encrypted("secrets/ssh") == b"acme private key"

    with pytest.raises(InvalidTag):
        keys.decrypt("globex", stored, context="tenants/acme/secrets/ssh")
    backend.put("tenants/globex/secrets/ssh", stored)
    with pytest.raises(InvalidTag):
        globex.get_encrypted("secrets/ssh")
    backend.put("tenants/acme/secrets/moved", stored)
    with pytest.raises(InvalidTag):
        acme.get_encrypted("secrets/moved")
    with pytest.raises(UnknownTenantKeyError):
        keys.encrypt("initech", b"x")
    with pytest.raises(KeyOutsidePrefixError):
        acme.presigned_url("../../control/keys/acme.json")


def test_rotation_of_data_key_and_master_key(backend, keys):
    keys.ensure("acme")
    acme = TenantStorage(backend, "acme", keys=keys)
    acme.put_encrypted("old", b"sealed under v1")
    assert keys.rotate_data_key("acme") == 2
    acme.put_encrypted("new", b"sealed under v2")
    assert backend.get("tenants/acme/new")[4:8] == (2).to_bytes(4, "big")

    m2 = MasterKeys.generate_key()
    rotated = TenantKeys(backend, keys.masters.with_active("m2", m2))
    rotated.rewrap("acme")
    assert rotated.master_key_ids("acme") == {"m2"}
    reader = TenantStorage(backend, "acme", keys=TenantKeys(backend, MasterKeys({"m2": m2}, active="m2")))
    assert reader.get_encrypted("old") == b"sealed under v1"
    assert reader.get_encrypted("new") == b"sealed under v2"
    with pytest.raises(UnknownMasterKeyError, match="m2"):
        acme.get_encrypted("old")


def test_retention_purges_only_when_due(backend, keys):
    for tenant in ("acme", "globex"):
        keys.ensure(tenant)
        TenantStorage(backend, tenant, keys=keys).put_encrypted("blob", tenant.encode())
    due = mark_for_deletion(backend, "acme", now=NOW, retention=timedelta(days=30))
    assert mark_for_deletion(backend, "acme", now=NOW + timedelta(days=5), retention=timedelta(days=30)) == due
    assert pending_deletions(backend) == {"acme": due}

    assert purge_due(backend, keys, now=NOW + timedelta(days=29)) == []
    assert TenantStorage(backend, "acme", keys=keys).get_encrypted("blob") == b"acme"

    assert purge_due(backend, keys, now=due) == ["acme"]
    assert backend.list_keys("tenants/acme/") == []
    assert keys.tenants() == ["globex"]
    assert pending_deletions(backend) == {}
    assert TenantStorage(backend, "globex", keys=keys).get_encrypted("blob") == b"globex"
