"""Issue 13, rows 7 and 8: the tracker, the origin and the peers answer only tokens the control
plane signed, and the tracker's swarms survive its restart.

Before: the tracker kept swarms in memory (after a restart a node's prefetch got an error and the
rollout rolled back), its writes needed no credentials, and the origin and every peer served any
tenant's chunk by id to anyone who asked."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.agent.peer import create_peer_app
from gpucloud.db import Database
from gpucloud.entrypoints.tracker import DatabaseSwarms, create_tracker_app
from gpucloud.registry.manifest import Keyring, digest_bytes
from gpucloud.registry.store import LocalChunkStore
from gpucloud.registry.swarm import PeerPlace, SwarmSpec
from gpucloud.web.service_tokens import (
    SWARM_MEMBER,
    SWARM_PEER,
    TRACKER_AUDIENCE,
    Verifier,
    load_or_create_issuer,
    swarm_audience,
)

pytestmark = pytest.mark.integration

ALICE_CHUNK, BOB_CHUNK = b"alice's weights" * 100, b"bob's weights" * 100
A, B = digest_bytes(ALICE_CHUNK), digest_bytes(BOB_CHUNK)
NODES = {n: PeerPlace(rack="r1", site="s1", url=f"http://{n}") for n in ("n1", "n2")}


@pytest.fixture
def issuer(tmp_path):
    return load_or_create_issuer(tmp_path / "issuer_key.pem")


@pytest.fixture
def stores(tmp_path) -> dict[str, LocalChunkStore]:
    made = {tenant: LocalChunkStore(tmp_path / "chunks" / tenant) for tenant in ("alice", "bob")}
    made["alice"].put(A, ALICE_CHUNK)
    made["bob"].put(B, BOB_CHUNK)
    return made


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _member(issuer, swarm: str, node: str, tenant: str) -> dict[str, str]:
    return _bearer(issuer.mint(swarm_audience(swarm), subject=f"node:{node}", role=SWARM_MEMBER, tenant=tenant))


def _peer_token(issuer, swarm: str, node: str, tenant: str) -> dict[str, str]:
    return _bearer(issuer.mint(swarm_audience(swarm), subject=f"node:{node}", role=SWARM_PEER, tenant=tenant))


def _tracker(issuer, stores, db_url: str) -> TestClient:
    app = create_tracker_app(
        tenant_chunks=stores.__getitem__, verifier=Verifier(issuer.public_key), store=DatabaseSwarms(Database(db_url))
    )
    return TestClient(app)


def test_only_the_control_plane_registers_reads_and_removes_swarms(issuer, stores, db_url):
    spec = SwarmSpec(nodes=NODES, chunks=[A], tenant="alice").model_dump()
    control = _bearer(issuer.mint(TRACKER_AUDIENCE))
    with _tracker(issuer, stores, db_url) as tracker:
        assert tracker.get("/healthz").status_code == 200
        assert tracker.put("/tracker/swarms/r1", json=spec).status_code == 401
        # A node's token for the swarm registers nothing, nor does a token for another server.
        assert (
            tracker.put("/tracker/swarms/r1", json=spec, headers=_member(issuer, "r1", "n1", "alice")).status_code
            == 401
        )
        agent_token = _bearer(issuer.mint("agent:n1"))
        assert tracker.put("/tracker/swarms/r1", json=spec, headers=agent_token).status_code == 401
        assert tracker.put("/tracker/swarms/r1", json=spec, headers=control).status_code == 200
        assert tracker.get("/tracker/swarms/r1").status_code == 401
        assert tracker.delete("/tracker/swarms/r1").status_code == 401
        assert tracker.get("/origin/stats").status_code == 401
        assert tracker.get("/tracker/swarms/r1", headers=control).json()["nodes"] == 2


def test_a_node_speaks_for_itself_in_its_own_swarm_only(issuer, stores, db_url):
    control = _bearer(issuer.mint(TRACKER_AUDIENCE))
    with _tracker(issuer, stores, db_url) as tracker:
        for name in ("r1", "r2"):
            spec = SwarmSpec(nodes=NODES, chunks=[A], tenant="alice").model_dump()
            assert tracker.put(f"/tracker/swarms/{name}", json=spec, headers=control).status_code == 200
        n1 = _member(issuer, "r1", "n1", "alice")
        plan = {"node": "n1", "slots": 1}
        assert tracker.post("/tracker/swarms/r1/plan", json=plan).status_code == 401
        assert tracker.post("/tracker/swarms/r1/plan", json=plan, headers=n1).status_code == 200
        # n1's token announces nothing for n2 (which would make n2 a source of bytes it lacks) ...
        lie = {"node": "n2", "chunks": [A]}
        assert tracker.post("/tracker/swarms/r1/announce", json=lie, headers=n1).status_code == 403
        assert tracker.put("/tracker/swarms/r1/nodes/n2", json={"chunks": [A]}, headers=n1).status_code == 403
        # ... and opens no other swarm.
        assert tracker.post("/tracker/swarms/r2/plan", json=plan, headers=n1).status_code == 401


def test_swarms_survive_a_tracker_restart_and_go_when_removed(issuer, stores, db_url):
    control = _bearer(issuer.mint(TRACKER_AUDIENCE))
    spec = SwarmSpec(nodes=NODES, chunks=[A], tenant="alice").model_dump()
    n1 = _member(issuer, "r1", "n1", "alice")
    with _tracker(issuer, stores, db_url) as tracker:
        assert tracker.put("/tracker/swarms/r1", json=spec, headers=control).status_code == 200
    with _tracker(issuer, stores, db_url) as restarted:
        planned = restarted.post("/tracker/swarms/r1/plan", json={"node": "n1", "slots": 1}, headers=n1)
        assert planned.status_code == 200, planned.text
        assert planned.json()["assignments"][0]["chunk"] == A
        assert restarted.get(f"/origin/chunks/{A}?swarm=r1", headers=n1).content == ALICE_CHUNK
        # Registering it again after the restart is the same no-op it was before; another spec conflicts.
        assert restarted.put("/tracker/swarms/r1", json=spec, headers=control).status_code == 200
        other = SwarmSpec(nodes=NODES, chunks=[B], tenant="alice").model_dump()
        assert restarted.put("/tracker/swarms/r1", json=other, headers=control).status_code == 409
        assert restarted.delete("/tracker/swarms/r1", headers=control).status_code == 204
        assert restarted.post("/tracker/swarms/r1/plan", json={"node": "n1", "slots": 1}, headers=n1).status_code == 404
    with _tracker(issuer, stores, db_url) as again:
        assert again.get("/tracker/swarms/r1", headers=control).status_code == 404


def test_the_origin_serves_a_swarms_chunks_from_its_tenants_store_to_its_nodes_only(issuer, stores, db_url):
    control = _bearer(issuer.mint(TRACKER_AUDIENCE))
    with _tracker(issuer, stores, db_url) as tracker:
        spec = SwarmSpec(nodes=NODES, chunks=[A], tenant="alice").model_dump()
        assert tracker.put("/tracker/swarms/r1", json=spec, headers=control).status_code == 200
        n1 = _member(issuer, "r1", "n1", "alice")
        assert tracker.get(f"/origin/chunks/{A}").status_code == 401  # a chunk id alone opens nothing
        assert tracker.get(f"/origin/chunks/{A}?swarm=r1").status_code == 401
        assert tracker.get(f"/origin/chunks/{A}?swarm=r1", headers=n1).content == ALICE_CHUNK
        # Bob's chunk is not in Alice's swarm: asking for it through her rollout learns nothing.
        assert tracker.get(f"/origin/chunks/{B}?swarm=r1", headers=n1).status_code == 404
        # A token naming another tenant than the swarm's is refused.
        forged = _member(issuer, "r1", "n1", "bob")
        assert tracker.get(f"/origin/chunks/{A}?swarm=r1", headers=forged).status_code == 403


def test_a_peer_serves_chunks_only_to_its_tenants_swarms(issuer, tmp_path):
    cache = ChunkCache(tmp_path / "cache", keyring=Keyring(), tenant="alice")
    cache.put(A, ALICE_CHUNK)
    with TestClient(create_peer_app(cache, verifier=Verifier(issuer.public_key))) as peer:
        assert peer.get(f"/chunks/{A}").status_code == 401
        assert peer.get(f"/chunks/{A}?swarm=r1").status_code == 401
        assert peer.get(f"/chunks/{A}?swarm=r1", headers=_peer_token(issuer, "r2", "n2", "alice")).status_code == 401
        assert peer.get(f"/chunks/{A}?swarm=r1", headers=_peer_token(issuer, "r1", "n2", "bob")).status_code == 403
        control = _bearer(issuer.mint(swarm_audience("r1")))  # the control-plane role is not a member's
        assert peer.get(f"/chunks/{A}?swarm=r1", headers=control).status_code == 401
        # The member token opens the tracker and the origin only: a node never shows it to a peer.
        assert peer.get(f"/chunks/{A}?swarm=r1", headers=_member(issuer, "r1", "n2", "alice")).status_code == 401
        got = peer.get(f"/chunks/{A}?swarm=r1", headers=_peer_token(issuer, "r1", "n2", "alice"))
        assert got.status_code == 200 and got.content == ALICE_CHUNK
