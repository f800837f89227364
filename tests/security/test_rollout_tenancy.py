"""Issue 37, item 3 and item 10's swarm tokens: a rollout's weights and tokens never reach a node
that left the tenant's allocation, and a peer cannot replay another node's token as that node.

Before: targets were resolved once, so later waves sent the tenant's signed manifest and a
30-minute swarm token to whatever node answered at a released node's address; the tracker and
the origin honoured the token until it expired; and the one token a node showed the tracker it
also sent to every peer it fetched from, which could then announce and fetch as that node."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select
from temporalio.testing import ActivityEnvironment

from gpucloud.activities.rollout import RolloutActivities
from gpucloud.adapters.host_agent import HttpHostAgents
from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.agent.peer import ChunkFetcher
from gpucloud.db import Database
from gpucloud.entrypoints.tracker import DatabaseHolders, SwarmHolders, create_tracker_app
from gpucloud.models.registry_tables import GateSpec
from gpucloud.models.rollout_messages import RolloutEvaluation, RolloutTarget, WaveInput
from gpucloud.models.tables import Node
from gpucloud.registry.manifest import ChunkRef, FileEntry, Keyring, Manifest, digest_bytes
from gpucloud.registry.store import LocalChunkStore
from gpucloud.registry.swarm import PeerPlace, SwarmSpec
from gpucloud.registry.tracker_client import TrackerClient
from gpucloud.web.service_tokens import (
    SWARM_MEMBER,
    SWARM_PEER,
    TRACKER_AUDIENCE,
    Verifier,
    load_or_create_issuer,
    swarm_audience,
)

pytestmark = pytest.mark.integration

CHUNK = b"alice's weights" * 100
A = digest_bytes(CHUNK)
NODES = {n: PeerPlace(rack="r1", site="s1", url=f"http://{n}") for n in ("n1", "n2")}
SPEC = SwarmSpec(nodes=NODES, chunks=[A], tenant="alice")


@pytest.fixture
def issuer(tmp_path):
    return load_or_create_issuer(tmp_path / "issuer_key.pem")


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _token(issuer, node: str, *, role: str = SWARM_MEMBER, allocation: str | None = "al-1") -> str:
    return issuer.mint(swarm_audience("r1"), subject=f"node:{node}", role=role, tenant="alice", allocation=allocation)


def _add_nodes(db: Database, **allocations: str) -> None:
    with Session(db.engine) as session:
        for node, allocation in allocations.items():
            session.add(
                Node(
                    id=node,
                    hostname=node,
                    region="s1",
                    pod="p1",
                    rack="r1",
                    gpu_type="H100",
                    gpu_count=8,
                    agent_url=f"http://{node}",
                    state="active",
                    allocation_id=allocation,
                    tenant_id="alice",
                )
            )
        session.commit()


def _move(db: Database, node: str, **changes: object) -> None:
    with Session(db.engine) as session:
        row = session.exec(select(Node).where(Node.id == node)).one()
        for name, value in changes.items():
            setattr(row, name, value)
        session.add(row)
        session.commit()


def _tracker(issuer, tmp_path, db: Database | None = None) -> TestClient:
    store = LocalChunkStore(tmp_path / "chunks")
    store.put(A, CHUNK)
    # fresh_s=0: every call reads the DB, so the test sees a release at once.
    holders = SwarmHolders(DatabaseHolders(db), fresh_s=0.0) if db is not None else None
    app = create_tracker_app(tenant_chunks=lambda tenant: store, verifier=Verifier(issuer.public_key), holders=holders)
    client = TestClient(app)
    control = _bearer(issuer.mint(TRACKER_AUDIENCE))
    assert client.put("/tracker/swarms/r1", json=SPEC.model_dump(), headers=control).status_code == 200
    return client


def test_the_token_a_peer_sees_opens_nothing_at_the_tracker_or_the_origin(issuer, tmp_path):
    """n1 fetches a chunk from its peer n2; n2 replays what it was shown to act as n1: refused."""
    shown: list[str] = []

    def peer_n2(request: httpx.Request) -> httpx.Response:
        shown.append(request.headers["authorization"])
        return httpx.Response(200, stream=httpx.ByteStream(CHUNK))

    member, peer = _token(issuer, "n1"), _token(issuer, "n1", role=SWARM_PEER)
    with _tracker(issuer, tmp_path) as tracker:
        n2 = _bearer(_token(issuer, "n2"))
        held = {"node": "n2", "chunks": [A]}
        assert tracker.post("/tracker/swarms/r1/announce", json=held, headers=n2).status_code == 204
        client = TrackerClient(str(tracker.base_url), token=member, http=tracker)
        cache = ChunkCache(tmp_path / "n1", keyring=Keyring(), tenant="alice")
        fetcher = ChunkFetcher(
            node="n1",
            cache=cache,
            tracker=client,
            swarm="r1",
            peer_token=peer,
            http=httpx.Client(transport=httpx.MockTransport(peer_n2)),
        )
        entry = FileEntry(size=len(CHUNK), chunks=[ChunkRef(id=A, offset=0, size=len(CHUNK))])
        manifest = Manifest.build(model="m", files={"w": entry})
        stats = fetcher.fetch(manifest)
        assert stats.peer_bytes == len(CHUNK) and stats.origin_bytes == 0
        assert shown == [f"Bearer {peer}"]  # the peer saw the peer token, never the member token

        replayed = {"Authorization": shown[0]}
        plan = {"node": "n1", "slots": 1}
        assert tracker.post("/tracker/swarms/r1/plan", json=plan, headers=replayed).status_code == 401
        lie = {"node": "n1", "chunks": [A]}
        assert tracker.post("/tracker/swarms/r1/announce", json=lie, headers=replayed).status_code == 401
        assert tracker.get(f"/origin/chunks/{A}?swarm=r1", headers=replayed).status_code == 401
        # n1's own member token still works, for n1 only.
        assert tracker.post("/tracker/swarms/r1/plan", json=plan, headers=_bearer(member)).status_code == 200


def test_a_swarm_token_stops_at_the_tracker_and_origin_when_its_node_leaves_the_allocation(issuer, tmp_path, db_url):
    db = Database(db_url)
    _add_nodes(db, n1="al-1", n2="al-1")
    n1, n2 = _bearer(_token(issuer, "n1")), _bearer(_token(issuer, "n2"))
    with _tracker(issuer, tmp_path, db) as tracker:
        held = {"node": "n1", "chunks": [A]}
        assert tracker.post("/tracker/swarms/r1/announce", json=held, headers=n1).status_code == 204
        assert tracker.get(f"/origin/chunks/{A}?swarm=r1", headers=n1).content == CHUNK
        # A token naming another allocation than the node's is refused, though signed.
        other = _bearer(_token(issuer, "n2", allocation="al-2"))
        plan_n2 = {"node": "n2", "slots": 1}
        assert tracker.post("/tracker/swarms/r1/plan", json=plan_n2, headers=other).status_code == 401

        _move(db, "n1", state="releasing")  # the tenant lets n1 go: its token dies now, not in minutes
        assert tracker.post("/tracker/swarms/r1/plan", json={"node": "n1", "slots": 1}, headers=n1).status_code == 401
        assert tracker.get(f"/origin/chunks/{A}?swarm=r1", headers=n1).status_code == 401
        # ... and n1 is offered to no peer as a source again (whoever holds it next sees nothing).
        plan = tracker.post("/tracker/swarms/r1/plan", json=plan_n2, headers=n2)
        assert plan.status_code == 200, plan.text
        assert "n1" not in plan.json()["urls"]
        assert all("n1" not in a["sources"] for a in plan.json()["assignments"])

        _move(db, "n2", allocation_id="al-9")  # moved to another allocation: the old token is dead too
        assert tracker.get(f"/origin/chunks/{A}?swarm=r1", headers=n2).status_code == 401


class _Signed:
    """Stands in for a signed manifest: the activities send it as JSON, the fake agents ignore it."""

    manifest = Manifest.build(model="m", files={})

    def model_dump(self, mode: str) -> dict:
        return {"digest": "d" * 64}


async def test_a_step_sends_nothing_to_a_node_that_left_and_the_canary_command_is_read_again(issuer, db_url):
    """prefetch_wave drops a released node before it sends; check_wave drops one released while
    its probe ran, before the model's evaluation command goes out."""
    db = Database(db_url)
    _add_nodes(db, n1="al-1", n2="al-1", n3="al-1")
    _move(db, "n2", state="wiping", allocation_id=None)  # released after the rollout resolved it
    _move(db, "n3", tenant_id="bob", allocation_id="al-bob")  # wiped and now another tenant's
    sent: list[tuple[str, str]] = []

    def agents(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.host, request.url.path))
        if request.url.path == "/weights/check":
            _move(db, "n1", state="draining")  # n1 leaves while its probe answers
            body = {"active": "d" * 64, "previous": None, "healthy": True, "eval_score": 1.0}
            return httpx.Response(200, json=body | {"health_detail": ""})
        return httpx.Response(200, json={"active": None, "previous": None})

    activities = RolloutActivities(
        tracker_url="http://tracker",
        manifests=lambda tenant: type("Store", (), {"get": lambda self, digest: _Signed()})(),
        db=db,
        agents=HttpHostAgents(issuer=issuer, transport=httpx.MockTransport(agents)),
        issuer=issuer,
    )
    nodes = [RolloutTarget(node_id=n, agent_url=f"http://{n}", allocation_id="al-1") for n in ("n1", "n2", "n3")]
    req = WaveInput(rollout_id="r", tenant_id="alice", model_version="d" * 64, swarm="r1", nodes=nodes)
    env = ActivityEnvironment()
    prefetched = await env.run(activities.prefetch_wave, req)
    assert [o.node_id for o in prefetched.outcomes] == ["n1"]
    assert prefetched.dropped == {
        "n2": "the node left the tenant's allocation",
        "n3": "the node is no longer the tenant's",
    }
    assert sent == [("n1", "/weights/prefetch")]  # no manifest, no token for n2 or n3

    sent.clear()
    gates = [GateSpec(metric="finite", min=1.0, evaluator="sanity")]
    checked = await env.run(
        activities.check_wave, req.model_copy(update={"evaluation": RolloutEvaluation(gates=gates)})
    )
    assert sent == [("n1", "/weights/check")]  # the evaluation never went out
    assert checked.outcomes == [] and checked.dropped["n1"] == "the node left the tenant's allocation"
    await activities.aclose()
