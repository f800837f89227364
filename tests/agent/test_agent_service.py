"""The host agent process against a SimulatedProbe: the action API (dedup, tenancy invariants,
501 naming a missing tool, tool failures) and the pushes to the control plane (signal reports
included). Burn-in's figures
against each GPU type's floors: test_agent_tools.py."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState, read_image_digest
from gpucloud.agent.reporting import Reporter
from gpucloud.agent.signals import SignalSampler
from gpucloud.agent.tools import CommandResult, CommandRunner
from gpucloud.agent.workloads import WorkloadSupervisor
from gpucloud.protocol.actions import ActionRequest, Workload
from gpucloud.protocol.reports import FatalKind
from gpucloud.sim.probe import SimulatedProbe
from support.agents import agent_test_client

pytestmark = pytest.mark.unit

BURN_IN_TOOLS = {"dcgmi", "all_reduce_perf", "nvbandwidth"}
# What the tools print on a healthy 8 x H100 node (recorded from their documentation).
RECORDED = Path(__file__).parent.parent / "fixtures" / "tools"
HEALTHY_OUTPUT = {
    "dcgmi": (RECORDED / "dcgmi-diag-r3-pass.json").read_text(),
    "all_reduce_perf": (RECORDED / "all_reduce_perf-8xh100.txt").read_text(),
    "nvbandwidth": (RECORDED / "nvbandwidth-h2d-8xh100.txt").read_text(),
}


class FakeTools(CommandRunner):
    def __init__(
        self, installed: set[str], failing: set[str] = frozenset(), output: dict[str, str] | None = None
    ) -> None:
        self.installed, self.failing, self.ran = installed, failing, []
        self.output = {**HEALTHY_OUTPUT, **(output or {})}

    def which(self, tool: str) -> str | None:
        return f"/usr/bin/{tool}" if tool in self.installed else None

    def run(self, argv, timeout_s):
        self.ran.append(argv)
        if argv[0] in self.failing:
            return CommandResult(1, "diag: FAIL")
        return CommandResult(0, self.output.get(argv[0], "ok"))


def _agent(tmp_path, tools: FakeTools) -> Agent:
    state = HostState(node_id="gpu-1", boot_id="boot-1", scratch_dir=tmp_path / "scratch")
    return Agent(state, SimulatedProbe("gpu-1", gpu_count=8), runner=tools)


def _post(client: TestClient, action: str, request_id: str, tenant: str | None = None) -> httpx.Response:
    return client.post(f"/actions/{action}", json={"request_id": request_id, "tenant_id": tenant})


def test_actions_keep_tenancy_invariants_and_dedup_by_request_id(tmp_path):
    tools = FakeTools(BURN_IN_TOOLS | {"nvidia-smi"})
    agent = _agent(tmp_path, tools)
    with agent_test_client(agent) as client:
        first = _post(client, "provision", "r1", "t-a")
        assert first.status_code == 200 and first.json()["tenant_id"] == "t-a" and first.json()["gpu_count"] == 8
        assert _post(client, "provision", "r1", "t-a").json() == first.json()  # a retry: the same answer
        refused = _post(client, "provision", "r2", "t-b")
        assert refused.status_code == 409 and "wipe it first" in refused.json()["detail"]
        assert refused.headers["content-type"] == "application/problem+json"
        assert _post(client, "wipe", "r3").status_code == 409  # the workload still runs
        assert _post(client, "burn_in", "r4").status_code == 409
        (tmp_path / "scratch").mkdir()
        (tmp_path / "scratch" / "tenant-file").write_text("secret")
        assert _post(client, "release", "r5").status_code == 200
        wiped = _post(client, "wipe", "r6")
        assert wiped.status_code == 200 and wiped.json()["tenant_id"] is None
        assert list((tmp_path / "scratch").iterdir()) == []
        assert _post(client, "burn_in", "r7").status_code == 200
        # The wipe reset the GPUs; then burn-in ran its three tools.
        assert [argv[0] for argv in tools.ran] == ["nvidia-smi", "dcgmi", "all_reduce_perf", "nvbandwidth"]
        assert tools.ran[2][-2:] == ("-g", "8")  # all-reduce over every GPU the probe sees
        assert _post(client, "format_disk", "r8").status_code == 404


def test_missing_tool_is_a_501_naming_it_and_a_failing_tool_a_422(tmp_path):
    tools = FakeTools({"dcgmi"}, failing={"dcgmi"})
    with agent_test_client(_agent(tmp_path, tools)) as client:
        missing = _post(client, "burn_in", "b1")
        assert missing.status_code == 501
        assert missing.json()["tools"] == ["all_reduce_perf", "nvbandwidth"]
        assert "all_reduce_perf, nvbandwidth" in missing.json()["detail"]
        assert _post(client, "reset", "b2").json()["tools"] == ["nvidia-smi"]
        tools.installed |= BURN_IN_TOOLS
        failed = _post(client, "burn_in", "b3")
        assert failed.status_code == 422 and "dcgmi diag -r 3 -j exited 1" in failed.json()["detail"]


def test_burn_in_fails_a_gpu_throttled_by_heat(tmp_path):
    probe = SimulatedProbe("gpu-1", gpu_count=8)
    agent = Agent(
        HostState(node_id="gpu-1", boot_id="b", scratch_dir=tmp_path / "s"), probe, runner=FakeTools(set(BURN_IN_TOOLS))
    )
    with agent_test_client(agent) as client:
        assert _post(client, "burn_in", "ok").status_code == 200
        probe.set_clock_event_reasons(0x040, gpu_index=5)  # HW thermal slowdown
        failed = _post(client, "burn_in", "hot")
        assert failed.status_code == 422 and "GPU 5 throttled" in failed.json()["detail"]


@pytest.fixture
def control_plane():
    seen: dict[str, list] = {
        "/v1/agents/heartbeats": [],
        "/v1/agents/events": [],
        "/v1/agents/readings": [],
        "/v1/agents/signals": [],
    }
    state: dict = {"down": False, "refuse": None}

    def handle(request: httpx.Request) -> httpx.Response:
        if state["down"]:
            return httpx.Response(503)
        if state["refuse"]:
            return httpx.Response(state["refuse"], json={})
        seen[request.url.path].append(json.loads(request.content))
        return httpx.Response(200, json={})

    client = httpx.AsyncClient(base_url="http://cp", transport=httpx.MockTransport(handle))
    return client, seen, state


async def test_reporter_pushes_heartbeats_and_stamped_xids_and_keeps_them_while_down(tmp_path, control_plane):
    client, seen, cp = control_plane
    agent = _agent(tmp_path, FakeTools(set()))
    reporter = Reporter(agent, client)
    await agent.act("provision", ActionRequest(request_id="p", tenant_id="t-a"))

    await reporter.heartbeat_once()
    assert seen["/v1/agents/heartbeats"] == [
        {
            "heartbeats": [
                {
                    "node_id": "gpu-1",
                    "tenant_id": "t-a",
                    "workload_running": True,
                    "boot_id": "boot-1",
                    "workload": None,
                }
            ]
        }
    ]

    assert await reporter.events_once(0) == 0  # nothing happened
    probe: SimulatedProbe = agent.probe
    probe.inject_xid(79, gpu_index=3)
    cp["down"] = True
    assert await reporter.events_once(0) == 0 and len(reporter.pending) == 1
    cp["down"] = False
    probe.inject_xid(13, gpu_index=1)
    assert await reporter.events_once(0) == 2 and reporter.pending == []
    (batch,) = seen["/v1/agents/events"]
    assert [(e["xid"], e["gpu_index"], e["tenant_id"], e["node_id"]) for e in batch["events"]] == [
        (79, 3, "t-a", "gpu-1"),
        (13, 1, "t-a", "gpu-1"),
    ]

    reading = await reporter.read_once()
    assert reading.is_gpu_node and len(reading.gpus) == 8


async def test_reporter_pushes_each_reading_and_drops_it_while_down(tmp_path, control_plane):
    client, seen, cp = control_plane
    agent = _agent(tmp_path, FakeTools(set()))
    reporter = Reporter(agent, client)
    first = await reporter.read_once()
    (batch,) = seen["/v1/agents/readings"]
    assert batch == {"readings": [first.model_dump(mode="json")]}
    assert len(batch["readings"][0]["gpus"]) == 8 and batch["readings"][0]["node_id"] == "gpu-1"

    cp["down"] = True
    missed = await reporter.read_once()  # taken and kept for GET /readings, not queued
    assert reporter.latest == missed and len(seen["/v1/agents/readings"]) == 1
    cp["down"] = False
    await reporter.read_once()
    assert len(seen["/v1/agents/readings"]) == 2


def _ib_port(root: Path, state: str) -> None:
    port = root / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True, exist_ok=True)
    (port / "state").write_text(f"{state}\n")


async def test_reporter_samples_signals_each_period_and_keeps_them_while_down(tmp_path, control_plane):
    client, seen, cp = control_plane
    agent = _agent(tmp_path, FakeTools(set()))
    host = tmp_path / "host"
    _ib_port(host, "4: ACTIVE")
    reporter = Reporter(agent, client, signals=SignalSampler("gpu-1", root=host))
    await reporter.sample_once()  # a reading, and the ports' baseline: nothing to say yet
    assert len(seen["/v1/agents/readings"]) == 1 and seen["/v1/agents/signals"] == []

    _ib_port(host, "1: DOWN")
    cp["down"] = True
    assert await reporter.signals_once() == 0 and len(reporter.pending_signals) == 1
    cp["down"] = False
    assert await reporter.signals_once() == 1 and reporter.pending_signals == []
    ((report,),) = (batch["reports"] for batch in seen["/v1/agents/signals"])
    assert report["node_id"] == "gpu-1"
    assert [(o["signal"], o["source"]) for o in report["observations"]] == [("ib_link_down", "mlx5_0/1")]

    # A report the control plane refuses for good is dropped, not retried forever.
    _ib_port(host, "4: ACTIVE")
    await reporter.signals_once()
    _ib_port(host, "1: DOWN")
    cp["refuse"] = 422
    assert await reporter.signals_once() == 0 and reporter.pending_signals == []


async def test_reporter_reports_a_hung_workload_as_a_signal(tmp_path, control_plane):
    """The tenant's workload past its progress timeout reaches the control plane as
    `workload_hang` (the workload's fault: the table never pulls for it)."""
    client, seen, _ = control_plane
    state = HostState(node_id="gpu-1", boot_id="boot-1", scratch_dir=tmp_path / "scratch")
    workloads = WorkloadSupervisor(tmp_path / "workloads", grace_s=0.5)
    agent = Agent(state, SimulatedProbe("gpu-1", gpu_count=8), runner=FakeTools(set()), workloads=workloads)
    reporter = Reporter(agent, client, signals=SignalSampler("gpu-1", root=tmp_path / "host"))
    running = workloads.start("alloc-9", Workload(command=["sleep", "60"], progress_timeout_s=10), cwd=tmp_path / "w")
    try:
        assert await reporter.signals_once() == 0  # within its timeout: nothing to say
        # A minute without progress (the file and the start both that old).
        old = time.time() - 60
        os.utime(running.progress_file, (old, old))
        workloads._save(dataclasses.replace(running, started_at=old))
        assert await reporter.signals_once() == 1
    finally:
        workloads.stop()
    ((report,),) = (batch["reports"] for batch in seen["/v1/agents/signals"])
    assert [(o["signal"], o["source"]) for o in report["observations"]] == [("workload_hang", "alloc-9")]


def test_readiness_is_open_and_says_when_the_gpus_fail(tmp_path):
    agent = _agent(tmp_path, FakeTools(set(BURN_IN_TOOLS)))
    with agent_test_client(agent) as client:
        client.headers.pop("Authorization")  # open, like /healthz
        assert client.get("/readyz").json() == {"status": "ready", "checks": {"gpus": "ok"}}
        agent.probe.set_fatal(FatalKind.GPU_LOST, gpu_index=3, detail="fell off the bus")
        down = client.get("/readyz")
        assert down.status_code == 503 and down.headers["retry-after"]
        assert "fell off the bus" in down.json()["checks"]["gpus"]
        assert client.get("/metrics").status_code == 401  # no metrics token given to this agent
    with agent_test_client(agent, metrics_tokens=("scrape-token",)) as client:
        assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        scraped = client.get("/metrics", headers={"Authorization": "Bearer scrape-token"})
        assert scraped.status_code == 200 and "gpucloud_agent_spool_lag_seconds" in scraped.text


def test_an_action_answers_the_boot_and_the_image_it_came_from(tmp_path):
    """What a re-image checks (`activities/bmc.py`): the production agent reports this boot's id
    and the digest the clean image wrote for it; a host not booted from one reports none."""
    digest = "sha256:" + "ab" * 32
    (tmp_path / "image-digest").write_text(digest + "\n")
    state = HostState(
        node_id="gpu-1",
        boot_id="boot-7",
        image_digest=read_image_digest(tmp_path / "image-digest"),
        scratch_dir=tmp_path / "scratch",
    )
    agent = Agent(state, SimulatedProbe("gpu-1", gpu_count=8), runner=FakeTools(set(BURN_IN_TOOLS)))
    with agent_test_client(agent) as client:
        answer = _post(client, "release", "r1").json()
    assert (answer["boot_id"], answer["image_digest"]) == ("boot-7", digest)
    assert read_image_digest(tmp_path / "absent") is None
    (tmp_path / "garbage").write_text("sha256:not-a-digest")
    with pytest.raises(SystemExit, match="not an image digest"):
        read_image_digest(tmp_path / "garbage")


def test_a_tenant_id_that_is_not_an_ids_characters_is_refused_before_it_names_a_folder(tmp_path):
    """The tenant's id names the node's folders for its weights and keys: `../` or a slash in it
    is a 422 at the edge, and nothing is provisioned."""
    agent = _agent(tmp_path, FakeTools(set(BURN_IN_TOOLS)))
    with agent_test_client(agent) as client:
        for tenant in ("../../etc", "a/b", ""):
            refused = _post(client, "provision", f"r-{tenant!r}", tenant)
            assert refused.status_code == 422 and "tenant_id" in refused.text, (tenant, refused.text)
        assert _post(client, "provision", "r-ok", "ten_0123abcd").status_code == 200
    assert agent.state.tenant_id == "ten_0123abcd"
