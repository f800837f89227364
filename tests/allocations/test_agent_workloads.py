"""Issue 14: the agent owns the tenant's processes. The real agent code, as root on this machine,
with real process trees: provision starts the allocation's workload in a PID namespace of its
own; release stops every process of it, children that ignore SIGTERM and ones that left their
session included, and confirms none is left; release removes the tenant's SSH keys, wipe its files; an agent
restarted meanwhile still finds the workload, stops it at release, and meters the allocation."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.ssh_keys import AuthorizedKeys
from gpucloud.agent.workloads import WorkloadSupervisor, processes_in
from gpucloud.protocol.actions import ActionRequest, Workload
from gpucloud.sim.probe import SimulatedProbe
from support.agents import GpuResetOnly
from support.stack import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

# A job that ignores SIGTERM, forks a child that ignores it too, and a grandchild that leaves the
# session (a daemon): what a careless training launcher leaves behind.
STUBBORN = [
    "sh",
    "-c",
    "trap '' TERM; echo $$ > started; "
    "(trap '' TERM; setsid sh -c 'trap \"\" TERM; while true; do sleep 1; done' & while true; do sleep 1; done) & "
    "while true; do sleep 1; done",
]


def _agent(tmp_path: Path, *, grace_s: float = 0.5) -> Agent:
    state = HostState(
        node_id="gpu-1", boot_id="boot-1", scratch_dir=tmp_path / "scratch", state_file=tmp_path / "state" / "host.json"
    )
    state.restore()
    workloads = WorkloadSupervisor(tmp_path / "state" / "workloads", grace_s=grace_s)
    keys = AuthorizedKeys("tenant", path=tmp_path / "home" / ".ssh" / "authorized_keys")
    probe = SimulatedProbe("gpu-1", gpu_count=8)
    return Agent(state, probe, runner=GpuResetOnly(), workloads=workloads, ssh_keys=keys)


def _act(agent: Agent, action: str, request_id: str, **fields) -> tuple[int, dict]:
    return asyncio.run(agent.act(action, ActionRequest(request_id=request_id, **fields)))


def _alive(pids: list[int]) -> list[int]:
    return [
        p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
    ]


def test_release_stops_every_process_of_the_workload_and_wipe_removes_the_tenants_files(tmp_path):
    agent = _agent(tmp_path)
    workload = Workload(command=STUBBORN, env={"JOB": "llama"}, ssh_keys=["ssh-ed25519 AAAAC3Nza tenant@laptop"])
    status, body = _act(agent, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=workload)
    assert status == 200, body
    assert body["workload_status"]["workload"] == "running"
    assert body["workload_status"]["isolation"] == "pid-namespace"
    namespace = agent.workloads.running().pid_namespace
    wait_until(lambda: len(processes_in(namespace)) >= 4, timeout_s=10, what="the job, its child and its daemon")
    members = processes_in(namespace)
    keys = tmp_path / "home" / ".ssh" / "authorized_keys"
    assert keys.read_text() == "ssh-ed25519 AAAAC3Nza tenant@laptop\n" and oct(keys.stat().st_mode & 0o777) == "0o600"
    assert (tmp_path / "scratch" / "work" / "started").exists()  # it ran in the tenant's work dir

    started = time.monotonic()
    status, body = _act(agent, "release", "r1")
    assert status == 200, body
    assert body["workload_running"] is False and body["workload_status"] == {"workload": "none"}
    assert processes_in(namespace) == [] and _alive(members) == []  # nothing of it is left
    assert time.monotonic() - started < 5  # SIGTERM ignored: killed after the grace period
    assert not keys.exists()  # the release shut the tenant out
    assert _act(agent, "release", "r2")[0] == 200  # a repeated release is a no-op

    assert _act(agent, "wipe", "w1")[0] == 200
    assert not list((tmp_path / "state" / "workloads").glob("workload-*.log"))


def test_an_agent_restarted_mid_allocation_still_stops_the_workload_and_meters(tmp_path):
    first = _agent(tmp_path)
    workload = Workload(command=["sleep", "300"])
    assert _act(first, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=workload)[0] == 200
    namespace = first.workloads.running().pid_namespace
    metered_from = first.state.allocation.started_ms

    again = _agent(tmp_path)  # the agent process restarted; the job kept running
    assert (again.state.tenant_id, again.state.workload_running) == ("t1", True)
    assert again.state.allocation is not None and again.state.allocation.started_ms == metered_from
    assert again.workload_status()["workload_status"]["workload"] == "running"
    # The same provision again (the control plane's drift handling) starts nothing new.
    status, _ = _act(again, "provision", "p2", tenant_id="t1", allocation_id="a1", workload=workload)
    assert status == 200 and len(processes_in(namespace)) == 1, processes_in(namespace)
    assert _act(again, "release", "r1")[0] == 200
    assert processes_in(namespace) == []
    assert again.state.allocation.ended_ms is not None  # metering stops at the release


def test_a_workload_that_exits_is_reported_with_its_code(tmp_path):
    agent = _agent(tmp_path)
    _act(
        agent, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=Workload(command=["sh", "-c", "exit 3"])
    )
    wait_until(lambda: agent.workloads.status()["workload"] == "exited", timeout_s=10, what="the job exits")
    assert agent.workloads.status()["exit_code"] == 3
    # Another allocation's workload waits for a release of this one.
    busy = _agent(tmp_path)
    busy.workloads.start("a1", Workload(command=["sleep", "60"]), cwd=tmp_path / "w")
    status, body = _act(
        busy, "provision", "p2", tenant_id="t1", allocation_id="a2", workload=Workload(command=["true"])
    )
    assert status == 409 and "a1 still runs" in body["detail"]
    busy.workloads.stop()


def test_without_namespaces_the_workload_runs_in_its_own_process_group(tmp_path):
    supervisor = WorkloadSupervisor(tmp_path / "w", grace_s=0.5, unshare="")  # as where unshare is missing
    running = supervisor.start("a1", Workload(command=["sh", "-c", "sleep 300 & sleep 300"]), cwd=tmp_path / "cwd")
    assert running.isolation == "process-group" and running.pid_namespace is None
    assert os.getpgid(running.pid) == running.pid  # a session and group of its own, not the agent's
    assert supervisor.stop()["workload"] == "stopped"
    with pytest.raises(ProcessLookupError):
        os.killpg(running.pid, 0)


def test_the_heartbeat_carries_what_runs_of_the_workload(tmp_path):
    import httpx

    from gpucloud.agent.reporting import Reporter

    sent: list[dict] = []

    def control_plane(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"accepted": 1, "drifted": []})

    agent = _agent(tmp_path)
    _act(agent, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=Workload(command=["sleep", "60"]))

    async def beat() -> None:
        async with httpx.AsyncClient(base_url="http://cp", transport=httpx.MockTransport(control_plane)) as client:
            await Reporter(agent, client).heartbeat_once()

    asyncio.run(beat())
    [report] = sent[0]["heartbeats"]
    assert report["workload"] == {
        "state": "running",
        "allocation_id": "a1",
        "exit_code": None,
        "isolation": "pid-namespace",
    }
    assert _act(agent, "release", "r1")[0] == 200


def _container_agent(tmp_path: Path, runtime: str | None) -> Agent:
    state = HostState(
        node_id="gpu-1", boot_id="boot-1", scratch_dir=tmp_path / "scratch", state_file=tmp_path / "state" / "host.json"
    )
    state.restore()
    workloads = WorkloadSupervisor(tmp_path / "state" / "workloads", grace_s=0.5, container_runtime=runtime or "")
    return Agent(state, SimulatedProbe("gpu-1", gpu_count=8), runner=GpuResetOnly(), workloads=workloads)


def test_an_image_workload_runs_in_the_nodes_container_runtime_and_nothing_of_it_is_left_after_release(tmp_path):
    from support.container_runtime import write_runtime

    runtime = write_runtime(tmp_path / "runtime", ["nvcr.io/nvidia/pytorch:24.05-py3"])
    agent = _container_agent(tmp_path, runtime)
    workload = Workload(image="nvcr.io/nvidia/pytorch:24.05-py3", command=STUBBORN, env={"JOB": "x"})
    status, body = _act(agent, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=workload)
    assert status == 200, body
    assert body["workload_status"]["workload"] == "running"
    assert body["workload_status"]["isolation"] == "container"
    running = agent.workloads.running()
    assert running.container == "gpucloud-a1" and running.pid_namespace is not None
    wait_until(lambda: len(processes_in(running.pid_namespace)) >= 3, timeout_s=10, what="the job and its children")
    calls = [json.loads(line) for line in (tmp_path / "runtime" / "calls.jsonl").read_text().splitlines()]
    run = next(call for call in calls if call[0] == "run")
    # The node's GPUs and network, the allocation's label; the env in a file, not on the command line.
    assert run[run.index("--gpus") : run.index("--gpus") + 2] == ["--gpus", "all"]
    assert run[run.index("--network") + 1] == "host" and "gpucloud.allocation=a1" in run
    assert not any("JOB=x" in arg for arg in run)
    assert not list((tmp_path / "state" / "workloads").glob("*.env"))  # removed once the run started

    status, body = _act(agent, "release", "r1")
    assert status == 200, body
    assert body["workload_status"] == {"workload": "none"}
    assert processes_in(running.pid_namespace) == []
    assert not (tmp_path / "runtime" / "containers" / "gpucloud-a1.json").exists()  # removed, not only stopped
    assert _act(agent, "release", "r2")[0] == 200


def test_an_image_the_node_cannot_run_is_a_clear_refusal(tmp_path):
    from support.container_runtime import write_runtime

    nowhere = _container_agent(tmp_path / "a", None)
    status, body = _act(
        nowhere, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=Workload(image="train:1")
    )
    assert status == 422 and "no container runtime" in body["detail"], body
    assert nowhere.workloads.running() is None

    runtime = write_runtime(tmp_path / "runtime", ["train:1"])
    missing = _container_agent(tmp_path / "b", runtime)
    status, body = _act(
        missing, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=Workload(image="nope:2")
    )
    assert status == 409 and "Unable to find image 'nope:2'" in body["detail"], body

    # An image whose job exits is reported with the job's code.
    ran = _container_agent(tmp_path / "c", runtime)
    workload = Workload(image="train:1", command=["sh", "-c", "exit 4"])
    assert _act(ran, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=workload)[0] == 200
    wait_until(lambda: ran.workloads.status()["workload"] == "exited", timeout_s=10, what="the job exits")
    assert ran.workloads.status()["exit_code"] == 4
    assert _act(ran, "release", "r1")[0] == 200


def test_a_container_workload_s_output_is_read_through_the_runtime_and_its_log_driver_is_bounded(tmp_path):
    """Issue 40: a container's output is the runtime's (`logs`), rotated by its log driver."""
    from support.agents import agent_test_client
    from support.container_runtime import write_runtime

    runtime = write_runtime(tmp_path / "runtime", ["train:1"])
    agent = _container_agent(tmp_path, runtime)
    script = "echo epoch-1; echo warn >&2; sleep 1; echo epoch-2"
    workload = Workload(image="train:1", command=["sh", "-c", script])
    assert _act(agent, "provision", "p1", tenant_id="t1", allocation_id="a1", workload=workload)[0] == 200
    client = agent_test_client(agent)
    # Followed while it runs: what it prints as it comes, until the container stops.
    followed = client.get("/workload/logs", params={"follow": "true", "follow_s": 30})
    assert followed.text == "epoch-1\nwarn\nepoch-2\n", followed.text
    assert client.get("/workload/logs", params={"tail": 1}).text == "epoch-2\n"
    calls = [json.loads(line) for line in (tmp_path / "runtime" / "calls.jsonl").read_text().splitlines()]
    run = next(call for call in calls if call[0] == "run")
    limits = agent.workloads.log_limits
    assert f"max-size={limits.max_bytes}" in run and f"max-file={limits.files}" in run
    assert _act(agent, "release", "r1")[0] == 200


def test_a_workload_names_something_to_run():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="a command, an image, or both"):
        Workload()
    with pytest.raises(ValidationError, match="image"):
        Workload(image="bad image name")
