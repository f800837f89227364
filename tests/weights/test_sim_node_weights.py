"""The simulated fleet's weights API shares its host with `gpucloud up`: a canary's evaluation
command is recorded there, never run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.routing import Mount

from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.registry.manifest import Keyring, Signer
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.stores import RegistryStores
from gpucloud.sim.node_weights import NodeWeights, WeightsSpec
from gpucloud.storage.local import LocalObjectStore

pytestmark = pytest.mark.unit


def test_a_canary_command_with_side_effects_leaves_no_trace_on_the_host(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "weights.bin").write_bytes(os.urandom(50_000))
    signer = Signer.generate()
    stores = RegistryStores(LocalObjectStore(tmp_path / "objects"))
    target = StoreTarget(stores.chunks("t1"), stores.manifests("t1"), settle_seconds=0)
    signed = push(source, model="m", target=target, signer=signer).signed
    keyring = Keyring()
    keyring.trust("t1", signer.verify_key)

    root = tmp_path / "nodes"
    cache = ChunkCache(root / "node-0" / "t1", keyring=keyring, tenant="t1")  # where the node keeps t1's weights
    cache.add_manifest(signed)
    for chunk_id in signed.manifest.chunk_ids():
        cache.put(chunk_id, stores.chunks("t1").get(chunk_id))
    cache.assemble(signed.digest)
    cache.activate(signed.digest)

    node = SimpleNamespace(id="node-0", tenant_id="t1", unreachable=False, hardware_fault=None)
    weights = NodeWeights({"node-0": node}, WeightsSpec(root=root, keyring_for=lambda _: keyring))
    app = Starlette(routes=[Mount("/v1/nodes/{node_id}", app=weights)])
    touched = tmp_path / "touched"
    command = {"argv": [sys.executable, "-c", f"open({str(touched)!r}, 'w'); print('{{\"ran\": 1}}')"]}
    with TestClient(app) as client:
        answer = client.post(
            "/v1/nodes/node-0/weights/evaluate",
            json={"digest": signed.digest, "evaluators": ["command"], "command": command},
        )
    assert answer.status_code == 200, answer.text
    outcome = answer.json()["outcomes"]["command"]
    assert outcome["results"] == {} and outcome["details"]["simulated"] is True
    assert outcome["details"]["argv"] == command["argv"]
    assert not touched.exists()
