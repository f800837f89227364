"""Issue 42, active signals: the agent's `diagnose` (`dcgmi diag -r 1`, the single-node NCCL
all-reduce, nvbandwidth) against recorded outputs of the real tools (`tests/fixtures/tools/`;
DCGM's level 1 prints the same JSON document as level 3, with fewer tests): each finding is the
observation of its signal, a tool that is not installed is `not_run` (never a pass), a run that
says nothing judgeable is an `error`, and a node a tenant holds is refused. The simulated node
answers from its fault model."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.tools import DEFAULT_BURN_IN, CommandResult, CommandRunner, diagnostic_check
from gpucloud.protocol.actions import ActionAnswer, ActionRequest, AgentAction
from gpucloud.sim.nodes import Fleet, FleetSpec
from gpucloud.sim.probe import SimulatedProbe
from support.agents import agent_test_client

pytestmark = pytest.mark.unit

RECORDED = Path(__file__).parent.parent / "fixtures" / "tools"

DCGM = ("dcgmi", "diag", "-r", "1", "-j")
NCCL = ("all_reduce_perf", "-b", "8M", "-e", "8G", "-f", "2", "-g", "8")
NVBW = ("nvbandwidth", "-t", "host_to_device_memcpy_ce")
HEALTHY_H100 = {
    DCGM: (0, "dcgmi-diag-r3-pass.json"),
    NCCL: (0, "all_reduce_perf-8xh100.txt"),
    NVBW: (0, "nvbandwidth-h2d-8xh100.txt"),
}


class RecordedTools(CommandRunner):
    """Answers each documented argv with its recorded output; `missing` tools are not installed."""

    def __init__(self, outputs: dict[tuple[str, ...], tuple[int, str]], missing: tuple[str, ...] = ()) -> None:
        self.outputs, self.missing = outputs, missing
        self.ran: list[tuple[str, ...]] = []

    def which(self, tool: str) -> str | None:
        return None if tool in self.missing else f"/usr/bin/{tool}"

    def run(self, argv, timeout_s):
        self.ran.append(argv)
        assert argv in self.outputs, f"undocumented command line {argv}"
        returncode, name = self.outputs[argv]
        return CommandResult(returncode, (RECORDED / name).read_text())


def _diagnose(tmp_path, tools: RecordedTools, *, gpu_name: str = "NVIDIA H100 80GB HBM3", tenant: str | None = None):
    probe = SimulatedProbe("gpu-1", gpu_count=8, gpu_name=gpu_name)
    state = HostState(node_id="gpu-1", boot_id="b", scratch_dir=tmp_path / "s")
    state.tenant_id = tenant
    agent = Agent(state, probe, runner=tools)
    with agent_test_client(agent) as client:
        return client.post("/actions/diagnose", json={"request_id": "r1"})


def _checks(answer) -> dict[str, tuple[str, str]]:
    diagnosis = ActionAnswer.model_validate(answer.json()).diagnosis
    assert diagnosis is not None
    return {c.tool: (c.status, c.detail) for c in diagnosis.checks}


def _signals(answer) -> list[tuple[str, str, str]]:
    diagnosis = ActionAnswer.model_validate(answer.json()).diagnosis
    assert diagnosis is not None
    return [(o.signal.value, o.source, o.detail) for o in diagnosis.observations]


def test_a_healthy_node_passes_every_tool_on_the_documented_command_lines(tmp_path):
    tools = RecordedTools(HEALTHY_H100)
    answer = _diagnose(tmp_path, tools)
    assert answer.status_code == 200, answer.json()
    assert tools.ran == [DCGM, NCCL, NVBW]
    assert _checks(answer) == {"dcgmi": ("pass", ""), "all_reduce_perf": ("pass", ""), "nvbandwidth": ("pass", "")}
    assert _signals(answer) == []


@pytest.mark.parametrize(
    ("argv", "status", "output", "signal", "why"),
    [
        # dcgmi exits nonzero when a test fails; its JSON says which (DCGM 3's and 4's documents).
        (DCGM, 226, "dcgmi-diag-r3-fail.json", "diag_failure", "GPU Memory on GPU 3 (Pending page retirements"),
        (DCGM, 0, "dcgmi-diag-r3-fail-dcgm4.json", "diag_failure", "memory on GPU 6 (Error using CUDA API"),
        (NVBW, 0, "nvbandwidth-h2d-8xh100-one-slow-link.txt", "nvbandwidth_low", "GPU 5 is 13.21"),
    ],
)
def test_each_finding_is_its_signals_observation(tmp_path, argv, status, output, signal, why):
    answer = _diagnose(tmp_path, RecordedTools({**HEALTHY_H100, argv: (status, output)}))
    assert answer.status_code == 200, answer.json()  # a finding is an answer, judged by the control plane
    ((seen, source, detail),) = _signals(answer)
    assert (seen, source) == (signal, argv[0]) and why in detail, detail
    assert _checks(answer)[argv[0]][0] == "fail"


def test_a_slow_all_reduce_is_held_to_its_own_gpu_types_floor(tmp_path):
    b200 = {
        DCGM: (0, "dcgmi-diag-r3-pass.json"),
        NCCL: (0, "all_reduce_perf-8xb200-slow.txt"),
        NVBW: (0, "nvbandwidth-h2d-8xb200.txt"),
    }
    answer = _diagnose(tmp_path, RecordedTools(b200), gpu_name="NVIDIA B200")
    ((signal, _, detail),) = _signals(answer)
    assert signal == "nccl_allreduce_slow"
    assert "NCCL bus bandwidth 381.2 GB/s is below the B200 floor of 650 GB/s" in detail


def test_a_tool_that_is_not_installed_is_not_run_never_a_pass(tmp_path):
    tools = RecordedTools(HEALTHY_H100, missing=("nvbandwidth", "all_reduce_perf"))
    answer = _diagnose(tmp_path, tools)
    assert answer.status_code == 200, answer.json()  # unlike burn-in: what could run, ran
    assert tools.ran == [DCGM]
    checks = _checks(answer)
    assert checks["dcgmi"] == ("pass", "")
    assert checks["nvbandwidth"] == ("not_run", "nvbandwidth is not installed")
    assert checks["all_reduce_perf"][0] == "not_run"
    assert _signals(answer) == []
    none = _diagnose(tmp_path / "none", RecordedTools({}, missing=("dcgmi", "nvbandwidth", "all_reduce_perf")))
    assert {status for status, _ in _checks(none).values()} == {"not_run"}


@pytest.mark.parametrize(
    ("argv", "status", "output"),
    [
        (DCGM, 1, "nvbandwidth-cuda-error.txt"),  # no JSON: dcgmi could not run its tests
        (NCCL, 1, "all_reduce_perf-cuda-error.txt"),
        (NCCL, 0, "all_reduce_perf-cuda-error.txt"),  # no figure printed
        (NVBW, 0, "nvbandwidth-cuda-error.txt"),
    ],
)
def test_a_run_that_says_nothing_judgeable_is_an_error_not_a_finding(tmp_path, argv, status, output):
    answer = _diagnose(tmp_path, RecordedTools({**HEALTHY_H100, argv: (status, output)}))
    assert answer.status_code == 200
    assert _checks(answer)[argv[0]][0] == "error"
    assert _signals(answer) == []


def test_the_check_of_each_tool_from_canned_text():
    check, why = diagnostic_check("dcgmi", None, 8, DEFAULT_BURN_IN)
    assert (check.status, why) == ("not_run", None)
    result = CommandResult(0, (RECORDED / "all_reduce_perf-8xh100.txt").read_text())
    assert diagnostic_check("all_reduce_perf", result, 8, DEFAULT_BURN_IN)[0].status == "pass"


def test_a_node_a_tenant_holds_is_never_diagnosed(tmp_path):
    tools = RecordedTools(HEALTHY_H100)
    refused = _diagnose(tmp_path, tools, tenant="t-1")
    assert refused.status_code == 409
    assert "idle" in refused.json()["detail"]
    assert tools.ran == []  # nothing ran on the tenant's node


async def test_the_simulated_node_answers_from_its_fault_model():
    fleet = Fleet(FleetSpec(nodes=3, latency_scale=0.0))
    healthy, latent, held = fleet.nodes.values()
    latent.hardware_fault = "GPU 3: row remap failure"
    held.tenant_id = "t-1"
    status, body = await fleet.act(healthy, AgentAction.DIAGNOSE, ActionRequest(request_id="r1"))
    assert status == 200
    diagnosis = ActionAnswer.model_validate(body).diagnosis
    assert diagnosis is not None and diagnosis.observations == []
    assert {c.status for c in diagnosis.checks} == {"pass"}
    status, body = await fleet.act(latent, AgentAction.DIAGNOSE, ActionRequest(request_id="r2"))
    diagnosis = ActionAnswer.model_validate(body).diagnosis
    assert diagnosis is not None
    ((observation),) = diagnosis.observations
    assert observation.signal.value == "diag_failure" and "row remap failure" in observation.detail
    status, _ = await fleet.act(held, AgentAction.DIAGNOSE, ActionRequest(request_id="r3"))
    assert status == 409
