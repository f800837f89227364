"""The hardware tools a node's agent runs (burn-in, the repair ladder's rungs), called as their own
documentation gives them, and how their output is judged: `ACTION_COMMANDS`, `BurnInLimits` (per
GPU type), and the `CommandRunner` they run through, which tests (and a dry run) replace."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gpucloud.models.catalog import BURN_IN_FLOORS, BurnInFloor
from gpucloud.protocol.actions import AgentAction, Diagnosis, DiagnosticCheck
from gpucloud.protocol.reports import NodeReading, Signal, SignalObservation

# The tools each hardware action runs, in order, each as its own documentation gives it; every one
# must exit 0 ("{gpus}": the node's GPU count). Burn-in also holds the figures some print to
# `BurnInLimits`, then reads the GPUs once more, hot from the stress, for the thermal soak.
# Recorded outputs of each, success and failure: tests/fixtures/tools/ (its README says whence).
# A wipe's tools (the reset below, then each tenant disk's sanitize): `agent/cleaning.py`.
NVFWUPD_CONFIG = "/etc/gpucloud/nvfwupd.yaml"
ACTION_COMMANDS: dict[AgentAction, tuple[tuple[str, ...], ...]] = {
    AgentAction.BURN_IN: (
        # DCGM user guide, "DCGM Diagnostics": `dcgmi diag -r 3` runs level 3; `-j` prints JSON.
        ("dcgmi", "diag", "-r", "3", "-j"),
        # nccl-tests README: `all_reduce_perf -b 8 -e 128M -f 2 -g <ngpus>`; 8 MB to 8 GB here.
        ("all_reduce_perf", "-b", "8M", "-e", "8G", "-f", "2", "-g", "{gpus}"),
        # nvbandwidth README: `./nvbandwidth -t <testcase>`.
        ("nvbandwidth", "-t", "host_to_device_memcpy_ce"),
    ),
    # nvidia-smi(1): `-r, --gpu-reset`; without `-i` it resets every GPU, which an NVSwitch
    # board needs anyway once the tenant is gone. Exit status nonzero on failure (RETURN VALUE).
    AgentAction.RESET: (("nvidia-smi", "--gpu-reset"),),
    AgentAction.REBOOT: (("systemctl", "reboot"),),
    # NVIDIA's nvfwupd guide: `nvfwupd [-t ip=<BMC> user=.. password=..] update_fw -p <pkg> -y`;
    # "run locally ... connect to the host Redfish interface IP address" (DGX firmware update
    # guide, nvfwupd reference). The target, its credentials and the package sit in the config
    # file (`-c`, its BMC_IP / RF_USERNAME / RF_PASSWORD / FWUpdateFilePath keys: "Platform-
    # Agnostic Firmware Updates ... Using the Config File"), so no password is on the process list.
    AgentAction.REFLASH: (("nvfwupd", "-c", NVFWUPD_CONFIG, "update_fw", "-y"),),
}

# A diagnose's tools (`AgentAction.DIAGNOSE`, on an idle node, on a schedule): short ones. DCGM's
# level 1 ("quick": deployment and software checks, seconds) rather than burn-in's level 3; the
# NCCL all-reduce and nvbandwidth as burn-in runs them, so their figures meet the same floors.
# Unlike burn-in's, a tool that is not installed is reported `not_run`, never taken for a pass.
DIAGNOSE_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("dcgmi", "diag", "-r", "1", "-j"),
    ACTION_COMMANDS[AgentAction.BURN_IN][1],
    ACTION_COMMANDS[AgentAction.BURN_IN][2],
)
# The signal each diagnostic tool's failure is, as the signal table names it.
DIAGNOSE_SIGNALS = {
    "dcgmi": Signal.DIAG_FAILURE,
    "all_reduce_perf": Signal.NCCL_ALLREDUCE_SLOW,
    "nvbandwidth": Signal.NVBANDWIDTH_LOW,
}


@dataclass(frozen=True)
class BurnInLimits:
    """What a node must show in burn-in to go back to the pool, per GPU type: the catalogue's
    floors (`models.catalog.BURN_IN_FLOORS`) unless an operator passes their own."""

    floors: Mapping[str, BurnInFloor] = field(default_factory=lambda: dict(BURN_IN_FLOORS))

    def for_device(self, device_name: str) -> tuple[str, BurnInFloor] | None:
        """The GPU type and its floor for a device name as the tools print it ("NVIDIA H100 80GB
        HBM3"); longest type first, so a GB200 is not taken for a B200."""
        name = device_name.upper()
        gpu_type = next((t for t in sorted(self.floors, key=len, reverse=True) if t in name), None)
        return None if gpu_type is None else (gpu_type, self.floors[gpu_type])


DEFAULT_BURN_IN = BurnInLimits()

_BUSBW = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.]+)")
# nccl-tests: "#  Rank  0 Group  0 Pid  4711 on hgx-01 device  0 [0x18] NVIDIA H100 80GB HBM3"
_NCCL_DEVICE = re.compile(r"^#\s+Rank\s+\d+.*\sdevice\s+\d+\s+\[[^\]]*\]\s+(.+?)\s*$", re.MULTILINE)
# nvbandwidth: "Device 0: NVIDIA H100 80GB HBM3 (00000000:18:00)"
_NVBW_DEVICE = re.compile(r"^Device \d+: (.+?)(?: \([0-9a-fA-F:.]+\))?\s*$", re.MULTILINE)


def burn_in_figure(tool: str, output: str, gpus: int, limits: BurnInLimits) -> str | None:
    """Why the tool's output fails burn-in (or cannot be read); None when it passes. Its figures
    are held to the floor of the GPUs the tool itself says it measured."""
    if tool == "dcgmi":
        return dcgm_failure(output)
    if tool == "all_reduce_perf":
        found = _BUSBW.search(output)
        if found is None:
            return "all_reduce_perf printed no average bus bandwidth"
        floor = _floor_of(tool, _NCCL_DEVICE.findall(output), limits)
        if isinstance(floor, str):
            return floor
        gpu_type, limit = floor
        busbw = float(found.group(1))
        if busbw < limit.min_busbw_gbps:
            return (
                f"all_reduce_perf: NCCL bus bandwidth {busbw:g} GB/s is below the {gpu_type} floor "
                f"of {limit.min_busbw_gbps:g} GB/s"
            )
    elif tool == "nvbandwidth":
        per_gpu = _h2d_per_gpu(output)
        if not per_gpu:
            return "nvbandwidth printed no host_to_device_memcpy_ce figures"
        if len(per_gpu) < gpus:
            return f"nvbandwidth measured {len(per_gpu)} of the node's {gpus} GPUs"
        floor = _floor_of(tool, _NVBW_DEVICE.findall(output), limits)
        if isinstance(floor, str):
            return floor
        gpu_type, limit = floor
        # Each GPU's own link: one slow link (a card trained at Gen4 or x8) hides in a sum.
        slowest = min(per_gpu, key=lambda gpu: per_gpu[gpu])
        if per_gpu[slowest] < limit.min_h2d_gbps_per_gpu:
            return (
                f"nvbandwidth: host-to-GPU bandwidth of GPU {slowest} is {per_gpu[slowest]:g} GB/s, below "
                f"the {gpu_type} floor of {limit.min_h2d_gbps_per_gpu:g} GB/s"
            )
    return None


def _h2d_per_gpu(output: str) -> dict[int, float]:
    """GPU index -> GB/s from nvbandwidth's matrix ("memcpy CE CPU(row) -> GPU(column) bandwidth
    (GB/s)", a header row of GPU indices, then the CPU's row of figures)."""
    lines = output.splitlines()
    for at, line in enumerate(lines):
        if "CPU(row) -> GPU(column)" in line and at + 2 < len(lines):
            columns, row = lines[at + 1].split(), lines[at + 2].split()[1:]
            try:
                return {int(c): float(v) for c, v in zip(columns, row, strict=True)}
            except ValueError:
                return {}
    return {}


def _floor_of(tool: str, devices: list[str], limits: BurnInLimits) -> tuple[str, BurnInFloor] | str:
    """The one GPU type the tool measured, with its floor; else why it cannot be judged."""
    if not devices:
        return f"{tool} named no GPU it measured"
    found = {device: limits.for_device(device) for device in devices}
    unknown = sorted({d for d, f in found.items() if f is None})
    if unknown:
        return f"{tool} measured {unknown[0]}, a GPU with no burn-in limits"
    types = {f[0] for f in found.values() if f is not None}
    if len(types) > 1:
        return f"{tool} measured GPUs of several types ({', '.join(sorted(types))})"
    return next(f for f in found.values() if f is not None)


def action_failure(tool: str, output: str) -> str | None:
    """Why a reset or reflash failed though its tool exited 0 (None: it did what it says).
    nvfwupd reports the BMC's update task (`TaskState`, `TaskStatus`) and says whether the update
    succeeded; nvidia-smi lists the GPUs it could not reset (both as their documentation shows:
    `tests/fixtures/tools/`)."""
    if tool == "nvfwupd":
        if "Firmware update successful" in output and "TaskState: Exception" not in output:
            return None
        state = next((line.strip() for line in output.splitlines() if line.startswith("TaskState:")), "")
        return f"nvfwupd did not report a successful update ({state or 'no task state'})"
    if tool == "nvidia-smi" and "could not be reset" in output:
        return "nvidia-smi could not reset every GPU: " + " ".join(output.split())[:300]
    return None


def dcgm_failure(output: str) -> str | None:
    """Why `dcgmi diag -j` failed the node: every result it marks failed, with its warning; None
    when all passed. Reads both DCGM 3's document ("DCGM GPU Diagnostic" > test_categories >
    tests, "gpu_ids") and DCGM 4's (top-level "tests", "entity_id")."""
    start, end = output.find("{"), output.rfind("}")
    try:
        document = json.loads(output[start : end + 1]) if start >= 0 else None
    except json.JSONDecodeError:
        document = None
    if not isinstance(document, dict):
        return "dcgmi diag printed no JSON result"
    failed = [
        f"{test.get('name', '?')} on GPU {result.get('gpu_ids', result.get('entity_id', '?'))}"
        + (f" ({_dcgm_warning(result)})" if _dcgm_warning(result) else "")
        for test in _dcgm_tests(document)
        for result in test.get("results", ())
        if str(result.get("status", "")).lower() == "fail"
    ]
    if failed:
        return f"dcgmi diag failed: {'; '.join(failed)}"
    return None


def _dcgm_tests(document: dict) -> list[dict]:
    legacy = document.get("DCGM GPU Diagnostic")
    if isinstance(legacy, dict):
        return [t for category in legacy.get("test_categories", ()) for t in category.get("tests", ())]
    return list(document.get("tests", ()))


def _dcgm_warning(result: dict) -> str:
    warnings = result.get("warnings") or []
    first = warnings[0] if warnings else ""
    return str(first.get("warning", "") if isinstance(first, dict) else first).strip()


def thermal_soak(reading: NodeReading, limits: BurnInLimits) -> str | None:
    """Why the GPUs, read right after the stress, fail the thermal soak; None when they pass."""
    for gpu in reading.gpus:
        floor = limits.for_device(gpu.name)
        if floor is None:
            return f"GPU {gpu.index} is a {gpu.name}, a GPU with no burn-in limits"
        gpu_type, limit = floor
        if gpu.temperature_c is not None and gpu.temperature_c > limit.max_temperature_c:
            return (
                f"GPU {gpu.index} at {gpu.temperature_c} C after the stress "
                f"(the {gpu_type} limit is {limit.max_temperature_c} C)"
            )
        thermal = [r for r in gpu.clock_event_reason_names if r in ("hw_thermal_slowdown", "hw_slowdown")]
        if thermal:
            return f"GPU {gpu.index} throttled after the stress ({', '.join(thermal)})"
    return None


def diagnostic_check(
    tool: str, result: CommandResult | None, gpus: int, limits: BurnInLimits
) -> tuple[DiagnosticCheck, str | None]:
    """One diagnostic tool's check from its run (None: not installed), and, when it failed, why
    (what its signal observation says). A failure is a finding about the hardware: DCGM marking a
    test failed, an all-reduce or a host link below the GPU type's floor. A run that says nothing
    that can be judged (no JSON, no figures, a GPU with no floor) is an `error`, not a finding."""
    if result is None:
        return DiagnosticCheck(tool=tool, status="not_run", detail=f"{tool} is not installed"), None
    if tool == "dcgmi":
        # dcgmi exits nonzero when a test fails: its JSON says which.
        why = dcgm_failure(result.output)
        if why == "dcgmi diag printed no JSON result":
            return DiagnosticCheck(tool=tool, status="error", detail=f"exit {result.returncode}: {why}"), None
        if why is not None:
            return DiagnosticCheck(tool=tool, status="fail", detail=why), why
        if result.returncode != 0:
            return DiagnosticCheck(tool=tool, status="error", detail=f"exit {result.returncode}, no test failed"), None
        return DiagnosticCheck(tool=tool, status="pass"), None
    if result.returncode != 0:
        return DiagnosticCheck(
            tool=tool, status="error", detail=f"exit {result.returncode}: {result.output[-200:]}"
        ), None
    why = burn_in_figure(tool, result.output, gpus, limits)
    if why is None:
        return DiagnosticCheck(tool=tool, status="pass"), None
    if " floor of " in why:  # below the GPU type's floor: a finding (`burn_in_figure`'s wording)
        return DiagnosticCheck(tool=tool, status="fail", detail=why), why
    return DiagnosticCheck(tool=tool, status="error", detail=why), None


def diagnose(runner: CommandRunner, gpus: int, limits: BurnInLimits, *, timeout_s: float, now: datetime) -> Diagnosis:
    """Run `DIAGNOSE_COMMANDS` in order ("{gpus}": the node's GPU count) and judge each: a tool
    that is missing is `not_run`, one that runs past `timeout_s` an `error`; each failure becomes
    the observation of its signal (`DIAGNOSE_SIGNALS`), at `now`."""
    checks, observations = [], []
    for template in DIAGNOSE_COMMANDS:
        tool = template[0]
        result: CommandResult | None = None
        if runner.which(tool) is not None:
            argv = tuple(str(gpus) if arg == "{gpus}" else arg for arg in template)
            try:
                result = runner.run(argv, timeout_s)
            except subprocess.TimeoutExpired:
                checks.append(DiagnosticCheck(tool=tool, status="error", detail=f"ran past {timeout_s:g} s"))
                continue
        check, why = diagnostic_check(tool, result, gpus, limits)
        checks.append(check)
        if why is not None:
            observations.append(
                SignalObservation(signal=DIAGNOSE_SIGNALS[tool], at=now, source=tool, detail=why[:2000])
            )
    return Diagnosis(checks=checks, observations=observations)


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    output: str


class CommandRunner:
    """Finds and runs the hardware tools, and finds the disks they act on; tests pass their own."""

    def which(self, tool: str) -> str | None:
        return shutil.which(tool)

    def is_block_device(self, path: str) -> bool:
        try:
            return stat.S_ISBLK(os.stat(path).st_mode)
        except OSError:
            return False

    def run(self, argv: tuple[str, ...], timeout_s: float) -> CommandResult:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        return CommandResult(proc.returncode, (proc.stdout + proc.stderr)[-65536:])
