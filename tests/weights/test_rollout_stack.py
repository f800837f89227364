"""A staged rollout in the real stack: the production API and worker, the simulated fleet in its
own process serving each node's weights API under its agent URL, and the tracker whose origin
is the registry's chunk store. Every node of the allocation ends with the version active and
its files verified; the origin sent about one copy of the artifact, the rest went peer to peer.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import httpx
import pytest

from gpucloud import bootstrap
from gpucloud.agent.peer import PeerServer
from gpucloud.client.registry import RegistryClient, RegistryPushTarget, signer_for
from gpucloud.config import Settings
from gpucloud.entrypoints.tracker import create_deployment_tracker
from gpucloud.registry.chunking import ChunkPolicy, encode_safetensors_header
from gpucloud.registry.push import push
from gpucloud.web.service_tokens import TRACKER_AUDIENCE, agent_audience, load_or_create_issuer
from support.stack import async_wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

KiB = 1024
POLICY = ChunkPolicy(max_chunk_size=64 * KiB, pack_size=16 * KiB, fixed_chunk_size=64 * KiB, read_size=KiB * KiB)


def _push(api_url: str, tenant_id: str, key: str, tmp_path) -> tuple[str, int]:
    source = tmp_path / "model"
    source.mkdir()
    tensors = {f"layer.{i}": os.urandom(100 * KiB) for i in range(8)}
    header = encode_safetensors_header((name, len(data)) for name, data in tensors.items())
    (source / "model.safetensors").write_bytes(header + b"".join(tensors.values()))
    with RegistryClient(api_url, key) as client:
        pushed = push(
            source,
            model="m",
            target=RegistryPushTarget(client),
            signer=signer_for(tmp_path / "keys", tenant_id),
            policy=POLICY,
        )
    return pushed.digest, pushed.signed.manifest.total_size


async def test_a_rollout_through_the_stack_activates_and_verifies_every_node_of_the_allocation(
    db_url, make_harness, in_process_worker, tmp_path, monkeypatch
) -> None:
    # The deployment's tracker: swarms kept in the DB, each tenant's chunks, the harness's key.
    tracker_settings = Settings(data_dir=tmp_path, database={"url": db_url})
    bootstrap.token_issuer(tracker_settings)  # the key, and the public half the tracker reads
    tracker = PeerServer(create_deployment_tracker(tracker_settings))
    tracker_url = tracker.start()
    try:
        with monkeypatch.context() as env:  # the sim process reads tenants' keys from this DB
            env.setenv("GPUCLOUD_DATABASE__URL", db_url)
            env.setenv("GPUCLOUD_DATA_DIR", str(tmp_path))
            h = make_harness(db_url, nodes=6, latency_scale=0.02, tracker={"url": tracker_url})
        await in_process_worker(h.settings)
        h.enroll_fleet()
        await h.wait_states({"available": 6})
        tenant_id, key = await h.onboard()
        with h.client(key) as tenant:
            alloc = tenant.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 4, "region": "us-east-1"})
            assert alloc.status_code == 202, alloc.text
            ready = await h.wait_allocation(key, alloc.json()["allocation"]["id"], "ready")
            digest, size = await asyncio.to_thread(_push, h.settings.api_url, tenant_id, key, tmp_path)

            body = {
                "model_version": digest,
                "allocation_id": ready["id"],
                "bake_s": 0.2,
                "waves": [{"nodes": 1}, {"fraction": 1.0}],
            }
            started = tenant.post("/v1/rollouts", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
            assert started.status_code == 202, started.text
            rollout_id = started.json()["rollout_id"]

            # Reads query the workflow, which the in-process worker answers on this event loop: off it.
            def finished() -> dict | None:
                read = tenant.get(f"/v1/rollouts/{rollout_id}")
                if read.status_code == 503:  # its workflow could not answer this time: ask again
                    return None
                assert read.status_code == 200, read.text
                progress = read.json()
                return progress if progress["phase"] in ("succeeded", "rolled_back", "failed") else None

            final = await async_wait_until(
                finished,
                timeout_s=60,
                interval_s=0.2,
                what=f"rollout {rollout_id}",
            )

        assert final["phase"] == "succeeded", final
        assert [len(w) for w in final["waves"]] == [1, 3]
        assert sorted(final["activated"]) == sorted(ready["node_ids"])
        # A node's weights API answers only the control plane's token for that node.
        issuer = load_or_create_issuer(h.settings.issuer_key_path)

        def signed(node_id: str) -> dict:
            return {"Authorization": f"Bearer {issuer.mint(agent_audience(node_id))}"}

        with httpx.Client(base_url=h.sim.url, timeout=30) as sim:
            for node_id in ready["node_ids"]:
                assert sim.get(f"/v1/nodes/{node_id}/weights/status").status_code == 401
                other = signed(next(n for n in ready["node_ids"] if n != node_id))
                assert (
                    sim.post(
                        f"/v1/nodes/{node_id}/weights/rollback", json={"digest": digest}, headers=other
                    ).status_code
                    == 401
                )
                status = sim.get(f"/v1/nodes/{node_id}/weights/status", headers=signed(node_id))
                assert status.json()["active"] == digest
                verified = sim.post(
                    f"/v1/nodes/{node_id}/weights/verify", json={"digest": digest}, headers=signed(node_id)
                )
                assert verified.status_code == 200 and verified.json()["verified"], verified.text
            outsider = next(n["id"] for n in h.nodes() if n["id"] not in ready["node_ids"])
            # holds no tenant
            assert sim.get(f"/v1/nodes/{outsider}/weights/status", headers=signed(outsider)).status_code == 409
        control = {"Authorization": f"Bearer {issuer.mint(TRACKER_AUDIENCE)}"}
        assert httpx.get(f"{tracker_url}/origin/stats").status_code == 401
        egress = httpx.get(f"{tracker_url}/origin/stats", headers=control).json()["egress_bytes"]
        # The deployment's tracker answers /readyz openly and /metrics to the operator token.
        assert httpx.get(f"{tracker_url}/readyz").json()["checks"] == {"database": "ok", "object store": "ok"}
        assert httpx.get(f"{tracker_url}/metrics").status_code == 401
        scraped = httpx.get(
            f"{tracker_url}/metrics", headers={"Authorization": f"Bearer {tracker_settings.operator_token}"}
        )
        served = [
            line
            for line in scraped.text.splitlines()
            if line.startswith('gpucloud_chunk_bytes_served_total{source="origin"}')
        ]
        assert served and float(served[0].rsplit(" ", 1)[1]) >= egress
        assert size <= egress <= 1.2 * size
        # The rollout ended: its swarm is gone from the tracker (and from the DB it was kept in).
        assert httpx.get(f"{tracker_url}/tracker/swarms/{rollout_id}", headers=control).status_code == 404
    finally:
        tracker.stop()
