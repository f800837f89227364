"""Bring-up inspection over recorded outputs of the real tools (an HGX H100 node as it should
be, `tests/fixtures/inspection/hgx-h100/`), passing and failing at each layer in order; and the
agent's `inspect` answering with the first failing layer."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from gpucloud.agent import inspection
from gpucloud.agent.app import Agent
from gpucloud.agent.host import HostState
from gpucloud.agent.inspection import COMMANDS, GPU_QUERY, LAYERS, Output, at_least, judge
from gpucloud.agent.tools import CommandResult, CommandRunner
from gpucloud.protocol.actions import ActionRequest
from gpucloud.sim.probe import SimulatedProbe

pytestmark = pytest.mark.unit

RECORDED = Path(__file__).parent.parent / "fixtures" / "inspection" / "hgx-h100"
FILES = {
    GPU_QUERY: "nvidia-smi-query.txt",
    ("nvidia-smi", "--version"): "nvidia-smi-version.txt",
    ("uname", "-r"): "uname-r.txt",
    ("systemctl", "is-active", "nvidia-fabricmanager"): "systemctl-fabricmanager.txt",
    ("lsmod",): "lsmod.txt",
    ("ibstat",): "ibstat.txt",
    ("ldconfig", "-p"): "ldconfig-p.txt",
    ("nvidia-ctk", "--version"): "nvidia-ctk-version.txt",
}


def recorded() -> dict[tuple[str, ...], Output]:
    assert set(FILES) == set(COMMANDS)
    return {argv: Output(0, (RECORDED / name).read_text()) for argv, name in FILES.items()}


def with_output(argv: tuple[str, ...], text: str, returncode: int | None = 0) -> dict[tuple[str, ...], Output]:
    outputs = recorded()
    outputs[argv] = Output(returncode, text)
    return outputs


def test_a_healthy_hgx_h100_passes_every_layer_in_order():
    report = judge("H100", recorded())
    assert report.ok, report.summary()
    assert [c.layer for c in report.layers] == list(LAYERS)
    assert all(c.status == "ok" for c in report.layers), report.layers
    assert report.found == {
        "vbios": "96.00.99.00.01",
        "kernel": "5.15.0-119-generic",
        "driver": "550.90.07",
        "cuda": "12.4",
        "container_toolkit": "1.16.2",
    }


def _query(driver: str = "550.90.07", vbios: str = "96.00.99.00.01", count: int = 8, name: str = "H100 80GB HBM3"):
    return "".join(f"{i}, NVIDIA {name}, {driver}, {vbios}\n" for i in range(count))


ibstat = (RECORDED / "ibstat.txt").read_text()
lsmod = (RECORDED / "lsmod.txt").read_text()

FAILURES = [
    ("firmware", with_output(GPU_QUERY, _query(vbios="96.00.61.00.01")), "VBIOS 96.00.61.00.01 is older"),
    ("os_kernel", with_output(("uname", "-r"), "5.4.0-182-generic\n"), "kernel 5.4.0-182-generic is older than 5.15"),
    ("gpu_driver", with_output(GPU_QUERY, _query(driver="525.147.05")), "driver 525.147.05 is older than 535.104.05"),
    ("gpu_driver", with_output(GPU_QUERY, _query(count=7)), "7 GPUs answer, a H100 node has 8"),
    ("gpu_driver", with_output(GPU_QUERY, _query(name="A100-SXM4-80GB")), "not a H100"),
    (
        "fabric_manager",
        with_output(("systemctl", "is-active", "nvidia-fabricmanager"), "failed\n", 3),
        "nvidia-fabricmanager is failed",
    ),
    ("network", with_output(("ibstat",), ibstat.replace("State: Active", "State: Down", 1)), "7 of 8 InfiniBand"),
    ("network", with_output(("ibstat",), ibstat.replace("Rate: 400", "Rate: 200", 1)), "mlx5_0 links at 200 Gb/s"),
    ("gpudirect", with_output(("lsmod",), lsmod.replace("nvidia_peermem", "nvidia_p2p_x")), "nvidia_peermem"),
    (
        "cuda_nccl",
        with_output(("nvidia-smi", "--version"), "DRIVER version : 550.90.07\nCUDA Version : 12.1\n"),
        "CUDA 12.1 is older than 12.2",
    ),
    ("cuda_nccl", with_output(("ldconfig", "-p"), "libc.so.6 (libc6,x86-64) => /lib/libc.so.6\n"), "NCCL"),
    ("container_runtime", with_output(("nvidia-ctk", "--version"), "", None), "nvidia-ctk is not installed"),
    (
        "container_runtime",
        with_output(("nvidia-ctk", "--version"), "NVIDIA Container Toolkit CLI version 1.13.5\n"),
        "1.13.5 is older than 1.14.0",
    ),
]


@pytest.mark.parametrize(("layer", "outputs", "cause"), FAILURES, ids=[f"{f[0]}-{i}" for i, f in enumerate(FAILURES)])
def test_the_first_failing_layer_is_reported_with_its_cause(layer, outputs, cause):
    report = judge("H100", outputs)
    failed = report.first_failure
    assert failed is not None and failed.layer == layer, report.layers
    assert cause in failed.detail, failed.detail
    # Every layer before it passed; the report names the failure first of all.
    before = report.layers[: LAYERS.index(layer)]
    assert all(c.status in ("ok", "skipped") for c in before), before
    assert report.summary().startswith(f"inspection failed at {layer}: ")


def test_a_missing_driver_is_the_drivers_failure_and_leaves_the_firmware_unverified():
    outputs = recorded()
    outputs[GPU_QUERY] = Output(None)
    report = judge("H100", outputs)
    assert report.layers[0].status == "unverified"
    assert report.first_failure is not None and report.first_failure.layer == "gpu_driver"
    assert "nvidia-smi is not installed" in report.first_failure.detail


def test_an_nvlink_switch_system_needs_the_infiniband_stack_under_its_fabric_manager():
    gb200 = {
        **recorded(),
        GPU_QUERY: Output(0, _query(name="GB200", count=4, driver="570.86.15", vbios="97.00.0B.00.01")),
        ("uname", "-r"): Output(0, "6.8.0-1015-nvidia-64k\n"),
        ("nvidia-smi", "--version"): Output(0, "CUDA Version : 12.8\n"),
        ("nvidia-ctk", "--version"): Output(0, "NVIDIA Container Toolkit CLI version 1.17.4\n"),
    }
    assert judge("GB200", gb200).ok, judge("GB200", gb200).summary()
    no_ib = {**gb200, ("lsmod",): Output(0, lsmod.replace("ib_umad", "xx_umad"))}
    failed = judge("GB200", no_ib).first_failure
    assert failed is not None and failed.layer == "fabric_manager" and "ib_umad" in failed.detail


def test_versions_compare_as_numbers_and_vbios_as_hex():
    assert at_least("550.90.07", "535.104.05") and not at_least("535.54.03", "535.104.05")
    assert at_least("96.00.A5.00.01", "96.00.9f.00.00") and not at_least("96.00.74.00.00", "96.00.9f.00.00")
    assert at_least("12.10", "12.8")
    assert judge("TPU", recorded()).first_failure.detail == "no version policy for GPU type 'TPU' in the catalogue"


class RecordedTools(CommandRunner):
    """The node's tools as recorded; `nvidia-smi --version` may be made to fail."""

    def __init__(self, outputs: dict[tuple[str, ...], Output]) -> None:
        self.outputs = outputs

    def which(self, tool: str) -> str | None:
        return (
            f"/usr/bin/{tool}"
            if any(a[0] == tool and o.returncode is not None for a, o in self.outputs.items())
            else None
        )

    def run(self, argv, timeout_s):
        out = self.outputs.get(tuple(argv))
        if out is None or out.returncode is None:
            raise subprocess.SubprocessError(f"{argv} not recorded")
        return CommandResult(out.returncode, out.text)


def _inspect(tmp_path, outputs) -> tuple[int, dict]:
    state = HostState(node_id="gpu-1", boot_id="b", scratch_dir=tmp_path)
    agent = Agent(state, SimulatedProbe("gpu-1", gpu_count=8), runner=RecordedTools(outputs), gpu_type="H100")
    return asyncio.run(agent.act("inspect", ActionRequest(request_id="r1")))


def test_the_agent_answers_inspect_with_the_first_failing_layer(tmp_path):
    status, body = _inspect(tmp_path, recorded())
    assert status == 200, body
    status, body = _inspect(tmp_path, with_output(("lsmod",), lsmod.replace("nvidia_peermem", "nvidia_p2p_x")))
    assert status == 422 and body["layer"] == "gpudirect", body
    assert body["detail"].startswith("inspection failed at gpudirect: nvidia_peermem is not loaded")
    assert [entry["layer"] for entry in body["layers"]] == list(LAYERS)


def test_inspection_reads_only_the_listed_commands():
    # One command per piece of evidence, each run once: nothing slow, nothing that changes the node.
    assert len(set(inspection.COMMANDS)) == len(inspection.COMMANDS)
    assert all(
        argv[0] in {"nvidia-smi", "uname", "systemctl", "lsmod", "ibstat", "ldconfig", "nvidia-ctk"}
        for argv in COMMANDS
    )


def test_ibstat_with_a_port_polling_fails_the_network_layer():
    """ibstat (infiniband-diags) as it prints a port whose cable is out (tests/fixtures/tools/)."""
    outputs = recorded()
    outputs[("ibstat",)] = Output(0, (RECORDED.parent.parent / "tools" / "ibstat-port-polling.txt").read_text())
    failed = judge("H100", outputs).first_failure
    assert failed is not None and failed.layer == "network"
    assert "mlx5_0 (Down, Polling)" in failed.detail
