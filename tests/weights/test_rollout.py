"""The staged rollout end to end: the real Temporal dev server, a worker in the test running just
the rollout workflow and its activities, and 8 real agents (chunk cache, peer server and the
weights API, each its own uvicorn server on loopback) fed by a real tracker and origin.

Checked: a rollout activates the version everywhere with identical verified files; a canary whose
evaluation probe scores below the threshold, or a node that turns unhealthy, rolls every
activated node back; an abort mid-wave rolls back what was activated; a worker stopped during a
bake is replaced and the rollout completes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from sqlmodel import Session
from temporalio.client import Client, WorkflowHandle

from gpucloud.activities.rollout import RolloutActivities
from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.agent.peer import ChunkFetcher, PeerServer, create_peer_app, prefetch
from gpucloud.agent.weights_api import install_weights_api
from gpucloud.db import Database
from gpucloud.entrypoints.tracker import create_tracker_app
from gpucloud.models import search_attributes
from gpucloud.models.registry_tables import EvaluationCommand, GateSpec
from gpucloud.models.rollout_messages import (
    ReasonInput,
    RolloutEvaluation,
    RolloutInput,
    RolloutPhase,
    RolloutProgress,
    RolloutResult,
    RolloutTarget,
    Thresholds,
)
from gpucloud.models.tables import Node
from gpucloud.registry.chunking import ChunkPolicy
from gpucloud.registry.manifest import Keyring, SignedManifest, Signer, VersionNotFoundError
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.store import LocalChunkStore, LocalManifestStore
from gpucloud.registry.swarm import PeerPlace, SwarmSpec
from gpucloud.registry.tracker_client import TrackerClient
from gpucloud.workflows.rollout import RolloutWorkflow
from support.models import float_model
from support.rollouts import rollout_worker_with

pytestmark = pytest.mark.integration

TENANT = "acme"
NODES, PER_RACK = 8, 4
KiB = 1024
POLICY = ChunkPolicy(max_chunk_size=64 * KiB, pack_size=16 * KiB, fixed_chunk_size=64 * KiB, read_size=KiB * KiB)


def eval_from_config(cache: ChunkCache, digest: str) -> float:
    """The test's evaluation probe: the score a version's config.json claims (1.0 if none)."""
    return json.loads((cache.current_path / "config.json").read_bytes()).get("eval", 1.0)


@dataclass
class Agent:
    node: str
    rack: str
    cache: ChunkCache
    server: PeerServer
    health: dict = field(default_factory=lambda: {"ok": True})

    def target(self) -> RolloutTarget:
        return RolloutTarget(node_id=self.node, agent_url=self.server.url, rack=self.rack, allocation_id="alloc-1")


@dataclass
class Fleet:
    root: Path
    signer: Signer
    manifests: LocalManifestStore
    store: LocalChunkStore
    tracker: TrackerClient
    agents: list[Agent]

    def push(self, name: str, *, eval_score: float | None = None, seed: int = 1) -> tuple[SignedManifest, dict]:
        source = self.root / "sources" / name
        config = {"name": name} | ({"eval": eval_score} if eval_score is not None else {})
        files = {"model.bin": uuid.UUID(int=seed).bytes * (12 * KiB), "config.json": json.dumps(config).encode()}
        for relative, data in files.items():
            (source / relative).parent.mkdir(parents=True, exist_ok=True)
            (source / relative).write_bytes(data)
        return self.push_dir(source), files

    def push_dir(self, source: Path) -> SignedManifest:
        return push(
            source,
            model="llama-mini",
            target=StoreTarget(self.store, self.manifests, settle_seconds=0),
            signer=self.signer,
            policy=POLICY,
        ).signed

    def install(self, signed: SignedManifest) -> None:
        """Put a version in place on every node directly (the state before a rollout)."""
        swarm = f"base-{signed.digest[:8]}"
        nodes = {a.node: PeerPlace(rack=a.rack, site="site-1", url=a.server.url) for a in self.agents}
        self.tracker.register_swarm(swarm, SwarmSpec(nodes=nodes, chunks=sorted(signed.manifest.chunk_ids())))

        def one(agent: Agent) -> None:
            fetcher = ChunkFetcher(node=agent.node, cache=agent.cache, tracker=self.tracker, swarm=swarm)
            try:
                prefetch(signed, cache=agent.cache, fetcher=fetcher)
            finally:
                fetcher.close()
            agent.cache.activate(signed.digest)

        with ThreadPoolExecutor(len(self.agents)) as pool:
            list(pool.map(one, self.agents))

    def targets(self) -> list[RolloutTarget]:
        return [a.target() for a in self.agents]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    signer, keyring = Signer.generate(), Keyring()
    keyring.trust(TENANT, signer.verify_key)
    store = LocalChunkStore(tmp_path / "store")
    servers: list[PeerServer] = []
    try:
        origin = PeerServer(create_tracker_app(chunk_store=store, seed=7))
        servers.append(origin)
        tracker = TrackerClient(origin.start())
        agents = []
        for i in range(NODES):
            node = f"node-{i:02d}"
            cache = ChunkCache(tmp_path / node, keyring=keyring, tenant=TENANT)
            app = create_peer_app(cache)
            agent = Agent(node, f"rack-{i // PER_RACK}", cache, PeerServer(app))
            install_weights_api(
                app,
                node_id=node,
                cache=cache,
                eval_probe=eval_from_config,
                health=lambda h=agent.health: (h["ok"], "" if h["ok"] else "GPU 3 fell off the bus"),
            )
            servers.append(agent.server)
            agent.server.start()
            agents.append(agent)
        yield Fleet(tmp_path, signer, LocalManifestStore(tmp_path / "manifests"), store, tracker, agents)
        tracker.close()
    finally:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(PeerServer.stop, servers))


def rollout_worker(client: Client, fleet: Fleet, task_queue: str, db: Database | None = None):
    activities = RolloutActivities(tracker_url=fleet.tracker.base_url, manifests=lambda tenant: fleet.manifests, db=db)
    return rollout_worker_with(client, activities, task_queue)


@pytest.fixture
def task_queue() -> str:
    return f"rollout-{uuid.uuid4().hex[:8]}"


async def start(client: Client, fleet: Fleet, task_queue: str, signed: SignedManifest, **options) -> WorkflowHandle:
    rollout_id = f"rollout-{uuid.uuid4().hex[:10]}"
    inp = RolloutInput(
        rollout_id=rollout_id,
        tenant_id=TENANT,
        model_version=signed.digest,
        nodes=fleet.targets(),
        **{"bake_s": 0.2} | options,
    )
    return await client.start_workflow(
        RolloutWorkflow.run,
        inp,
        id=rollout_id,
        task_queue=task_queue,
        search_attributes=search_attributes.typed(
            (search_attributes.MODEL_VERSION, signed.digest), (search_attributes.TENANT_ID, TENANT)
        ),
    )


async def wait_for(handle: WorkflowHandle, predicate, timeout_s: float = 20.0) -> RolloutProgress:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        progress = await handle.query(RolloutWorkflow.progress)
        if predicate(progress):
            return progress
        assert asyncio.get_running_loop().time() < deadline, f"rollout stuck: {progress}"
        await asyncio.sleep(0.05)


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


async def test_a_rollout_activates_every_node_in_waves_with_identical_verified_files(
    temporal_env, fleet: Fleet, task_queue: str
) -> None:
    v1, _v1_files = fleet.push("v1", seed=1)
    fleet.install(v1)
    v2, v2_files = fleet.push("v2", seed=2)
    client = temporal_env.client
    async with rollout_worker(client, fleet, task_queue):
        handle = await start(client, fleet, task_queue, v2)
        result: RolloutResult = await handle.result()
        progress = await handle.query(RolloutWorkflow.progress)

    assert result.status == RolloutPhase.SUCCEEDED, result.reason
    assert [len(w) for w in progress.waves] == [1, 3, 4]  # canary; 10% of 8 is the canary again; 50%; 100%
    assert sorted(result.activated) == sorted(a.node for a in fleet.agents)
    for agent in fleet.agents:
        assert (agent.cache.active(), agent.cache.previous()) == (v2.digest, v1.digest)
        agent.cache.verify(v2.digest)
        assert read_tree(agent.cache.current_path) == v2_files
    size = v2.manifest.total_size
    assert fleet.tracker.origin_stats().egress_bytes <= 1.2 * (v1.manifest.total_size + size)
    described = await handle.describe()
    assert described.typed_search_attributes.get(search_attributes.MODEL_VERSION) == v2.digest


async def test_a_canary_below_the_eval_threshold_rolls_back_and_the_rest_never_activates(
    temporal_env, fleet: Fleet, task_queue: str
) -> None:
    v1, v1_files = fleet.push("v1", seed=1)
    fleet.install(v1)
    bad, _ = fleet.push("v2-bad", eval_score=0.31, seed=3)
    client = temporal_env.client
    async with rollout_worker(client, fleet, task_queue):
        handle = await start(client, fleet, task_queue, bad, thresholds=Thresholds(min_eval_score=0.5))
        result = await handle.result()

    assert result.status == RolloutPhase.ROLLED_BACK
    assert "wave 1 check" in result.reason and "0.31 < 0.5" in result.reason
    assert result.activated == ["node-00"] and result.rolled_back == ["node-00"]
    for agent in fleet.agents:
        assert agent.cache.active() == v1.digest
        assert read_tree(agent.cache.current_path) == v1_files


async def test_the_canary_runs_the_models_sanity_gate_and_a_nan_fine_tune_is_rolled_back(
    temporal_env, fleet: Fleet, task_queue: str, tmp_path: Path
) -> None:
    """Real fp32, fp16 and bf16 models: the canary's check runs the sanity evaluator on the node
    against the version it ran before; one NaN fails the model's gate and every node stays on the
    base, while a clean fine-tune passes the same gates and goes everywhere."""
    import numpy as np

    evaluation = RolloutEvaluation(
        gates=[GateSpec(metric="nan_inf_count", max=0), GateSpec(metric="max_rel_norm_change", max=0.5)]
    )
    base = fleet.push_dir(float_model(tmp_path / "base", np.random.default_rng(5)))
    broken = fleet.push_dir(float_model(tmp_path / "broken", np.random.default_rng(5), scale=1.02, nan=True))
    tuned = fleet.push_dir(float_model(tmp_path / "tuned", np.random.default_rng(5), scale=1.02))
    fleet.install(base)
    client = temporal_env.client
    failed_waves = REGISTRY.get_sample_value("gpucloud_rollout_waves_total", {"outcome": "failed"}) or 0
    peer_bytes = REGISTRY.get_sample_value("gpucloud_chunk_bytes_served_total", {"source": "peer"}) or 0
    async with rollout_worker(client, fleet, task_queue):
        refused = await (await start(client, fleet, task_queue, broken, evaluation=evaluation)).result()
        assert REGISTRY.get_sample_value("gpucloud_rollout_waves_total", {"outcome": "failed"}) == failed_waves + 1
        assert refused.status == RolloutPhase.ROLLED_BACK
        assert "wave 1 check" in refused.reason
        assert "nan_inf_count (sanity)=1: above the maximum 0" in refused.reason
        assert refused.activated == ["node-00"] and refused.rolled_back == ["node-00"]
        assert {a.cache.active() for a in fleet.agents} == {base.digest}

        # The model's command runs on the canary too, against the files the node now serves.
        script = "import os; print('{\"files\": %d}' % len(os.listdir(os.environ['GPUCLOUD_MODEL_DIR'])))"
        with_command = RolloutEvaluation(
            gates=[*evaluation.gates, GateSpec(metric="files", min=3)],
            command=EvaluationCommand(argv=[sys.executable, "-c", script], timeout_s=30),
        )
        handle = await start(client, fleet, task_queue, tuned, evaluation=with_command)
        passed = await handle.result()
        progress = await handle.query(RolloutWorkflow.progress)
    assert passed.status == RolloutPhase.SUCCEEDED, passed.reason
    assert {a.cache.active() for a in fleet.agents} == {tuned.digest}
    found = progress.outcomes["node-00"].evaluations["sanity"]  # the canary's, against the base
    assert found["nan_inf_count"] == 0 and abs(found["max_rel_norm_change"] - 0.02) < 0.005
    assert progress.outcomes["node-00"].evaluations["command"] == {"files": 3.0}
    assert progress.outcomes["node-07"].evaluations == {}  # later waves are not evaluated again
    # The peers (this process's agents) served chunks to each other.
    assert (REGISTRY.get_sample_value("gpucloud_chunk_bytes_served_total", {"source": "peer"}) or 0) > peer_bytes


async def test_an_unhealthy_node_in_a_later_wave_rolls_back_every_activated_node(
    temporal_env, fleet: Fleet, task_queue: str
) -> None:
    v2, _ = fleet.push("v2", seed=2)  # a fresh fleet: rollback leaves nodes running nothing, as before
    fleet.agents[2].health["ok"] = False
    client = temporal_env.client
    async with rollout_worker(client, fleet, task_queue):
        handle = await start(client, fleet, task_queue, v2)
        result = await handle.result()

    assert result.status == RolloutPhase.ROLLED_BACK
    assert "wave 2 check" in result.reason and "node-02" in result.reason and "fell off the bus" in result.reason
    assert sorted(result.rolled_back) == ["node-00", "node-01", "node-02", "node-03"]
    assert all(agent.cache.active() is None for agent in fleet.agents)


async def test_pause_holds_the_next_wave_and_abort_mid_wave_rolls_back_what_was_activated(
    temporal_env, fleet: Fleet, task_queue: str
) -> None:
    v1, v1_files = fleet.push("v1", seed=1)
    fleet.install(v1)
    v2, _ = fleet.push("v2", seed=2)
    client = temporal_env.client
    async with rollout_worker(client, fleet, task_queue):
        handle = await start(client, fleet, task_queue, v2, bake_s=0.5)
        await wait_for(handle, lambda p: p.wave == 1 and p.phase == RolloutPhase.BAKING)
        paused = await handle.execute_update(RolloutWorkflow.pause, ReasonInput(reason="looking at canary"))
        assert paused.paused
        held = await wait_for(handle, lambda p: p.phase == RolloutPhase.PAUSED)
        assert held.activated == ["node-00"]
        await handle.execute_update(RolloutWorkflow.resume, ReasonInput())
        await wait_for(handle, lambda p: p.wave == 2 and p.phase == RolloutPhase.BAKING)
        final = await handle.execute_update(RolloutWorkflow.abort, ReasonInput(reason="latency regression"))
        result = await handle.result()

    assert final.phase == result.status == RolloutPhase.ROLLED_BACK
    assert result.reason == "aborted: latency regression"
    assert sorted(result.rolled_back) == ["node-00", "node-01", "node-02", "node-03"]
    for agent in fleet.agents:
        assert agent.cache.active() == v1.digest
        assert read_tree(agent.cache.current_path) == v1_files
    with pytest.raises(Exception, match="already completed"):
        await handle.execute_update(RolloutWorkflow.pause, ReasonInput())


async def test_the_rollout_survives_a_worker_restart_during_a_bake(temporal_env, fleet: Fleet, task_queue: str) -> None:
    v2, v2_files = fleet.push("v2", seed=2)
    client = temporal_env.client
    async with rollout_worker(client, fleet, task_queue):
        handle = await start(client, fleet, task_queue, v2, bake_s=1.5)
        await wait_for(handle, lambda p: p.wave == 2 and p.phase == RolloutPhase.BAKING)
    # No worker now: the bake's timer is durable, the rollout waits for one.
    await asyncio.sleep(0.5)
    async with rollout_worker(client, fleet, task_queue):
        result = await handle.result()

    assert result.status == RolloutPhase.SUCCEEDED, result.reason
    for agent in fleet.agents:
        assert agent.cache.active() == v2.digest
        assert read_tree(agent.cache.current_path) == v2_files


async def test_a_node_released_mid_rollout_is_dropped_recorded_and_sent_nothing_more(
    temporal_env, fleet: Fleet, task_queue: str, db_url: str
) -> None:
    """Issue 37 item 3: the targets were resolved at the start; a node released while the canary
    bakes gets no manifest and no token in the later waves, and the rollout goes on without it."""
    db = Database(db_url)
    with Session(db.engine) as session:
        for agent in fleet.agents:
            session.add(
                Node(
                    id=agent.node,
                    hostname=agent.node,
                    region="site-1",
                    pod="pod-1",
                    rack=agent.rack,
                    gpu_type="H100",
                    gpu_count=8,
                    agent_url=agent.server.url,
                    state="active",
                    allocation_id="alloc-1",
                    tenant_id=TENANT,
                )
            )
        session.commit()
    v2, _ = fleet.push("v2", seed=2)
    client = temporal_env.client
    async with rollout_worker(client, fleet, task_queue, db):
        handle = await start(client, fleet, task_queue, v2, bake_s=0.3, prefetch_ahead=False)
        await wait_for(handle, lambda p: p.wave == 1 and p.phase == RolloutPhase.BAKING)
        await handle.execute_update(RolloutWorkflow.pause, ReasonInput())
        await wait_for(handle, lambda p: p.phase == RolloutPhase.PAUSED)
        with Session(db.engine) as session:
            released = session.get(Node, "node-05")
            assert released is not None
            released.state = "releasing"  # the tenant releases it; a wipe and another tenant follow
            session.add(released)
            session.commit()
        await handle.execute_update(RolloutWorkflow.resume, ReasonInput())
        result = await handle.result()
        progress = await handle.query(RolloutWorkflow.progress)

    assert result.status == RolloutPhase.SUCCEEDED, result.reason
    assert progress.dropped == {"node-05": "the node left the tenant's allocation"}
    assert "node-05" not in result.activated and len(result.activated) == NODES - 1
    dropped = next(a for a in fleet.agents if a.node == "node-05")
    with pytest.raises(VersionNotFoundError):
        dropped.cache.manifest(v2.digest)  # never sent the signed manifest (nor a token to fetch with)
    assert dropped.cache.held().isdisjoint(v2.manifest.chunk_ids())
