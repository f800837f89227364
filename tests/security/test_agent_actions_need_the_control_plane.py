"""Issue 13, rows 2 and 12: the agent's actions (provision, wipe, reboot, reflash, ...) answer
only the control plane, and the agent will not start without its own node's credential.

Before: `POST /actions/wipe` needed no credentials, and `gpucloud agent` without `--token` fell
back to the operator token, on a node a tenant has root on."""

from __future__ import annotations

import subprocess
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpucloud.adapters.host_agent import AgentRefused, HttpHostAgents
from gpucloud.agent.app import Agent, create_app
from gpucloud.agent.host import HostState
from gpucloud.protocol.actions import ActionRequest
from gpucloud.sim.probe import SimulatedProbe
from gpucloud.web.service_tokens import ALGORITHM, ISSUER, Issuer, Verifier, agent_audience, load_or_create_issuer
from gpucloud.web.serving import ThreadedServer
from support.forked import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


@pytest.fixture
def served_agent(tmp_path):
    """A real agent's API over HTTP on loopback, trusting one control plane key."""
    control_plane = load_or_create_issuer(tmp_path / "issuer_key.pem")
    state = HostState(node_id="gpu-7", boot_id="b", scratch_dir=tmp_path / "scratch")
    agent = Agent(state, SimulatedProbe("gpu-7", gpu_count=8))
    server = ThreadedServer(create_app(agent, control_plane=Verifier(control_plane.public_key)), name="agent")
    server.start()
    yield server.url, control_plane, state
    server.stop()


async def test_only_the_control_planes_token_for_this_node_opens_its_actions(served_agent):
    url, control_plane, state = served_agent
    body = {"request_id": "r1", "tenant_id": "t-a"}
    stranger = Issuer(Ed25519PrivateKey.generate())
    expired = jwt.encode(
        {"iss": ISSUER, "sub": "control-plane", "role": "control-plane", "aud": agent_audience("gpu-7"), "exp": 1},
        control_plane._key,
        algorithm=ALGORITHM,
    )
    refused = {
        "no credentials": {},
        "a token for another node": {"Authorization": f"Bearer {control_plane.mint(agent_audience('gpu-8'))}"},
        "a token signed by another key": {"Authorization": f"Bearer {stranger.mint(agent_audience('gpu-7'))}"},
        "an expired token": {"Authorization": f"Bearer {expired}"},
        "a tenant role": {"Authorization": f"Bearer {control_plane.mint(agent_audience('gpu-7'), role='tenant')}"},
        "an API key": {"Authorization": "Bearer gpc_key.secret"},
    }
    with httpx.Client(base_url=url, timeout=10) as http:
        for why, headers in refused.items():
            for path in ("/actions/wipe", "/actions/provision"):
                resp = http.post(path, json=body, headers=headers)
                assert resp.status_code == 401, (why, path, resp.text)
                assert resp.headers["content-type"] == "application/problem+json"
            assert http.get("/readings", headers=headers).status_code == 401, why
        assert state.tenant_id is None  # nothing was provisioned
        assert http.get("/healthz").status_code == 200  # health stays open

    # The control plane's own client presents a token for the node it calls.
    agents = HttpHostAgents(issuer=control_plane)
    try:
        answer = await agents.act(url, "provision", ActionRequest(request_id="r2", tenant_id="t-a"), node_id="gpu-7")
        assert answer["tenant_id"] == "t-a" and state.tenant_id == "t-a"
        with pytest.raises(AgentRefused):  # the same client, the wrong node's token
            await agents.act(url, "release", ActionRequest(request_id="r3"), node_id="gpu-8")
    finally:
        await agents.aclose()


def _agent_cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    """`gpucloud agent ...` in a process of its own with only this environment (forked from a
    server that imported the libraries: `support/forked.run_cli`)."""
    return run_cli(
        ["agent", "--node-id", "gpu-7", "--port", "0", *args],
        env={"PATH": "/usr/bin:/bin", "GPUCLOUD_DATA_DIR": str(tmp_path)},
        cwd=tmp_path,
        timeout=60,
    )


def test_the_agent_refuses_to_start_without_its_node_credential_or_the_control_plane_key(tmp_path):
    started = time.monotonic()
    no_token = _agent_cli(tmp_path=tmp_path)
    assert no_token.returncode != 0 and "--token" in no_token.stderr, no_token.stderr
    # The operator token (or another node's credential) is not this node's credential.
    (tmp_path / "operator_token").write_text("gpcop_x\n")
    other = _agent_cli("--token", "gpa_gpu-8.secret", tmp_path=tmp_path)
    assert other.returncode != 0 and "gpa_gpu-7." in other.stderr, other.stderr
    no_key = _agent_cli(
        "--token", "gpa_gpu-7.secret", "--control-plane-key", str(tmp_path / "none.pub"), tmp_path=tmp_path
    )
    assert no_key.returncode != 0 and "public key" in no_key.stderr, no_key.stderr
    # The credential the last wipe handed over, kept in --token-file, is what a restart uses.
    kept = tmp_path / "agent-credential"
    kept.write_text("gpa_gpu-8.from-another-node\n")
    stale = _agent_cli("--token-file", str(kept), tmp_path=tmp_path)
    assert stale.returncode != 0 and "gpa_gpu-7." in stale.stderr, stale.stderr
    kept.write_text("gpa_gpu-7.handed-over-by-a-wipe\n")
    from_file = _agent_cli(
        "--token-file", str(kept), "--control-plane-key", str(tmp_path / "none.pub"), tmp_path=tmp_path
    )
    assert from_file.returncode != 0 and "public key" in from_file.stderr, from_file.stderr  # past the credential
    assert time.monotonic() - started < 60
    # The key the control plane keeps for agents is the public half only.
    load_or_create_issuer(tmp_path / "issuer_key.pem")
    public = serialization.load_pem_public_key((tmp_path / "issuer_key.pub").read_bytes())
    assert public is not None and "PRIVATE" not in (tmp_path / "issuer_key.pub").read_text()
    assert (tmp_path / "issuer_key.pem").stat().st_mode & 0o077 == 0


async def test_the_simulated_fleet_checks_the_same_tokens_as_a_real_agent(ready_fleet):
    h = await ready_fleet(nodes=2)  # bring-up went through: the worker signs
    first, second = h.node_ids()
    issuer = load_or_create_issuer(h.settings.issuer_key_path)
    body = {"request_id": "attack-1", "tenant_id": "t-evil"}
    url = f"{h.sim.url}/v1/nodes/{first}/actions/provision"
    with httpx.Client(timeout=10) as http:
        assert http.post(url, json=body).status_code == 401
        other = {"Authorization": f"Bearer {issuer.mint(agent_audience(second))}"}
        assert http.post(url, json=body, headers=other).status_code == 401
        assert h.sim.node(first)["tenant_id"] is None
