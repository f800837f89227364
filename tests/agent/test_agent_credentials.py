"""A node's agent credential reports for that node and opens nothing else: tenants have root on
the nodes they rent, so what the agent holds must not be worth more than the node."""

from __future__ import annotations

import httpx
import pytest

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.reporting import Reporter
from gpucloud.sim.probe import SimulatedProbe

pytestmark = pytest.mark.integration


def _heartbeat(node_id: str) -> dict:
    return {"node_id": node_id, "tenant_id": None, "workload_running": False, "boot_id": "b1"}


async def test_an_agent_credential_reports_for_its_own_node_only(ready_fleet, tmp_path):
    h = await ready_fleet(nodes=2)  # bring-up wipes, and a wipe replaces the credential
    own, other = [n["id"] for n in h.nodes()][:2]
    issued = h.operator.post(f"/v1/nodes/{own}/agent-credential")
    assert issued.status_code == 201 and issued.json()["token"].startswith(f"gpa_{own}.")
    token = issued.json()["token"]
    _, tenant_key = await h.onboard()

    with h.client(token) as agent:
        assert agent.post("/v1/agents/heartbeats", json={"heartbeats": [_heartbeat(own)]}).status_code == 200
        refused = agent.post("/v1/agents/heartbeats", json={"heartbeats": [_heartbeat(own), _heartbeat(other)]})
        assert refused.status_code == 403 and other in refused.json()["detail"]
        event = {"node_id": other, "gpu_index": 0, "xid": 79, "timestamp": "2026-01-01T00:00:00Z"}
        assert agent.post("/v1/agents/events", json={"events": [event]}).status_code == 403
        assert h.node(other)["health"] == "ok"  # nothing of a refused batch was acted on
        # Nothing an operator or a tenant may do.
        for method, path in (
            ("GET", "/v1/nodes"),
            ("GET", "/v1/allocations"),
            ("GET", "/v1/fleet/summary"),
            ("POST", f"/v1/nodes/{own}/cordon"),
            ("GET", "/v1/tenants"),
            ("POST", f"/v1/nodes/{own}/agent-credential"),
        ):
            assert agent.request(method, path, json={}).status_code == 403, path
    with h.client(tenant_key) as tenant:
        assert tenant.post("/v1/agents/heartbeats", json={"heartbeats": [_heartbeat(own)]}).status_code == 403

    # The real agent's reporter pushes with it.
    before = h.node(own)["last_heartbeat_at"]
    reporter_client = httpx.AsyncClient(base_url=h.settings.api_url, headers={"Authorization": f"Bearer {token}"})
    agent = Agent(HostState(node_id=own, boot_id="b2", scratch_dir=tmp_path / "s"), SimulatedProbe(own))
    async with reporter_client:
        await Reporter(agent, reporter_client).heartbeat_once()
    assert h.node(own)["last_heartbeat_at"] > before

    # Issuing again replaces it; an unknown node has none.
    assert h.operator.post(f"/v1/nodes/{own}/agent-credential").status_code == 201
    with h.client(token) as agent_client:
        assert agent_client.post("/v1/agents/heartbeats", json={"heartbeats": [_heartbeat(own)]}).status_code == 401
    assert h.operator.post("/v1/nodes/no-such-node/agent-credential").status_code == 404


@pytest.mark.one_database  # the database only underneath: on SQLite
@pytest.mark.parametrize("token", ["gpa_", "gpa_x", "gpa_.", "gpa_node.", "gpa_node.secret"])
async def test_malformed_or_unknown_agent_tokens_are_refused(db_url, make_harness, token):
    h = make_harness(db_url, nodes=1)
    with h.client(token) as client:
        assert client.post("/v1/agents/heartbeats", json={"heartbeats": [_heartbeat("node")]}).status_code == 401
