"""Issue 38: a staged rollout reaches real `gpucloud agent` processes, with real bytes.

K agents run as their own processes on loopback, each with its own node credential, state and
weights directory, enrolled in the control-plane DB in one tenant's allocation. The control
plane's side is the production code: the rollout workflow and its activities (a worker in the
test, re-checking every wave's nodes against the DB and signing each call for its one node), and
the deployment's tracker and origin (swarms in the DB, chunks from the tenant's registry store,
each node's swarm token honoured while the node is in the allocation).

A real safetensors model (fp32, fp16, bf16 tensors; a few MiB) goes out in two waves (a canary,
then the rest): the canary runs the model's sanity evaluation, every agent ends with the version
active and its files byte for byte the pushed ones, and the origin sends about one copy (the rest
moves agent to agent). A fine-tune with a NaN fails the canary's evaluation and the canary rolls
back; an abort after every node activated a third version rolls every node back to the first.
On SQLite and Postgres, and with every server (agents, tracker) over TLS with a private CA.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlmodel import Session
from temporalio.client import Client, WorkflowHandle

from gpucloud import bootstrap
from gpucloud.activities.rollout import RolloutActivities
from gpucloud.agent.peer import PeerServer
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.devstack.stack import free_port
from gpucloud.entrypoints.tracker import create_deployment_tracker
from gpucloud.models.registry_tables import GateSpec, SigningKey
from gpucloud.models.rollout_messages import (
    FINISHED,
    ReasonInput,
    RolloutEvaluation,
    RolloutInput,
    RolloutPhase,
    RolloutResult,
    WaveSpec,
)
from gpucloud.models.tables import Node
from gpucloud.registry.chunking import ChunkPolicy
from gpucloud.registry.manifest import SignedManifest, Signer
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.stores import RegistryStores
from gpucloud.registry.tracker_client import TrackerClient
from gpucloud.services import agent_credentials
from gpucloud.web import tls
from gpucloud.web.service_tokens import TRACKER_AUDIENCE, Issuer, agent_audience, public_key_path
from gpucloud.workflows.rollout import RolloutWorkflow
from support.forked import CliProcess
from support.models import float_model, tree
from support.rollouts import rollout_worker_with

pytestmark = pytest.mark.integration

K = 4
TENANT, ALLOCATION = "acme", "alloc-1"
KiB = 1024
POLICY = ChunkPolicy(max_chunk_size=256 * KiB, pack_size=16 * KiB, fixed_chunk_size=256 * KiB, read_size=KiB * KiB)
METRICS_TOKEN = "scraper-token"
SANITY = RolloutEvaluation(gates=[GateSpec(metric="nan_inf_count", max=0)])


@dataclass
class Agents:
    """The control plane's view of K real agents, and where each keeps its weights."""

    settings: Settings
    db: Database
    issuer: Issuer
    signer: Signer
    stores: RegistryStores
    tracker_url: str
    urls: dict[str, str]
    weights: dict[str, Path]

    def push(self, source: Path) -> SignedManifest:
        target = StoreTarget(self.stores.chunks(TENANT), self.stores.manifests(TENANT), settle_seconds=0)
        return push(source, model="mini", target=target, signer=self.signer, policy=POLICY).signed

    def headers(self, node: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.issuer.mint(agent_audience(node))}"}

    def status(self, node: str) -> dict:
        response = httpx.get(
            f"{self.urls[node]}/weights/status", headers=self.headers(node), verify=tls.client_verify(), timeout=30
        )
        assert response.status_code == 200, response.text
        return response.json()

    def files(self, node: str, digest: str) -> dict[str, bytes]:
        return tree(self.weights[node] / TENANT / "versions" / digest)

    def peer_served(self, node: str) -> float:
        """The chunk bytes `node`'s agent served its peers (its own /metrics)."""
        scraped = httpx.get(
            f"{self.urls[node]}/metrics",
            headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
            verify=tls.client_verify(),
            timeout=30,
        )
        assert scraped.status_code == 200, scraped.text
        served = 'gpucloud_chunk_bytes_served_total{source="peer"} '
        return sum(float(line.removeprefix(served)) for line in scraped.text.splitlines() if line.startswith(served))

    def origin_egress(self) -> int:
        tracker = TrackerClient(self.tracker_url, token=self.issuer.mint(TRACKER_AUDIENCE))
        try:
            return tracker.origin_stats().egress_bytes
        finally:
            tracker.close()


def _start_agent(
    root: Path, node: str, port: int, token: str, control_plane_key: Path, server_tls: tls.ServerTLS | None
) -> tuple[CliProcess, Path]:
    """One `gpucloud agent` process for `node`, with its own credential and directories."""
    home = root / "agents" / node
    home.mkdir(parents=True)
    options = {
        "--node-id": node,
        "--port": str(port),
        "--token": token,
        "--control-plane-key": str(control_plane_key),
        "--state-dir": str(home / "state"),
        "--weights-dir": str(home / "weights"),
        "--scratch-dir": str(home / "scratch"),
        "--token-file": str(home / "credential"),
        "--spool": str(home / "spool.db"),
        "--heartbeat-s": "3600",
        "--reading-s": "3600",
        "--metrics-token": METRICS_TOKEN,
    }
    if server_tls is not None:
        options |= {
            "--tls-cert": str(server_tls.cert_file),
            "--tls-key": str(server_tls.key_file),
            "--ca-file": str(root / "tls" / "ca.pem"),
        }
    # GPUCLOUD_API__PORT=1: the control plane's report endpoints are not part of this test.
    env = {"PATH": os.environ["PATH"], "GPUCLOUD_DATA_DIR": str(home), "GPUCLOUD_API__PORT": "1"}
    # Forked from the test process's server that imported the CLI (`support/forked.py`): a fresh
    # interpreter spends about 1.5 CPU-seconds importing before it serves.
    process = CliProcess(
        ["agent", "--allow-simulated", *itertools.chain(*options.items())],
        env=env,
        log_path=home / "agent.log",
    )
    return process, home / "weights"


def _wait_healthy(url: str, process: CliProcess) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the agent at {url} exited"
        try:
            if httpx.get(f"{url}/healthz", timeout=1, verify=tls.client_verify()).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the agent at {url} did not come up")


def _enroll(db: Database, urls: dict[str, str]) -> dict[str, str]:
    """The nodes as the control plane holds them (in the tenant's allocation, at their agents'
    addresses), and each one's own agent credential."""
    with Session(db.engine) as session:
        for i, (node, url) in enumerate(urls.items()):
            session.add(
                Node(
                    id=node,
                    hostname=node,
                    region="site-1",
                    pod="pod-1",
                    rack=f"rack-{i // 2}",
                    gpu_type="H100",
                    gpu_count=8,
                    agent_url=url,
                    state="active",
                    allocation_id=ALLOCATION,
                    tenant_id=TENANT,
                )
            )
        session.flush()
        tokens = {node: agent_credentials.issue(session, node) for node in urls}
        session.commit()
    return tokens


@pytest.fixture
def agents(db_url: str, secure: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agents]:
    settings = Settings(data_dir=tmp_path, database={"url": db_url})
    server_tls = None
    if secure:
        ca = tls.LocalCA(tmp_path / "tls")
        server_tls = ca.issue("server", ["127.0.0.1", "localhost"])
        # This process's clients (the worker's, the test's) trust the private CA for this test only.
        monkeypatch.setattr(tls, "_ca_files", list(tls._ca_files))
        monkeypatch.setattr(tls, "_context", None)
        tls.trust(ca.cert_file)
    issuer = bootstrap.token_issuer(settings)  # the key, and the public half agents and tracker read
    db, signer = Database(db_url), Signer.generate()
    with Session(db.engine) as session:  # the tenant's registered signing key, sent with each prefetch
        session.add(SigningKey(tenant_id=TENANT, key_id=signer.key_id, public_key=bytes(signer.verify_key).hex()))
        session.commit()
    with ExitStack() as stack:
        tracker = PeerServer(create_deployment_tracker(settings), tls=server_tls)
        tracker_url = tracker.start()
        stack.callback(tracker.stop)
        ports = {f"node-{i}": free_port() for i in range(K)}
        urls = {node: f"{tls.scheme(server_tls)}://127.0.0.1:{port}" for node, port in ports.items()}
        tokens = _enroll(db, urls)
        key = public_key_path(settings.issuer_key_path)
        started = {node: _start_agent(tmp_path, node, ports[node], tokens[node], key, server_tls) for node in urls}
        for process, _ in started.values():
            stack.callback(process.wait, timeout=30)
            stack.callback(process.terminate)
        for node, (process, _) in started.items():
            _wait_healthy(urls[node], process)
        stores = bootstrap.registry_stores(settings)
        weights = {node: path for node, (_, path) in started.items()}
        fleet = Agents(settings, db, issuer, signer, stores, tracker_url, urls, weights)
        for node, url in urls.items():  # the allocation's provision: the node holds the tenant
            provisioned = httpx.post(
                f"{url}/actions/provision",
                json={"request_id": f"p-{node}", "tenant_id": TENANT},
                headers=fleet.headers(node),
                verify=tls.client_verify(),
                timeout=30,
            )
            assert provisioned.status_code == 200, provisioned.text
        yield fleet


def rollout_worker(client: Client, fleet: Agents, task_queue: str):
    activities = RolloutActivities(
        tracker_url=fleet.tracker_url, manifests=fleet.stores.manifests, db=fleet.db, issuer=fleet.issuer
    )
    return rollout_worker_with(client, activities, task_queue)


async def start(client: Client, task_queue: str, digest: str, **options) -> WorkflowHandle:
    rollout_id = f"rollout-{uuid.uuid4().hex[:10]}"
    inp = RolloutInput(
        rollout_id=rollout_id,
        tenant_id=TENANT,
        model_version=digest,
        allocation_id=ALLOCATION,
        waves=[WaveSpec(nodes=1), WaveSpec(fraction=1.0)],
        evaluation=SANITY,
        **{"bake_s": 0.2} | options,
    )
    return await client.start_workflow(RolloutWorkflow.run, inp, id=rollout_id, task_queue=task_queue)


# Agents, peers and the tracker over HTTP, with and without TLS; the database is only underneath
# (the rollout's rows on Postgres: tests/weights/test_rollout_api.py), so SQLite.
@pytest.mark.parametrize(
    ("db_url", "secure"),
    [
        pytest.param("sqlite", False, id="plain"),
        pytest.param("sqlite", True, id="tls"),
    ],
    indirect=["db_url"],
)
async def test_a_staged_rollout_reaches_real_agents_through_peers_and_rolls_every_node_back(
    temporal_env, agents: Agents, tmp_path: Path
) -> None:
    base_dir = float_model(tmp_path / "base", np.random.default_rng(5))
    base = await asyncio.to_thread(agents.push, base_dir)
    broken = await asyncio.to_thread(
        agents.push, float_model(tmp_path / "broken", np.random.default_rng(5), scale=1.02, nan=True)
    )
    tuned = await asyncio.to_thread(agents.push, float_model(tmp_path / "tuned", np.random.default_rng(5), scale=1.02))
    nodes = sorted(agents.urls)
    size = base.manifest.total_size
    assert size > 2 * KiB * KiB and len(base.manifest.chunk_ids()) > 8
    client, task_queue = temporal_env.client, f"rollout-{uuid.uuid4().hex[:8]}"
    async with rollout_worker(client, agents, task_queue):
        handle = await start(client, task_queue, base.digest)
        first: RolloutResult = await handle.result()
        progress = await handle.query(RolloutWorkflow.progress)
        assert first.status == RolloutPhase.SUCCEEDED, first.reason
        assert [len(w) for w in progress.waves] == [1, K - 1]
        assert sorted(first.activated) == nodes
        canary = progress.waves[0][0]
        assert progress.outcomes[canary].evaluations["sanity"]["nan_inf_count"] == 0  # evaluated on the node
        for node in nodes:
            assert agents.status(node)["active"] == base.digest
            assert agents.files(node, base.digest) == tree(base_dir)  # real bytes, as pushed
        # About one copy left the origin, though K nodes hold the version: the rest came from peers.
        egress = await asyncio.to_thread(agents.origin_egress)
        assert size <= egress < 1.5 * size, (egress, size)
        peers = sum([await asyncio.to_thread(agents.peer_served, node) for node in nodes])
        assert peers >= K * size - egress, (peers, egress, size)

        # A fine-tune with a NaN: the canary's evaluation fails it and the canary rolls back.
        refused = await (await start(client, task_queue, broken.digest)).result()
        assert refused.status == RolloutPhase.ROLLED_BACK
        assert "wave 1 check" in refused.reason and "nan_inf_count (sanity)=1" in refused.reason
        assert refused.activated == refused.rolled_back == [canary]
        assert {agents.status(node)["active"] for node in nodes} == {base.digest}

        # A clean fine-tune reaches every node, then an abort during the last bake rolls every one
        # of them back (each wave bakes `bake_s`: long enough to abort in, short for the canary's).
        handle = await start(client, task_queue, tuned.digest, bake_s=5)
        deadline = asyncio.get_running_loop().time() + 60
        while (progress := await handle.query(RolloutWorkflow.progress)).wave < 2 or len(progress.activated) < K:
            assert asyncio.get_running_loop().time() < deadline, progress
            assert progress.phase not in FINISHED, progress
            await asyncio.sleep(0.05)
        await handle.execute_update(RolloutWorkflow.abort, ReasonInput(reason="latency regression"))
        aborted = await handle.result()
    assert aborted.status == RolloutPhase.ROLLED_BACK and aborted.reason == "aborted: latency regression"
    assert sorted(aborted.rolled_back) == nodes
    for node in nodes:
        status = agents.status(node)
        assert status["active"] == base.digest, status
        assert agents.files(node, base.digest) == tree(base_dir)
