"""The production agent and a simulated node are one agent over two kinds of hardware: both answer
actions with the action core (`agent/action_core.py`), so the same sequence of actions gets the
same status codes and the same bodies from both, but for what names the node itself (its id, its
boot) and the hardware's own words in a wipe's cleaning steps. A rule added to the core reaches
both at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.agent import action_core
from gpucloud.agent.action_core import Outcome, problem
from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.tools import CommandResult, CommandRunner
from gpucloud.protocol.actions import ActionRequest, AgentAction
from gpucloud.sim.nodes import Fleet, FleetSpec, SimNode
from gpucloud.sim.probe import SimulatedProbe

pytestmark = pytest.mark.unit

A = AgentAction
RECORDED = Path(__file__).parent.parent / "fixtures" / "tools"
DISK = "/dev/nvme1n1"  # the simulated nodes' tenant disk (`sim/nodes.py`), an NVMe with crypto erase
# What each tool a healthy 8 x H100 node runs prints (recorded from their documentation).
OUTPUTS = {
    ("nvidia-smi", "--gpu-reset"): "nvidia-smi-gpu-reset-ok.txt",
    ("systemctl", "reboot"): None,
    ("dcgmi", "diag", "-r", "3", "-j"): "dcgmi-diag-r3-pass.json",
    ("all_reduce_perf", "-b", "8M", "-e", "8G", "-f", "2", "-g", "8"): "all_reduce_perf-8xh100.txt",
    ("nvbandwidth", "-t", "host_to_device_memcpy_ce"): "nvbandwidth-h2d-8xh100.txt",
    ("nvme", "id-ctrl", DISK, "-o", "json"): "nvme-id-ctrl-crypto-erase.json",
    ("nvme", "format", DISK, "--ses=2", "--force"): "nvme-format-ok.txt",
}

# What each cleaning step says in the hardware's own words: the GPU reset tool's output, the
# tenant files' directory and what was in it.
OWN_WORDS = {"gpu_reset": ("answer",), "scratch": ("answer", "target")}

# Each step: (action, request id, tenant, credential). Request id r1 comes again: a replay.
SEQUENCE = [
    (A.INSPECT, "r0", None, None),
    (A.PROVISION, "r1", "ten_a", None),
    (A.PROVISION, "r2", "ten_b", None),  # another tenant's data: 409
    (A.WIPE, "r3", None, None),  # the workload runs: 409
    (A.BURN_IN, "r4", None, None),  # not wiped: 409
    (A.PROVISION, "r5", None, None),  # no tenant: 422
    (A.RESET, "r6", None, None),
    (A.PROVISION, "r1", "ten_a", None),  # a replay: the first answer
    (A.RELEASE, "r7", None, None),
    (A.BURN_IN, "r8", None, None),  # released, not wiped: 409
    (A.WIPE, "r9", None, "next"),
    (A.BURN_IN, "r10", None, None),
    (A.REBOOT, "r11", None, None),
    (A.PROVISION, "r12", "ten_b", None),
    (A.REBOOT, "r13", None, None),
]


class RecordedNode(CommandRunner):
    """The tools of a healthy node, each answering its documented command line as recorded, and
    its one tenant disk."""

    def which(self, tool: str) -> str | None:
        return f"/usr/bin/{tool}"

    def is_block_device(self, path: str) -> bool:
        return path == DISK

    def run(self, argv: tuple[str, ...], timeout_s: float) -> CommandResult:
        assert argv in OUTPUTS, f"undocumented command line {argv}"
        name = OUTPUTS[argv]
        return CommandResult(0, (RECORDED / name).read_text() if name else "")


def _production(tmp_path: Path) -> Agent:
    (tmp_path / "mounts").write_text("/dev/nvme0n1p2 / ext4 rw,relatime 0 0\n")
    state = HostState(node_id="gpu-1", boot_id="boot-1", scratch_dir=tmp_path / "scratch")
    probe = SimulatedProbe("gpu-1", gpu_count=8)
    return Agent(
        state, probe, runner=RecordedNode(), inspect_stack=False, tenant_disks=(DISK,), mounts_file=tmp_path / "mounts"
    )


def _simulated() -> tuple[Fleet, SimNode]:
    fleet = Fleet(FleetSpec(nodes=1, latency_scale=0.0))
    return fleet, fleet.nodes["sim-00000"]


def _request(request_id: str, tenant: str | None, credential: str | None, node_id: str) -> ActionRequest:
    return ActionRequest(
        request_id=request_id, tenant_id=tenant, credential=f"gpa_{node_id}.{credential}" if credential else None
    )


def _but_the_node(outcome: Outcome) -> Outcome:
    """The answer without what names the node (its id, its boot) or is its hardware's own words
    (what its tools printed, where it keeps its tenant's files)."""
    status, body = outcome
    body = {k: v for k, v in body.items() if k not in ("node_id", "boot_id")}
    if body.get("cleaning"):
        body["cleaning"] = [step | dict.fromkeys(OWN_WORDS.get(step["step"], ()), "") for step in body["cleaning"]]
    return status, body


async def _both(tmp_path: Path, sequence=SEQUENCE) -> tuple[list[Outcome], list[Outcome], Agent, SimNode]:
    agent = _production(tmp_path)
    fleet, node = _simulated()
    real, simulated = [], []
    for action, request_id, tenant, credential in sequence:
        real.append(await agent.act(action, _request(request_id, tenant, credential, agent.state.node_id)))
        simulated.append(await fleet.act(node, action, _request(request_id, tenant, credential, node.id)))
    return real, simulated, agent, node


async def test_the_production_agent_and_a_simulated_node_answer_alike(tmp_path):
    real, simulated, agent, node = await _both(tmp_path)
    assert [status for status, _ in real] == [200, 200, 409, 409, 409, 422, 200, 200, 200, 409, 200, 200, 200, 200, 200]
    assert [_but_the_node(o) for o in real] == [_but_the_node(o) for o in simulated]
    refused = [body for status, body in real if status >= 400]
    assert refused == [body for status, body in simulated if status >= 400]  # refusals word for word
    assert real[7] == real[1] and simulated[7] == simulated[1]  # a replay is answered, not re-run
    disk = next(step for step in real[10][1]["cleaning"] if step["step"] == "disk_sanitize")
    assert disk["method"] == "crypto_erase" and disk["target"] == DISK
    # What the wipe handed over is what each agent reports with now.
    assert agent.state.credential == "gpa_gpu-1.next" and node.credential == "gpa_sim-00000.next"
    assert (agent.state.tenant_id, agent.state.workload_running) == (node.tenant_id, node.workload_running)


async def test_a_rule_added_to_the_core_reaches_both_agents(tmp_path, monkeypatch):
    """Say the core learns that a repair rung waits until the tenant's workload is released:
    both kinds of agent refuse alike, with nothing added to either."""
    kept = action_core.refusal

    def with_a_new_rule(action: AgentAction, req: ActionRequest, node: action_core.Tenancy) -> Outcome | None:
        if action == A.RESET and node.workload_running:
            return problem(409, "Workload running", "a repair waits until the workload is released")
        return kept(action, req, node)

    monkeypatch.setattr(action_core, "refusal", with_a_new_rule)
    sequence = [(A.PROVISION, "p", "ten_a", None), (A.RESET, "x", None, None), (A.RELEASE, "r", None, None)]
    sequence.append((A.RESET, "y", None, None))
    real, simulated, _, _ = await _both(tmp_path, sequence)
    assert [status for status, _ in real] == [status for status, _ in simulated] == [200, 409, 200, 200]
    assert real[1] == simulated[1] and "a repair waits" in real[1][1]["detail"]


async def test_hardware_that_fails_burn_in_is_refused_in_the_same_words(tmp_path):
    """A failing tool on a real node and a hardware fault on a simulated one: the same refusal,
    each saying what its hardware found."""
    agent = _production(tmp_path)
    agent.runner.run = lambda argv, timeout_s: CommandResult(1, "diag: FAIL")  # type: ignore[method-assign]
    fleet, node = _simulated()
    node.hardware_fault = "GPU 3 fell off the bus"
    real = await agent.act(A.BURN_IN, _request("b", None, None, agent.state.node_id))
    simulated = await fleet.act(node, A.BURN_IN, _request("b", None, None, node.id))
    assert real[0] == simulated[0] == 422
    assert {k: real[1][k] for k in ("type", "title")} == {k: simulated[1][k] for k in ("type", "title")}
    assert "dcgmi diag -r 3 -j exited 1" in real[1]["detail"] and "fell off the bus" in simulated[1]["detail"]
