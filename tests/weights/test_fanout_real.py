"""Real bytes over real HTTP: a tracker with its origin, and 16 agents, each its own uvicorn server.

A model is pushed to a local chunk store; every agent prefetches it through the tracker's plan
(rack-local peers, other racks, the origin last), assembles and activates it. Checked: every
node ends with the same verified files, the origin sends about one copy, a peer serving bad
bytes is reported and skipped without any node activating them, activation is atomic for a
reader, and rollback restores the previous version.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Response

from gpucloud.agent.chunk_cache import ChunkCache, NoPreviousVersionError
from gpucloud.agent.peer import ChunkFetcher, FetchStats, PeerServer, create_peer_app, prefetch
from gpucloud.entrypoints.tracker import create_tracker_app
from gpucloud.registry.chunking import ChunkPolicy, encode_safetensors_header
from gpucloud.registry.manifest import Keyring, SignedManifest, Signer
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.store import LocalChunkStore, LocalManifestStore
from gpucloud.registry.swarm import PeerPlace, SwarmSpec
from gpucloud.registry.tracker_client import TrackerClient

pytestmark = pytest.mark.integration

TENANT = "acme"
NODES, PER_RACK = 16, 4
KiB = 1024
POLICY = ChunkPolicy(max_chunk_size=128 * KiB, pack_size=32 * KiB, fixed_chunk_size=128 * KiB, read_size=KiB * KiB)


@dataclass
class Agent:
    node: str
    rack: str
    cache: ChunkCache
    server: PeerServer


@dataclass
class Fleet:
    root: Path
    store: LocalChunkStore
    signer: Signer
    tracker: TrackerClient
    agents: list[Agent]

    def push(self, name: str, files: dict[str, bytes]) -> SignedManifest:
        source = self.root / "sources" / name
        for relative, data in files.items():
            (source / relative).parent.mkdir(parents=True, exist_ok=True)
            (source / relative).write_bytes(data)
        manifests = LocalManifestStore(self.root / "manifests")
        return push(
            source,
            model="llama-mini",
            target=StoreTarget(self.store, manifests, settle_seconds=0),
            signer=self.signer,
            policy=POLICY,
        ).signed

    def register(self, swarm: str, signed: SignedManifest, extra: dict[str, PeerPlace] | None = None) -> None:
        nodes = {a.node: PeerPlace(rack=a.rack, site="site-1", url=a.server.url) for a in self.agents}
        chunks = sorted(signed.manifest.chunk_ids())
        self.tracker.register_swarm(swarm, SwarmSpec(nodes=nodes | (extra or {}), chunks=chunks))

    def fan_out(self, swarm: str, signed: SignedManifest, *, activate: bool = True) -> dict[str, FetchStats]:
        def one(agent: Agent) -> FetchStats:
            fetcher = ChunkFetcher(node=agent.node, cache=agent.cache, tracker=self.tracker, swarm=swarm)
            try:
                result = prefetch(signed, cache=agent.cache, fetcher=fetcher)
            finally:
                fetcher.close()
            if activate:
                agent.cache.activate(signed.digest)
            return result.stats

        with ThreadPoolExecutor(len(self.agents)) as pool:
            return dict(zip((a.node for a in self.agents), pool.map(one, self.agents), strict=True))


def model_files(seed: int, *, config: bytes = b'{"layers": 4}') -> dict[str, bytes]:
    rng = random.Random(seed)
    tensors = {f"layers.{i}.weight": rng.randbytes(180 * KiB + 37 * i) for i in range(16)}
    tensors |= {f"layers.{i}.norm": rng.randbytes(3 * KiB) for i in range(16)}
    header = encode_safetensors_header((name, len(data)) for name, data in tensors.items())
    return {
        "model.safetensors": header + b"".join(tensors.values()),
        "config.json": config,
        "tokenizer/vocab.bin": rng.randbytes(300 * KiB),
    }


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


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
            cache = ChunkCache(tmp_path / f"node-{i:02d}", keyring=keyring, tenant=TENANT)
            server = PeerServer(create_peer_app(cache))
            servers.append(server)
            server.start()
            agents.append(Agent(f"node-{i:02d}", f"rack-{i // PER_RACK}", cache, server))
        yield Fleet(tmp_path, store, signer, tracker, agents)
        tracker.close()
    finally:
        with ThreadPoolExecutor(len(servers)) as pool:  # each waits out its connections: in parallel
            list(pool.map(PeerServer.stop, servers))


def test_every_node_ends_with_identical_verified_files_and_the_origin_sends_one_copy(fleet: Fleet) -> None:
    files = model_files(1)
    signed = fleet.push("v1", files)
    fleet.register("v1", signed)

    stats = fleet.fan_out("v1", signed)

    size = signed.manifest.total_size
    for agent in fleet.agents:
        assert agent.cache.active() == signed.digest
        assert read_tree(agent.cache.current_path) == files
    egress = fleet.tracker.origin_stats().egress_bytes
    assert size <= egress <= 1.2 * size
    assert sum(s.origin_bytes for s in stats.values()) == egress
    assert sum(s.peer_bytes for s in stats.values()) >= (NODES - 1.2) * size
    assert all(s.bad_chunks == 0 for s in stats.values())
    assert fleet.tracker.status("v1").complete_nodes == sorted(a.node for a in fleet.agents)


def liar_app(hits: list[str]) -> FastAPI:
    """A peer that claims every chunk and serves bytes of the right length that are not it."""
    app = FastAPI()

    @app.get("/chunks/{chunk_id}")
    def chunk(chunk_id: str) -> Response:
        hits.append(chunk_id)
        return Response(os.urandom(128 * KiB), media_type="application/octet-stream")

    return app


def test_a_peer_serving_corrupted_chunks_is_reported_and_skipped_and_nobody_activates_them(
    fleet: Fleet,
) -> None:
    files = model_files(2)
    signed = fleet.push("v1", files)
    hits: list[str] = []
    with PeerServer(liar_app(hits)) as liar:
        fleet.register("v1", signed, {"liar": PeerPlace(rack="rack-0", site="site-1", url=liar.url)})
        fleet.tracker.announce("v1", "liar", sorted(signed.manifest.chunk_ids()))

        stats = fleet.fan_out("v1", signed)

    for agent in fleet.agents:
        assert agent.cache.active() == signed.digest
        assert read_tree(agent.cache.current_path) == files
    bad = sum(s.bad_chunks for s in stats.values())
    assert bad == len(hits) >= 1
    assert fleet.tracker.status("v1").bad_reports == bad
    # Three strikes quarantine the liar; only transfers already handed out reach it after that.
    assert len(hits) <= 12
    size = signed.manifest.total_size
    assert fleet.tracker.origin_stats().egress_bytes <= 1.2 * size + len(hits) * 128 * KiB


def test_activation_is_atomic_and_rollback_restores_the_previous_version(fleet: Fleet) -> None:
    v1_files = model_files(3)
    v2_files = model_files(3, config=b'{"layers": 4, "rope": 2}')
    v2_files["model.safetensors"] = v1_files["model.safetensors"][: -100 * KiB] + os.urandom(100 * KiB)
    v1, v2 = fleet.push("v1", v1_files), fleet.push("v2", v2_files)
    fleet.register("v1", v1)
    fleet.fan_out("v1", v1)
    egress_v1 = fleet.tracker.origin_stats().egress_bytes

    fleet.register("v2", v2)
    stats = fleet.fan_out("v2", v2, activate=False)
    changed = v2.manifest.chunk_ids() - v1.manifest.chunk_ids()
    changed_bytes = sum(c.size for e in v2.manifest.files.values() for c in e.chunks if c.id in changed)
    assert fleet.tracker.origin_stats().egress_bytes - egress_v1 <= 1.2 * changed_bytes
    assert all(s.peer_bytes + s.origin_bytes <= changed_bytes for s in stats.values())

    watched = fleet.agents[0].cache
    seen: set[bytes] = set()
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.add((watched.current_path / "config.json").read_bytes())
            except BaseException as exc:  # a missing or half-switched file would land here
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(5):
            watched.activate(v2.digest)
            watched.rollback()
        for agent in fleet.agents:
            agent.cache.activate(v2.digest)
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert seen <= {v1_files["config.json"], v2_files["config.json"]}

    for agent in fleet.agents:
        assert (agent.cache.active(), agent.cache.previous()) == (v2.digest, v1.digest)
        assert read_tree(agent.cache.current_path) == v2_files
        assert agent.cache.rollback() == v1.digest
        assert read_tree(agent.cache.current_path) == v1_files
        with pytest.raises(NoPreviousVersionError):
            agent.cache.rollback()


def test_the_tracker_refuses_unknown_swarms_nodes_and_conflicting_specs(fleet: Fleet) -> None:
    signed = fleet.push("v1", model_files(4))
    fleet.register("v1", signed)
    fleet.register("v1", signed)  # the same spec again is a no-op
    with pytest.raises(httpx.HTTPStatusError) as conflict:
        fleet.tracker.register_swarm(
            "v1",
            SwarmSpec(
                nodes={"other": PeerPlace(rack="r", site="s", url="http://x")},
                chunks=[next(iter(signed.manifest.chunk_ids()))],
            ),
        )
    assert conflict.value.response.status_code == 409
    for call in (
        lambda: fleet.tracker.plan("nope", "node-00", slots=1),
        lambda: fleet.tracker.plan("v1", "stranger", slots=1),
    ):
        with pytest.raises(httpx.HTTPStatusError) as missing:
            call()
        assert missing.value.response.status_code == 404
    chunk = next(iter(signed.manifest.chunk_ids()))
    with pytest.raises(httpx.HTTPStatusError) as refused:
        fleet.tracker.report_bad("v1", "node-00", peer="origin", chunk=chunk)
    assert refused.value.response.status_code == 422
    response = httpx.get(f"{fleet.tracker.base_url}/origin/chunks/{'0' * 64}")
    assert response.status_code == 404
