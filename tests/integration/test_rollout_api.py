"""The rollouts API on the production app and worker: bad input is a 4xx naming the field, a
tenant rolls out only its own versions to its own nodes, creation is idempotent, and another
tenant cannot see or steer a rollout (404, like one that does not exist)."""

from __future__ import annotations

import asyncio
import os
import uuid

from gpucloud.client.registry import RegistryClient, RegistryPushTarget, signer_for
from gpucloud.registry.chunking import encode_safetensors_header
from gpucloud.registry.push import push


def _push_version(h, tenant_id: str, key: str, tmp_path) -> str:
    source = tmp_path / "model"
    source.mkdir()
    tensors = {"layer.0": os.urandom(3000), "layer.1": os.urandom(2000)}
    header = encode_safetensors_header((name, len(data)) for name, data in tensors.items())
    (source / "model.safetensors").write_bytes(header + b"".join(tensors.values()))
    with RegistryClient(h.settings.api_url, key) as client:
        return push(
            source, model="m", target=RegistryPushTarget(client), signer=signer_for(tmp_path / "keys", tenant_id)
        ).digest


async def test_rollouts_api_validates_scopes_and_is_idempotent(ready_fleet, tmp_path):
    h = await ready_fleet(nodes=4, latency_scale=0.02)
    a_id, a_key = await h.onboard()
    _, b_key = await h.onboard()
    with h.client(a_key) as a, h.client(b_key) as b:
        alloc = a.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"})
        assert alloc.status_code == 202, alloc.text
        alloc_id = alloc.json()["allocation"]["id"]
        ready = await h.wait_allocation(a_key, alloc_id, "ready")
        digest = _push_version(h, a_id, a_key, tmp_path)
        others = [n["id"] for n in h.nodes() if n["id"] not in ready["node_ids"]]

        bad = a.post("/v1/rollouts", json={"model_version": "not-a-digest", "allocation_id": alloc_id})
        assert bad.status_code == 422 and "model_version" in bad.text
        unknown = a.post("/v1/rollouts", json={"model_version": "0" * 64, "allocation_id": alloc_id})
        assert unknown.status_code == 422 and "no version" in unknown.json()["detail"]
        assert unknown.json()["errors"][0]["field"] == "model_version"  # the field, as any 422 names it
        # B's registry does not hold A's version.
        assert b.post("/v1/rollouts", json={"model_version": digest}).status_code == 422
        foreign = a.post("/v1/rollouts", json={"model_version": digest, "node_ids": others[:1]})
        assert foreign.status_code == 422 and others[0] in foreign.json()["detail"]
        assert foreign.json()["errors"][0]["field"] == "node_ids"

        body = {"model_version": digest, "allocation_id": alloc_id, "bake_s": 0}
        idem = {"Idempotency-Key": str(uuid.uuid4())}
        first = a.post("/v1/rollouts", json=body, headers=idem)
        assert first.status_code == 202, first.text
        rollout_id = first.json()["rollout_id"]
        again = a.post("/v1/rollouts", json=body, headers=idem)
        assert again.status_code == 202 and again.json()["rollout_id"] == rollout_id

        # Reads query the workflow, which the in-process worker answers on this event loop: off it.
        mine = await asyncio.to_thread(a.get, f"/v1/rollouts/{rollout_id}")
        assert mine.status_code == 200 and mine.json()["tenant_id"] == a_id
        assert mine.json()["model_version"] == digest
        assert (await asyncio.to_thread(b.get, f"/v1/rollouts/{rollout_id}")).status_code == 404
        assert (await asyncio.to_thread(b.post, f"/v1/rollouts/{rollout_id}:abort")).status_code == 404
        assert (await asyncio.to_thread(a.get, "/v1/rollouts/rollout-0000000000000000")).status_code == 404
        assert a.get("/v1/rollouts/node-x").status_code == 404
