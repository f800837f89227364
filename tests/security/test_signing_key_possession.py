"""Issue 13, rows 14 and 15: a signing key is registered only with proof that the caller holds
its private half, and the local object store keeps tenants' files private.

Before: any public key was registered on the tenant's say-so (a key someone else holds could be
made "trusted" for the tenant's manifests), and stored weights were world-readable (0644)."""

from __future__ import annotations

import pytest

from gpucloud.registry.manifest import Signer
from gpucloud.storage.local import LocalObjectStore

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


async def test_a_signing_key_needs_proof_of_possession_for_this_tenant(db_url, make_harness, in_process_worker):
    h = make_harness(db_url, nodes=1)
    await in_process_worker(h.settings)
    tenant_id, key = await h.onboard()
    other_tenant, _ = await h.onboard()
    mine, someone_elses = Signer.generate(), Signer.generate()
    public = bytes(mine.verify_key).hex()
    with h.client(key) as tenant:
        refused = {
            "no proof": {"public_key": public},
            "a proof for another tenant": {"public_key": public, "proof": mine.prove_possession(other_tenant)},
            "another key's proof": {"public_key": public, "proof": someone_elses.prove_possession(tenant_id)},
            "garbage": {"public_key": public, "proof": "00" * 64},
        }
        for why, body in refused.items():
            resp = tenant.post("/v1/signing-keys", json=body)
            assert resp.status_code == 422, (why, resp.text)
            assert resp.json()["errors"][0]["field"] == "proof", why
        assert tenant.get("/v1/signing-keys").json()["items"] == []
        accepted = tenant.post(
            "/v1/signing-keys", json={"public_key": public, "proof": mine.prove_possession(tenant_id)}
        )
        assert accepted.status_code == 201, accepted.text
        assert [k["key_id"] for k in tenant.get("/v1/signing-keys").json()["items"]] == [mine.key_id]


def test_the_local_store_keeps_objects_0600_in_folders_0700(tmp_path):
    store = LocalObjectStore(tmp_path / "objects")
    store.put_stream("tenants/ten_a/chunks/ab/cd", [b"weights"])
    path = tmp_path / "objects" / "tenants" / "ten_a" / "chunks" / "ab" / "cd"
    assert path.stat().st_mode & 0o777 == 0o600
    folder = path.parent
    while folder != tmp_path:
        assert folder.stat().st_mode & 0o777 == 0o700, folder
        folder = folder.parent
