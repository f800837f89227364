"""Issue 13, row 4: `weights pull` trusts only keys the puller holds.

Before: the pull trusted the signing keys served by the API it pulled from, so a fake API
serving its own key, manifest and chunks had its bytes written as verified."""

from __future__ import annotations

import httpx
import pytest

from gpucloud.client.bulk import BulkConnections
from gpucloud.client.registry import (
    RegistryClient,
    RegistryPushTarget,
    pull_version,
    signer_for,
    trust_key,
    trusted_keys,
)
from gpucloud.registry.manifest import UnknownKeyError
from gpucloud.registry.push import push
from support.models import POLICY, random_tensors, tree, write_model

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def _impostor(api_url: str, mallory_key: str, alice_id: str) -> httpx.MockTransport:
    """An API that claims to be Alice's: it serves Mallory's key as Alice's, and Mallory's
    manifests and chunks (really fetched from the registry with Mallory's key)."""
    real = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {mallory_key}"}, timeout=30)

    def handle(request: httpx.Request) -> httpx.Response:
        answer = real.request(request.method, request.url.raw_path.decode(), content=request.content)
        if request.url.path == "/v1/signing-keys" and request.method == "GET":
            return httpx.Response(200, json={**answer.json(), "tenant_id": alice_id})
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    return httpx.MockTransport(handle)


class _ImpostorClient(RegistryClient):
    """Alice's client talking to the impostor: its calls go through `_impostor`, and its chunk
    bodies (which travel outside httpx) are Mallory's too."""

    def __init__(self, api_url: str, alice_key: str, mallory_key: str, alice_id: str) -> None:
        super().__init__(api_url, alice_key, transport=_impostor(api_url, mallory_key, alice_id))
        self.bulk.close()
        self.bulk = BulkConnections(api_url, mallory_key, timeout_s=30)


async def test_a_pull_from_an_api_serving_its_own_key_fails_closed(db_url, make_harness, in_process_worker, tmp_path):
    h = make_harness(db_url, nodes=1)
    await in_process_worker(h.settings)
    alice_id, alice_key = await h.onboard()
    _, mallory_key = await h.onboard()
    alice_dir, mallory_dir = tmp_path / "alice", tmp_path / "mallory"
    with RegistryClient(h.api.url, mallory_key) as mallory:
        mallory_signer = signer_for(mallory_dir, mallory.signing_keys()[0])
        source = write_model(tmp_path / "evil", random_tensors((70_000, 50_000)))
        pushed = push(source, model="llama", target=RegistryPushTarget(mallory), signer=mallory_signer, policy=POLICY)
    signer_for(alice_dir, alice_id)  # Alice's machine has its own key, which signed nothing here

    dest = tmp_path / "pulled"
    with _ImpostorClient(h.api.url, alice_key, mallory_key, alice_id) as fake:
        with pytest.raises(UnknownKeyError):
            pull_version(fake, "llama", pushed.digest, dest, trusted=trusted_keys(alice_dir, alice_id))
        assert not dest.exists()
        # Only once Alice says she trusts that key does the same pull go through.
        trust_key(alice_dir, alice_id, bytes(mallory_signer.verify_key).hex(), "told out of band")
        pulled = pull_version(fake, "llama", pushed.digest, dest, trusted=trusted_keys(alice_dir, alice_id))
    assert tree(pulled.path) == tree(source)
