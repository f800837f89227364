"""Issue 38: the production agent (`gpucloud agent`, a real process on loopback) serves the
weights API and the peer service, behind the same token checks as the simulated fleet.

A small safetensors model is pushed to a local registry with an origin; the agent, provisioned
for a tenant, prefetches it through the tracker (verifying the manifest with the keys the
control plane sent), activates it, and serves its chunks to a peer holding the swarm's peer
token. A token for another node, a peer without the peer token, and a manifest signed by a key
the control plane did not send are refused; a wipe removes the tenant's weights.

Before: `gpucloud agent` served neither `/weights/*` nor `/chunks/*` (404): staged rollouts
and peer fan-out reached simulated nodes only."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from gpucloud.agent.peer import PeerServer
from gpucloud.cli.main import app as cli
from gpucloud.devstack.stack import free_port
from gpucloud.entrypoints.tracker import create_tracker_app
from gpucloud.registry.chunking import ChunkPolicy, encode_safetensors_header
from gpucloud.registry.manifest import SignedManifest, Signer
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.store import LocalChunkStore, LocalManifestStore
from gpucloud.registry.swarm import PeerPlace, SwarmSpec
from gpucloud.registry.tracker_client import TrackerClient
from gpucloud.web.service_tokens import (
    SWARM_MEMBER,
    SWARM_PEER,
    Issuer,
    agent_audience,
    load_or_create_issuer,
    swarm_audience,
)
from support.forked import CliProcess

pytestmark = pytest.mark.integration

NODE, TENANT, SWARM = "gpu-7", "t-1", "rollout-1"
RESET_OK = Path(__file__).parent.parent / "fixtures" / "tools" / "nvidia-smi-gpu-reset-ok.txt"
KiB = 1024
POLICY = ChunkPolicy(max_chunk_size=64 * KiB, pack_size=16 * KiB, fixed_chunk_size=64 * KiB, read_size=256 * KiB)


@dataclass
class Stack:
    root: Path
    agent_url: str
    control_plane: Issuer
    signer: Signer
    chunks: LocalChunkStore
    tracker: TrackerClient
    tracker_url: str

    def push(self, name: str, signer: Signer | None = None) -> SignedManifest:
        source = self.root / "sources" / name
        source.mkdir(parents=True)
        tensors = {f"layers.{i}.weight": os.urandom(40 * KiB + i) for i in range(4)}
        header = encode_safetensors_header((t, len(data)) for t, data in tensors.items())
        (source / "model.safetensors").write_bytes(header + b"".join(tensors.values()))
        (source / "config.json").write_text('{"layers": 4}')
        target = StoreTarget(self.chunks, LocalManifestStore(self.root / "manifests"), settle_seconds=0)
        signed = push(source, model="mini", target=target, signer=signer or self.signer, policy=POLICY).signed
        nodes = {NODE: PeerPlace(rack="r1", site="s1", url=self.agent_url)}
        self.tracker.register_swarm(name, SwarmSpec(nodes=nodes, chunks=sorted(signed.manifest.chunk_ids())))
        return signed

    def node_token(self, node: str = NODE) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.control_plane.mint(agent_audience(node))}"}

    def swarm_token(self, swarm: str, role: str, tenant: str = TENANT) -> str:
        return self.control_plane.mint(
            swarm_audience(swarm), subject=f"node:{NODE}", role=role, tenant=tenant, allocation="a-1"
        )

    def prefetch_body(self, signed: SignedManifest, swarm: str, keys: list[str]) -> dict:
        return {
            "signed": signed.model_dump(mode="json"),
            "tracker_url": self.tracker_url,
            "swarm": swarm,
            "token": self.swarm_token(swarm, SWARM_MEMBER),
            "peer_token": self.swarm_token(swarm, SWARM_PEER),
            "keys": keys,
        }


def _wait_healthy(url: str, process: CliProcess) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "the agent exited"
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the agent did not come up")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    control_plane = load_or_create_issuer(tmp_path / "issuer_key.pem")
    chunks = LocalChunkStore(tmp_path / "chunks")
    origin = PeerServer(create_tracker_app(chunk_store=chunks, seed=7))
    tracker_url = origin.start()
    port = free_port()
    # A wipe resets the GPUs: this node's nvidia-smi answers as the real one does when it can.
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\ncat '{RESET_OK}'\n")
    (tools / "nvidia-smi").chmod(0o755)
    path = f"{tools}{os.pathsep}{os.environ['PATH']}"
    env = {"PATH": path, "GPUCLOUD_DATA_DIR": str(tmp_path), "GPUCLOUD_API__PORT": "1"}
    options = {
        "--node-id": NODE,
        "--port": str(port),
        "--token": f"gpa_{NODE}.secret",
        "--control-plane-key": str(tmp_path / "issuer_key.pub"),
        "--state-dir": str(tmp_path / "state"),
        "--scratch-dir": str(tmp_path / "scratch"),
        "--token-file": str(tmp_path / "credential"),
        "--spool": str(tmp_path / "spool.db"),
        "--heartbeat-s": "3600",
        "--reading-s": "3600",
    }
    # Forked from the test process's server that imported the CLI (`support/forked.py`): a fresh
    # interpreter spends about 1.5 CPU-seconds importing before it serves.
    process = CliProcess(
        ["agent", "--allow-simulated", *itertools.chain(*options.items())],
        env=env,
        log_path=tmp_path / "agent.log",
    )
    tracker = TrackerClient(tracker_url)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, process)
        yield Stack(tmp_path, url, control_plane, Signer.generate(), chunks, tracker, tracker_url)
    finally:
        process.terminate()
        process.wait(timeout=30)
        tracker.close()
        origin.stop()


def test_a_real_agent_prefetches_activates_and_serves_its_peers(stack: Stack) -> None:
    signed = stack.push(SWARM)
    keys = [bytes(stack.signer.verify_key).hex()]
    with httpx.Client(base_url=stack.agent_url, timeout=60, headers=stack.node_token()) as agent:
        no_tenant = agent.get("/weights/status")
        assert no_tenant.status_code == 409, no_tenant.text  # no tenant holds the node: no weights
        provisioned = agent.post("/actions/provision", json={"request_id": "r1", "tenant_id": TENANT})
        assert provisioned.status_code == 200, provisioned.text

        fetched = agent.post("/weights/prefetch", json=stack.prefetch_body(signed, SWARM, keys))
        assert fetched.status_code == 200, fetched.text
        assert fetched.json()["origin_bytes"] >= signed.manifest.total_size
        activated = agent.post("/weights/activate", json={"digest": signed.digest})
        assert activated.status_code == 200 and activated.json()["active"] == signed.digest, activated.text
        status = agent.get("/weights/status").json()
        assert status["active"] == signed.digest and status["versions"] == [signed.digest]
        checked = agent.get("/weights/check", params={"digest": signed.digest}).json()
        assert checked["healthy"] is True and checked["eval_score"] == 1.0
        weights = stack.root / "state" / "weights" / TENANT / "versions" / signed.digest
        assert (weights / "config.json").read_text() == '{"layers": 4}'

        # A manifest signed by a key the control plane did not send is not kept.
        rogue = stack.push("rollout-2", signer=Signer.generate())
        refused = agent.post("/weights/prefetch", json=stack.prefetch_body(rogue, "rollout-2", keys))
        assert refused.status_code == 409 and "not trusted" in refused.json()["detail"], refused.text

        # The control plane's token for another node opens nothing here.
        other = stack.node_token("gpu-8")
        assert agent.get("/weights/status", headers=other).status_code == 401
        body = {"digest": signed.digest}
        assert agent.post("/weights/rollback", json=body, headers=other).status_code == 401
        assert agent.get("/weights/status").json()["active"] == signed.digest

    chunk = sorted(signed.manifest.chunk_ids())[0]
    path = f"{stack.agent_url}/chunks/{chunk}?swarm={SWARM}"

    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    served = httpx.get(path, headers=bearer(stack.swarm_token(SWARM, SWARM_PEER)))
    assert served.status_code == 200 and served.content == stack.chunks.get(chunk)
    assert httpx.get(path).status_code == 401
    assert httpx.get(path, headers=stack.node_token()).status_code == 401  # the control plane's is not a peer's
    assert httpx.get(path, headers=bearer(stack.swarm_token(SWARM, SWARM_MEMBER))).status_code == 401
    other_tenant = bearer(stack.swarm_token(SWARM, SWARM_PEER, tenant="t-2"))
    assert httpx.get(path, headers=other_tenant).status_code == 403

    # A wipe takes the tenant's weights with its files.
    with httpx.Client(base_url=stack.agent_url, timeout=60, headers=stack.node_token()) as agent:
        assert agent.post("/actions/release", json={"request_id": "r2"}).status_code == 200
        assert agent.post("/actions/wipe", json={"request_id": "r3"}).status_code == 200
        assert not (stack.root / "state" / "weights").exists()
        assert agent.get("/weights/status").status_code == 409
        again = agent.post("/actions/provision", json={"request_id": "r4", "tenant_id": TENANT})
        assert again.status_code == 200
        assert agent.get("/weights/status").json()["versions"] == []  # reopened, empty


def test_the_agent_help_lists_the_weights_and_peer_service() -> None:
    shown = CliRunner().invoke(cli, ["agent", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert "--weights-dir" in text
    assert "/weights" in text and "/chunks" in text and "peer token" in text
