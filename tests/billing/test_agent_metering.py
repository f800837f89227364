"""The real host agent (`gpucloud agent`) meters what it provisions: a provision names its
allocation, the meter cuts the workload's GPU time into the durable spool, the shipper puts it in
the ledger (served over HTTP), and a release ends it; nothing is billed without an allocation."""

from __future__ import annotations

import time

import httpx
import pytest

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState, gpu_type_of
from gpucloud.agent.reporting import AgentMetering
from gpucloud.agent.tools import CommandResult, CommandRunner
from gpucloud.sim.probe import SimulatedProbe
from support.agents import agent_test_client
from support.ledger_auth import auth_for, seed_allocation
from support.ledger_harness import ledger_in_thread
from support.stack import wait_until

pytestmark = pytest.mark.integration


class NoTools(CommandRunner):
    def which(self, tool: str) -> str | None:
        return f"/usr/bin/{tool}"

    def run(self, argv, timeout_s):
        return CommandResult(0, "ok")


def test_the_agent_meters_a_provisioned_allocation_into_the_ledger(tmp_path):
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as ledger_url:
        now_ms = time.time_ns() // 1_000_000
        auth = auth_for(ledger_url)
        seed_allocation(ledger_url, auth, node="gpu-1", at_ms=now_ms - 1000)
        probe = SimulatedProbe("gpu-1", gpu_count=8)
        agent = Agent(
            HostState(node_id="gpu-1", boot_id="b", scratch_dir=tmp_path / "scratch"),
            probe,
            runner=NoTools(),
            gpu_type="H100",
        )
        # The node's agent posts with a token for its own node (the API would give it one).
        token = auth.token("agent", "node:gpu-1")
        metering = AgentMetering(agent, tmp_path / "spool.db", ledger_url, interval_s=0.05, token=lambda: token)
        with agent_test_client(agent, metering=metering) as client:
            # No allocation named: the workload runs, nothing is metered.
            assert client.post("/actions/provision", json={"request_id": "r0", "tenant_id": "t1"}).status_code == 200
            assert agent.state.allocation is None
            assert client.post("/actions/release", json={"request_id": "r0b"}).status_code == 200

            provisioned = client.post(
                "/actions/provision", json={"request_id": "r1", "tenant_id": "t1", "allocation_id": "a1"}
            )
            assert provisioned.status_code == 200
            # A retried or repeated provision of the running allocation does not restart its meter.
            started_ms = agent.state.allocation.started_ms
            assert (
                client.post(
                    "/actions/provision", json={"request_id": "r2", "tenant_id": "t1", "allocation_id": "a1"}
                ).status_code
                == 200
            )
            assert agent.state.allocation.started_ms == started_ms
            time.sleep(0.6)
            assert client.post("/actions/release", json={"request_id": "r3"}).status_code == 200
            allocation = agent.state.allocation
            assert allocation.ended_ms is not None and allocation.gpu_count == 8
            wait_until(
                lambda: client.get("/metering").json()["pending"] == 0 and metering.spool.appended() > 0,
                timeout_s=30,
                what="the spool shipped",
            )
        usage = httpx.get(
            auth=auth_for(ledger_url), url=f"{ledger_url}/v1/usage", params={"tenant_id": "t1", "allocation_id": "a1"}
        ).json()
        # Every millisecond between provision and release, on 8 GPUs, once.
        assert usage["gpu_ms"] == 8 * (allocation.ended_ms - allocation.started_ms) > 8 * 500


def test_an_agent_without_a_ledger_says_so_and_names_gpu_types_from_nvml(tmp_path):
    agent = Agent(
        HostState(node_id="gpu-2", boot_id="b", scratch_dir=tmp_path / "s"), SimulatedProbe("gpu-2"), runner=NoTools()
    )
    with agent_test_client(agent) as client:
        answer = client.get("/metering")
        assert answer.status_code == 404 and "ledger URL" in answer.json()["detail"]
    reading = SimulatedProbe("gpu-3", gpu_count=2).read()
    named = reading.model_copy(
        update={"gpus": [g.model_copy(update={"name": "NVIDIA H200 141GB HBM3e"}) for g in reading.gpus]}
    )
    assert gpu_type_of(named) == "H200"
    gb200 = reading.model_copy(update={"gpus": [g.model_copy(update={"name": "NVIDIA GB200"}) for g in reading.gpus]})
    assert gpu_type_of(gb200) == "GB200"  # not a B200
