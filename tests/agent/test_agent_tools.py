"""The agent's hardware actions (burn-in, reset, reflash) run against recorded outputs of the real
tools (`tests/fixtures/tools/`, taken from each tool's documentation) through a fake runner: every
argv is the documented one, every failure output fails the step with a reason naming the tool, and
burn-in holds each GPU type to its own floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.tools import BurnInLimits, CommandResult, CommandRunner, dcgm_failure
from gpucloud.models.catalog import BURN_IN_FLOORS, BurnInFloor
from gpucloud.sim.probe import SimulatedProbe
from support.agents import agent_test_client

pytestmark = pytest.mark.unit

RECORDED = Path(__file__).parent.parent / "fixtures" / "tools"

# The documented command lines (see the comments on ACTION_COMMANDS for each document).
DCGM = ("dcgmi", "diag", "-r", "3", "-j")
NCCL = ("all_reduce_perf", "-b", "8M", "-e", "8G", "-f", "2", "-g", "8")
NVBW = ("nvbandwidth", "-t", "host_to_device_memcpy_ce")
RESET = ("nvidia-smi", "--gpu-reset")
REFLASH = ("nvfwupd", "-c", "/etc/gpucloud/nvfwupd.yaml", "update_fw", "-y")

HEALTHY_H100 = {
    DCGM: (0, "dcgmi-diag-r3-pass.json"),
    NCCL: (0, "all_reduce_perf-8xh100.txt"),
    NVBW: (0, "nvbandwidth-h2d-8xh100.txt"),
    RESET: (0, "nvidia-smi-gpu-reset-ok.txt"),
    REFLASH: (0, "nvfwupd-update-ok.txt"),
}


class RecordedTools(CommandRunner):
    """Answers each documented argv with its recorded output; any other argv is a test failure."""

    def __init__(self, outputs: dict[tuple[str, ...], tuple[int, str]]) -> None:
        self.outputs, self.ran = outputs, []

    def which(self, tool: str) -> str | None:
        return f"/usr/bin/{tool}"

    def run(self, argv, timeout_s):
        self.ran.append(argv)
        assert argv in self.outputs, f"undocumented command line {argv}"
        returncode, name = self.outputs[argv]
        return CommandResult(returncode, (RECORDED / name).read_text())


def _act(tmp_path, action: str, tools: RecordedTools, *, gpu_name: str = "NVIDIA H100 80GB HBM3", limits=None):
    probe = SimulatedProbe("gpu-1", gpu_count=8, gpu_name=gpu_name)
    state = HostState(node_id="gpu-1", boot_id="b", scratch_dir=tmp_path / "s")
    agent = Agent(state, probe, runner=tools, **({"burn_in_limits": limits} if limits else {}))
    with agent_test_client(agent) as client:
        return client.post(f"/actions/{action}", json={"request_id": "r1"})


@pytest.mark.parametrize(
    ("action", "argvs"), [("burn_in", [DCGM, NCCL, NVBW]), ("reset", [RESET]), ("reflash", [REFLASH])]
)
def test_each_action_runs_the_documented_command_lines(tmp_path, action, argvs):
    tools = RecordedTools(HEALTHY_H100)
    answer = _act(tmp_path, action, tools)
    assert answer.status_code == 200, answer.json()
    assert tools.ran == argvs


FAILURES = [
    # (action, argv, exit status, recorded output, what the reason must say)
    ("burn_in", DCGM, 0, "dcgmi-diag-r3-fail.json", "dcgmi diag failed: GPU Memory on GPU 3 (Pending page retirements"),
    ("burn_in", DCGM, 0, "dcgmi-diag-r3-fail-dcgm4.json", "dcgmi diag failed: memory on GPU 6 (Error using CUDA API"),
    ("burn_in", DCGM, 226, "dcgmi-diag-r3-fail.json", "burn_in: dcgmi diag -r 3 -j exited 226"),
    ("burn_in", NCCL, 0, "all_reduce_perf-cuda-error.txt", "all_reduce_perf printed no average bus bandwidth"),
    ("burn_in", NCCL, 1, "all_reduce_perf-cuda-error.txt", "all_reduce_perf -b 8M -e 8G -f 2 -g 8 exited 1"),
    (
        "burn_in",
        NVBW,
        0,
        "nvbandwidth-h2d-8xh100-one-slow-link.txt",
        "nvbandwidth: host-to-GPU bandwidth of GPU 5 is 13.21",
    ),
    ("burn_in", NVBW, 1, "nvbandwidth-cuda-error.txt", "nvbandwidth -t host_to_device_memcpy_ce exited 1"),
    ("burn_in", NVBW, 0, "nvbandwidth-cuda-error.txt", "nvbandwidth printed no host_to_device_memcpy_ce figures"),
    ("reset", RESET, 255, "nvidia-smi-gpu-reset-in-use.txt", "nvidia-smi --gpu-reset exited 255"),
    ("reflash", REFLASH, 1, "nvfwupd-update-failed.txt", "nvfwupd -c /etc/gpucloud/nvfwupd.yaml update_fw -y exited 1"),
    # Exit 0 is not enough: what the tool printed says whether it did what was asked.
    ("reset", RESET, 0, "nvidia-smi-gpu-reset-in-use.txt", "nvidia-smi could not reset every GPU"),
    (
        "reflash",
        REFLASH,
        0,
        "nvfwupd-update-failed.txt",
        "nvfwupd did not report a successful update (TaskState: Exception)",
    ),
]


@pytest.mark.parametrize(
    ("action", "argv", "status", "output", "why"), FAILURES, ids=[f"{f[3]}-exit{f[2]}" for f in FAILURES]
)
def test_each_failure_output_fails_the_step_naming_the_tool(tmp_path, action, argv, status, output, why):
    tools = RecordedTools({**HEALTHY_H100, argv: (status, output)})
    failed = _act(tmp_path, action, tools)
    assert failed.status_code == 422, failed.json()
    assert why in failed.json()["detail"], failed.json()["detail"]
    assert tools.ran[-1] == argv  # it stopped at the failing tool


def test_a_failing_tools_output_names_the_failure_not_the_json_around_it():
    assert dcgm_failure((RECORDED / "dcgmi-diag-r3-pass.json").read_text()) is None
    assert dcgm_failure("Error: unable to establish a connection to the host engine\n") == (
        "dcgmi diag printed no JSON result"
    )


def test_burn_in_holds_each_gpu_type_to_its_own_floor(tmp_path):
    b200 = {**HEALTHY_H100, NCCL: (0, "all_reduce_perf-8xb200-slow.txt")}
    # 381 GB/s of all-reduce: a healthy H100 node, a B200 node with failing NVLink.
    assert _act(tmp_path / "h100", "burn_in", RecordedTools(HEALTHY_H100)).status_code == 200
    failed = _act(tmp_path / "b200", "burn_in", RecordedTools(b200), gpu_name="NVIDIA B200")
    assert failed.status_code == 422
    assert "NCCL bus bandwidth 381.2 GB/s is below the B200 floor of 650 GB/s" in failed.json()["detail"]
    fast = {**b200, NCCL: (0, "all_reduce_perf-8xb200.txt"), NVBW: (0, "nvbandwidth-h2d-8xb200.txt")}
    passed = _act(tmp_path / "b200-fast", "burn_in", RecordedTools(fast), gpu_name="NVIDIA B200")
    assert passed.status_code == 200, passed.json()


def _h100_floor(**changes) -> BurnInLimits:
    floor = {"min_busbw_gbps": 350.0, "min_h2d_gbps_per_gpu": 40.0, "max_temperature_c": 87} | changes
    return BurnInLimits(floors={**BURN_IN_FLOORS, "H100": BurnInFloor(**floor)})


def test_an_operators_floor_replaces_the_catalogues(tmp_path):
    strict = _h100_floor(min_busbw_gbps=450.0)
    failed = _act(tmp_path, "burn_in", RecordedTools(HEALTHY_H100), limits=strict)
    assert "below the H100 floor of 450 GB/s" in failed.json()["detail"]


def test_the_thermal_soak_holds_each_gpu_type_to_its_limit(tmp_path):
    hot = _h100_floor(max_temperature_c=20)
    failed = _act(tmp_path, "burn_in", RecordedTools(HEALTHY_H100), limits=hot)
    assert "thermal soak: GPU 0 at" in failed.json()["detail"] and "the H100 limit is 20 C" in failed.json()["detail"]
    unknown = _act(tmp_path / "x", "burn_in", RecordedTools(HEALTHY_H100), gpu_name="NVIDIA RTX 6000 Ada")
    assert unknown.status_code == 422  # no floor for it: never a pass


def test_the_floors_are_per_gpu_type_for_every_type_sold():
    assert {"H100", "H200", "B200", "GB200"} <= set(BURN_IN_FLOORS)
    assert BURN_IN_FLOORS["B200"].min_busbw_gbps > BURN_IN_FLOORS["H100"].min_busbw_gbps
    limits = BurnInLimits()
    assert limits.for_device("NVIDIA GB200")[0] == "GB200"  # not taken for a B200
    assert limits.for_device("NVIDIA H200")[0] == "H200"
