"""Issue 40: the agent serves its workload's output at `GET /workload/logs` (`protocol/logs.py`) to
the control plane's token for the node, or to a log reader's token for that node alone: the one
an API's delegate mints, which opens no action and no other node. Before: no such route."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.workloads import WorkloadSupervisor
from gpucloud.bootstrap import API_DELEGATE_AUDIENCES, API_DELEGATE_ROLES
from gpucloud.protocol.actions import Workload
from gpucloud.sim.probe import SimulatedProbe
from gpucloud.web.service_tokens import (
    LOG_READER,
    Issuer,
    agent_audience,
    agent_logs_audience,
)
from support.agents import CONTROL_PLANE, agent_test_client
from support.stack import wait_until

pytestmark = pytest.mark.unit


def _agent(tmp_path) -> Agent:
    state = HostState(node_id="gpu-1", boot_id="boot-1", scratch_dir=tmp_path / "scratch")
    workloads = WorkloadSupervisor(tmp_path / "workloads", grace_s=0.5, container_runtime="")
    return Agent(state, SimulatedProbe("gpu-1", gpu_count=8), workloads=workloads)


def _delegate() -> Issuer:
    """An API's delegate, certified as `bootstrap.issue_api_delegate` certifies one."""
    key = Ed25519PrivateKey.generate()
    certificate = CONTROL_PLANE.certify(
        key.public_key(), name="api", audiences=API_DELEGATE_AUDIENCES, roles=API_DELEGATE_ROLES, ttl_s=600
    )
    return Issuer(key, certificate=certificate)


def _as(client: TestClient, token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {"Authorization": ""}


def test_the_workload_s_output_is_served_to_the_control_plane_and_a_log_reader_of_this_node_only(tmp_path):
    agent = _agent(tmp_path)
    client = agent_test_client(agent)
    none_yet = client.get("/workload/logs")
    assert none_yet.status_code == 404 and "no workload runs" in none_yet.json()["detail"]

    agent.workloads.start("a1", Workload(command=["sh", "-c", "echo one; echo two >&2; exit 4"]), cwd=tmp_path / "w")
    wait_until(lambda: agent.workloads.status()["workload"] == "exited", timeout_s=20, what="exit")
    wait_until(lambda: client.get("/workload/logs").text == "one\ntwo\n", timeout_s=10, what="output")
    assert agent.workloads.status()["exit_code"] == 4
    assert client.get("/workload/logs", params={"tail": 1}).text == "two\n"
    followed = client.get("/workload/logs", params={"follow": "true", "follow_s": 30})
    assert followed.text == "one\ntwo\n"  # exited: the follow ends once all is handed over
    assert client.get("/workload/logs", params={"follow_s": 100_000}).status_code == 422

    delegate = _delegate()
    reader = delegate.mint(agent_logs_audience("gpu-1"), role=LOG_READER)
    assert client.get("/workload/logs", headers=_as(client, reader)).text == "one\ntwo\n"
    refused = {
        "another node's reader": delegate.mint(agent_logs_audience("gpu-2"), role=LOG_READER),
        "a delegate acting as the control plane": delegate.mint(agent_audience("gpu-1")),
        "a reader in another role": delegate.mint(agent_logs_audience("gpu-1")),
        "no token": None,
    }
    for why, token in refused.items():
        assert client.get("/workload/logs", headers=_as(client, token)).status_code == 401, why
    # A log reader's token opens nothing else on the node.
    provision = {"request_id": "r1", "tenant_id": "t1"}
    assert client.post("/actions/provision", json=provision, headers=_as(client, reader)).status_code == 401
    assert client.get("/readings", headers=_as(client, reader)).status_code == 401
    agent.workloads.stop()
