"""The hardware tools a node's agent runs (burn-in, the repair ladder's rungs) and how their
output is judged: `ACTION_COMMANDS`, `BurnInLimits`, and the `CommandRunner` they run through,
which tests (and a dry run) replace."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from gpucloud.agent.readings import NodeReading

# The tools each hardware action runs, in order; every one must exit 0 ("{gpus}": the node's
# GPU count). Burn-in also holds the figures some print to `BurnInLimits`, then reads the GPUs
# once more, hot from the stress, for the thermal soak.
ACTION_COMMANDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "burn_in": (
        ("dcgmi", "diag", "-r", "3"),
        ("all_reduce_perf", "-b", "8M", "-e", "8G", "-f", "2", "-g", "{gpus}"),
        ("nvbandwidth", "-t", "host_to_device_memcpy_ce"),
    ),
    "reset": (("nvidia-smi", "--gpu-reset"),),
    "reboot": (("systemctl", "reboot"),),
    "reflash": (("nvfwupd", "update", "--yes"),),
}
ACTIONS = ("inspect", "burn_in", "provision", "release", "wipe", "reset", "reboot", "reflash")


@dataclass(frozen=True)
class BurnInLimits:
    """What a node must show in burn-in to go back to the pool."""

    min_busbw_gbps: float = 350.0
    """NCCL all-reduce average bus bandwidth across the node's GPUs (an 8 x H100 NVLink node
    reaches about 450)."""
    min_h2d_gbps_per_gpu: float = 40.0
    """Host-to-GPU copy bandwidth per GPU (PCIe Gen5 x16 reaches about 55)."""
    max_temperature_c: int = 87
    """Hottest GPU right after the stress (the thermal soak); any hardware thermal slowdown fails too."""


DEFAULT_BURN_IN = BurnInLimits()

_BUSBW = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.]+)")
_H2D_SUM = re.compile(r"^SUM host_to_device_memcpy_ce\s+([0-9.]+)", re.MULTILINE)


def burn_in_figure(tool: str, output: str, gpus: int, limits: BurnInLimits) -> str | None:
    """Why the tool's figures fail the limits (or cannot be read); None when they pass."""
    if tool == "all_reduce_perf":
        found = _BUSBW.search(output)
        if found is None:
            return "all_reduce_perf printed no average bus bandwidth"
        busbw = float(found.group(1))
        if busbw < limits.min_busbw_gbps:
            return f"NCCL all-reduce bus bandwidth {busbw:g} GB/s is below {limits.min_busbw_gbps:g} GB/s"
    elif tool == "nvbandwidth":
        found = _H2D_SUM.search(output)
        if found is None:
            return "nvbandwidth printed no host_to_device_memcpy_ce sum"
        per_gpu = float(found.group(1)) / max(1, gpus)
        if per_gpu < limits.min_h2d_gbps_per_gpu:
            return f"host-to-GPU bandwidth {per_gpu:.1f} GB/s per GPU is below {limits.min_h2d_gbps_per_gpu:g} GB/s"
    return None


def thermal_soak(reading: NodeReading, limits: BurnInLimits) -> str | None:
    """Why the GPUs, read right after the stress, fail the thermal soak; None when they pass."""
    for gpu in reading.gpus:
        if gpu.temperature_c is not None and gpu.temperature_c > limits.max_temperature_c:
            return f"GPU {gpu.index} at {gpu.temperature_c} C after the stress (limit {limits.max_temperature_c} C)"
        thermal = [r for r in gpu.clock_event_reason_names if r in ("hw_thermal_slowdown", "hw_slowdown")]
        if thermal:
            return f"GPU {gpu.index} throttled after the stress ({', '.join(thermal)})"
    return None


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    output: str


class CommandRunner:
    """Finds and runs the hardware tools; tests pass their own."""

    def which(self, tool: str) -> str | None:
        return shutil.which(tool)

    def run(self, argv: tuple[str, ...], timeout_s: float) -> CommandResult:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        return CommandResult(proc.returncode, (proc.stdout + proc.stderr)[-65536:])
