"""Issue 13, row 3: a node's agent credential does not outlive the tenant. Every wipe hands the
agent its next credential and revokes the old one, which the tenant (root on the node) held:
after the node went to another tenant, the old one used to post a fatal XID and pull the node
out of the new tenant's allocation.

Issue 37, item 4: the wipe comes too late on the drain path (release -> quarantined, repair,
RMA, without one). The credential dies the moment the allocation lets go of the node, in the
transition that does it, whatever the path: release, drain, a cancelled or failed provision."""

from __future__ import annotations

import httpx
import pytest
import sqlalchemy as sa

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.reporting import Reporter
from gpucloud.api import auth
from gpucloud.db import Database, session_scope
from gpucloud.models.messages import NodeTransitionInput
from gpucloud.models.tables import Node
from gpucloud.protocol.actions import ActionRequest
from gpucloud.services import agent_credentials
from gpucloud.services import nodes as node_service
from gpucloud.sim.probe import SimulatedProbe
from support.agents import GpuResetOnly
from support.nodes import enroll
from support.stack import async_wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

ALLOC = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}


def _node_with_credential(db_url: str, state: str) -> str:
    (node_id,) = enroll(db_url, ["n-1"])
    with session_scope(db_url) as session:
        token = agent_credentials.issue(session, node_id)
        session.execute(sa.update(Node).where(Node.id == node_id).values(state=state, allocation_id="a-1"))
    return token


def _resolves(db_url: str, token: str) -> bool:
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as connection:
            return auth.resolve(connection, token, "operator-token") is not None
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("state", "event"),
    [
        ("active", "release"),  # a normal release, a cancel, an offboarding
        ("active", "drain"),  # pulled mid-allocation (replacement, health, an operator's drain)
        ("provisioning", "fail"),  # a failed provision, or one cancelled half way
        ("provisioning", "deadline"),
    ],
)
def test_the_transition_that_ends_the_allocation_revokes_the_credential(db_url, state, event):
    token = _node_with_credential(db_url, state)
    assert _resolves(db_url, token)
    with session_scope(db_url) as session:
        node_service.transition(session, "n-1", event, from_state=state)
    assert not _resolves(db_url, token)


def test_a_batch_of_transitions_revokes_as_one_does(db_url):
    token = _node_with_credential(db_url, "active")
    with session_scope(db_url) as session:
        (outcome,) = node_service.transition_many(
            session, [NodeTransitionInput(node_id="n-1", event="drain", from_state="active", op_id="op-1")]
        )
    assert outcome == ("n-1", "draining", None) and not _resolves(db_url, token)


@pytest.mark.parametrize(("state", "event"), [("reserved", "unreserve"), ("provisioning", "ok")])
def test_a_node_no_tenant_had_or_still_has_keeps_its_credential(db_url, state, event):
    token = _node_with_credential(db_url, state)
    with session_scope(db_url) as session:
        node_service.transition(session, "n-1", event, from_state=state)
    assert _resolves(db_url, token)


def test_only_the_next_wipes_credential_lifts_the_revocation(db_url):
    token = _node_with_credential(db_url, "active")
    rotation = agent_credentials.WipeRotation(Database(db_url), "secret")
    rotation.commit("n-1", "wipe-before")  # the wipe before the allocation
    old = rotation.next_token("n-1", "wipe-before")
    assert _resolves(db_url, old) and not _resolves(db_url, token)
    with session_scope(db_url) as session:
        node_service.transition(session, "n-1", "release", from_state="active")
    rotation.commit("n-1", "wipe-before")  # a late retry of that commit revives nothing
    assert not _resolves(db_url, old)
    rotation.commit("n-1", "wipe-after")
    assert _resolves(db_url, rotation.next_token("n-1", "wipe-after"))


async def test_a_wipe_replaces_the_node_credential_and_the_old_one_gets_401(db_url, make_harness, in_process_worker):
    h = make_harness(db_url, nodes=1)
    await in_process_worker(h.settings)
    (node_id,) = h.enroll_fleet()
    await h.wait_states({"available": 1}, timeout_s=90)
    with h.operator as op:
        old = op.post(f"/v1/nodes/{node_id}/agent-credential").json()["token"]
    beat = {"heartbeats": [{"node_id": node_id}]}
    with h.client(old) as agent:
        assert agent.post("/v1/agents/heartbeats", json=beat).status_code == 200

    _, key = await h.onboard()
    with h.client(key) as tenant:
        alloc_id = tenant.post("/v1/allocations", json=ALLOC).json()["allocation"]["id"]
        await h.wait_allocation(key, alloc_id, "ready")
        assert tenant.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202
    await h.wait_allocation(key, alloc_id, "released")
    await h.wait_states({"available": 1}, timeout_s=90)  # wiped and burnt in

    new = h.sim.client.credential(node_id)
    assert new and new.startswith(f"gpa_{node_id}.") and new != old
    with h.client(old) as agent:
        assert agent.post("/v1/agents/heartbeats", json=beat).status_code == 401
        event = {"node_id": node_id, "gpu_index": 0, "xid": 79, "timestamp": "2026-01-01T00:00:00Z"}
        assert agent.post("/v1/agents/events", json={"events": [event]}).status_code == 401
        signal = {"signal": "ib_link_down", "at": "2026-01-01T00:00:00Z"}
        report = {"node_id": node_id, "at": "2026-01-01T00:00:00Z", "observations": [signal]}
        assert agent.post("/v1/agents/signals", json={"reports": [report]}).status_code == 401
    with h.client(new) as agent:
        assert agent.post("/v1/agents/heartbeats", json=beat).status_code == 200


async def test_a_bring_up_batch_commits_every_credential_its_wipes_handed_over(ready_fleet):
    """A batch wipes many nodes in one activity and commits their credentials together: each
    node's agent then reports with the one its wipe gave it."""
    h = await ready_fleet(nodes=3, reconciler__bringup_batch_size=3)
    node_ids = h.node_ids()
    for node_id in node_ids:
        token = h.sim.client.credential(node_id)
        assert token and token.startswith(f"gpa_{node_id}.")
        with h.client(token) as agent:
            beat = {"heartbeats": [{"node_id": node_id}]}
            assert agent.post("/v1/agents/heartbeats", json=beat).status_code == 200, node_id


async def test_the_real_agent_reports_with_the_credential_its_wipe_handed_over_and_keeps_it(tmp_path):
    state = HostState(
        node_id="gpu-1",
        boot_id="b",
        scratch_dir=tmp_path / "scratch",
        credential="gpa_gpu-1.first",
        credential_file=tmp_path / "agent-credential",
    )
    agent = Agent(state, SimulatedProbe("gpu-1", gpu_count=8), runner=GpuResetOnly())
    seen: list[str] = []

    def control_plane(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["authorization"])
        return httpx.Response(200, json={})

    client = httpx.AsyncClient(base_url="http://cp", transport=httpx.MockTransport(control_plane))
    reporter = Reporter(agent, client)
    await reporter.heartbeat_once()
    wiped = await agent.act("wipe", ActionRequest(request_id="w1", credential="gpa_gpu-1.second"))
    assert wiped[0] == 200
    await reporter.heartbeat_once()
    assert seen == ["Bearer gpa_gpu-1.first", "Bearer gpa_gpu-1.second"]
    assert (tmp_path / "agent-credential").read_text().strip() == "gpa_gpu-1.second"
    assert (tmp_path / "agent-credential").stat().st_mode & 0o077 == 0
    # A wipe that fails keeps the old credential.
    state.workload_running = True
    refused = await agent.act("wipe", ActionRequest(request_id="w2", credential="gpa_gpu-1.third"))
    assert refused[0] == 409 and state.credential == "gpa_gpu-1.second"
    await client.aclose()


async def test_a_node_drained_out_of_an_allocation_answers_401_to_its_old_credential(ready_fleet):
    """The drain path has no wipe: before, the departing tenant's credential still reported for
    the quarantined node (heartbeats, XIDs, ledger tokens)."""
    h = await ready_fleet(nodes=1)
    (node_id,) = h.node_ids()
    held = h.sim.client.credential(node_id)  # what the tenant, root on the node, can read
    _, key = await h.onboard()
    with h.client(key) as tenant:
        alloc_id = tenant.post("/v1/allocations", json=ALLOC).json()["allocation"]["id"]
        await h.wait_allocation(key, alloc_id, "ready")
    beat = {"heartbeats": [{"node_id": node_id}]}
    with h.client(held) as agent:
        assert agent.post("/v1/agents/heartbeats", json=beat).status_code == 200
    assert h.operator.post(f"/v1/nodes/{node_id}/drain", json={"reason": "pulled"}).status_code == 202
    await async_wait_until(
        lambda: h.node(node_id)["state"] == "quarantined", timeout_s=60, what="the node drained into quarantine"
    )
    with h.client(held) as agent:
        assert agent.post("/v1/agents/heartbeats", json=beat).status_code == 401
        assert agent.post("/v1/agents/ledger-token").status_code == 401
        reading = {"node_id": node_id, "gpu_index": 0, "xid": 79, "timestamp": "2026-01-01T00:00:00Z"}
        assert agent.post("/v1/agents/events", json={"events": [reading]}).status_code == 401
