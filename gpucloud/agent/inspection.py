"""Bring-up inspection: the layers of a GPU node's stack, checked in the order they depend on
each other, against the GPU type's version policy (`models/catalog.py`, `VERSION_POLICY`).

    firmware -> OS and kernel -> GPU driver -> fabric manager (and, on NVLink-switch systems,
    the InfiniBand stack it needs) -> network (IB ports up, link rate) -> GPUDirect (the
    peer-memory module) -> CUDA and NCCL -> container runtime

Each layer is judged from the output of the real tools (`nvidia-smi`, `uname`, `systemctl`,
`lsmod`, `ibstat`, `ldconfig`, `nvidia-ctk`), read through the agent's `CommandRunner`, so the
same code runs on a node and over recorded outputs in tests. The report names the first layer
that fails and why; a layer whose evidence needs a later one (the GPU firmware is read through
the driver) is `unverified` rather than failed when that later one is what is missing. The agent
answers a failed inspection with the layer and its cause, and the control plane keeps the node
out of burn-in (quarantined, the cause in its events).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from gpucloud.models.catalog import GPU_TYPES, VERSION_POLICY, VersionPolicy

LAYERS = (
    "firmware",
    "os_kernel",
    "gpu_driver",
    "fabric_manager",
    "network",
    "gpudirect",
    "cuda_nccl",
    "container_runtime",
)

# What inspection reads, each once (argv -> what it is for).
GPU_QUERY = ("nvidia-smi", "--query-gpu=index,name,driver_version,vbios_version", "--format=csv,noheader")
COMMANDS: tuple[tuple[str, ...], ...] = (
    GPU_QUERY,
    ("nvidia-smi", "--version"),
    ("uname", "-r"),
    ("systemctl", "is-active", "nvidia-fabricmanager"),
    ("lsmod",),
    ("ibstat",),
    ("ldconfig", "-p"),
    ("nvidia-ctk", "--version"),
)

Status = Literal["ok", "failed", "unverified", "skipped"]


@dataclass(frozen=True)
class Output:
    """What one command gave: its exit code and output, or None when the tool is not installed."""

    returncode: int | None
    text: str = ""

    @property
    def ran(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class LayerCheck:
    layer: str
    status: Status
    detail: str


@dataclass
class InspectionReport:
    gpu_type: str
    layers: list[LayerCheck] = field(default_factory=list)
    found: dict[str, str] = field(default_factory=dict)  # versions read, for the node's events

    @property
    def first_failure(self) -> LayerCheck | None:
        return next((check for check in self.layers if check.status == "failed"), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def summary(self) -> str:
        failed = self.first_failure
        if failed is not None:
            return f"inspection failed at {failed.layer}: {failed.detail}"
        return "inspection passed: " + ", ".join(f"{k} {v}" for k, v in self.found.items())


def version_tuple(version: str) -> tuple[int, ...]:
    """`535.104.05` -> (535, 104, 5); VBIOS parts are hex (`96.00.9F.00.01`)."""
    parts = re.findall(r"[0-9A-Fa-f]+", version)
    base = 16 if any(re.search("[A-Fa-f]", p) for p in parts) or version.count(".") >= 4 else 10
    return tuple(int(p, base) for p in parts)


def at_least(found: str, minimum: str) -> bool:
    return version_tuple(found) >= version_tuple(minimum)


@dataclass(frozen=True)
class _Gpu:
    index: int
    name: str
    driver: str
    vbios: str


def _gpus(out: Output) -> list[_Gpu]:
    gpus = []
    for line in out.text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 4 and cells[0].isdigit():
            gpus.append(_Gpu(int(cells[0]), cells[1], cells[2], cells[3]))
    return gpus


def _ib_ports(text: str) -> list[tuple[str, str, str, int]]:
    """(CA, state, physical state, rate Gb/s) of each port `ibstat` lists."""
    ports = []
    ca = state = physical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("CA '"):
            ca = line[4:].rstrip("'")
        elif line.startswith("State:"):
            state = line.split(":", 1)[1].strip()
        elif line.startswith("Physical state:"):
            physical = line.split(":", 1)[1].strip()
        elif line.startswith("Rate:"):
            rate = re.match(r"\d+", line.split(":", 1)[1].strip())
            ports.append((ca, state, physical, int(rate.group()) if rate else 0))
    return ports


def _modules(text: str) -> set[str]:
    return {line.split()[0] for line in text.splitlines()[1:] if line.strip()}


class _LayerFailed(Exception):
    """Why the layer being checked fails."""


class _Judge:
    """The layers in order; each check sees what the ones before it found."""

    def __init__(self, gpu_type: str, policy: VersionPolicy, outputs: dict[tuple[str, ...], Output]) -> None:
        self.policy, self.out = policy, outputs
        self.report = InspectionReport(gpu_type=gpu_type)
        self.gpus = _gpus(outputs[GPU_QUERY])

    def run(self) -> InspectionReport:
        checks: dict[str, Callable[[], tuple[Status, str]]] = {
            "firmware": self.firmware,
            "os_kernel": self.os_kernel,
            "gpu_driver": self.gpu_driver,
            "fabric_manager": self.fabric_manager,
            "network": self.network,
            "gpudirect": self.gpudirect,
            "cuda_nccl": self.cuda_nccl,
            "container_runtime": self.container_runtime,
        }
        for layer in LAYERS:
            try:
                status, detail = checks[layer]()
            except _LayerFailed as failed:
                status, detail = "failed", str(failed)
            self.report.layers.append(LayerCheck(layer, status, detail))
        return self.report

    def _missing(self, argv: tuple[str, ...]) -> str | None:
        out = self.out[argv]
        if out.returncode is None:
            return f"{argv[0]} is not installed"
        if out.returncode != 0:
            return f"`{' '.join(argv)}` exited {out.returncode}: {out.text.strip()[-200:]}"
        return None

    def firmware(self) -> tuple[Status, str]:
        if not self.gpus:
            return "unverified", "the GPUs' VBIOS is read through the driver, which did not answer"
        old = [g for g in self.gpus if not at_least(g.vbios, self.policy.min_vbios)]
        self.report.found["vbios"] = self.gpus[0].vbios
        if old:
            return "failed", (
                f"GPU {old[0].index} VBIOS {old[0].vbios} is older than {self.policy.min_vbios} "
                f"({len(old)} of {len(self.gpus)} GPUs); reflash it (nvfwupd)"
            )
        return "ok", f"VBIOS {self.gpus[0].vbios} on {len(self.gpus)} GPUs"

    def os_kernel(self) -> tuple[Status, str]:
        if why := self._missing(("uname", "-r")):
            return "failed", why
        kernel = self.out[("uname", "-r")].text.strip()
        self.report.found["kernel"] = kernel
        if not at_least(kernel.split("-")[0], self.policy.min_kernel):
            return "failed", f"kernel {kernel} is older than {self.policy.min_kernel}"
        return "ok", f"kernel {kernel}"

    def gpu_driver(self) -> tuple[Status, str]:
        if why := self._missing(GPU_QUERY):
            return "failed", f"the GPU driver does not answer ({why})"
        want = GPU_TYPES.get(self.report.gpu_type, 0)
        if len(self.gpus) != want:
            return "failed", f"{len(self.gpus)} GPUs answer, a {self.report.gpu_type} node has {want}"
        named = [g for g in self.gpus if self.report.gpu_type not in g.name.replace(" ", "")]
        if named:
            return "failed", f"GPU {named[0].index} is a {named[0].name!r}, not a {self.report.gpu_type}"
        driver = self.gpus[0].driver
        self.report.found["driver"] = driver
        if not at_least(driver, self.policy.min_driver):
            return "failed", f"driver {driver} is older than {self.policy.min_driver}"
        return "ok", f"driver {driver}, {len(self.gpus)} x {self.gpus[0].name}"

    def fabric_manager(self) -> tuple[Status, str]:
        if not self.policy.fabric_manager:
            return "skipped", "no NVSwitch fabric on this GPU type"
        argv = ("systemctl", "is-active", "nvidia-fabricmanager")
        state = self.out[argv].text.strip()
        if self.out[argv].returncode is None:
            return "failed", "systemctl is not installed: the fabric manager's state cannot be read"
        if state != "active":
            return "failed", f"nvidia-fabricmanager is {state or 'not running'}: NVLink is not configured"
        if self.policy.fabric_needs_infiniband:
            modules = _modules(self.out[("lsmod",)].text)
            missing = [m for m in ("ib_core", "ib_umad", "mlx5_ib") if m not in modules]
            if missing:
                return "failed", f"the fabric manager needs the InfiniBand stack; not loaded: {', '.join(missing)}"
        return "ok", "nvidia-fabricmanager active"

    def network(self) -> tuple[Status, str]:
        if why := self._missing(("ibstat",)):
            return "failed", why
        ports = _ib_ports(self.out[("ibstat",)].text)
        up = [p for p in ports if p[1] == "Active" and p[2] == "LinkUp"]
        if len(up) < self.policy.ib_ports:
            down = [
                f"{ca} ({state}, {physical})"
                for ca, state, physical, _ in ports
                if (ca, state) not in {(u[0], u[1]) for u in up}
            ]
            return "failed", (
                f"{len(up)} of {self.policy.ib_ports} InfiniBand ports are up"
                + (f"; down: {', '.join(down)}" if down else "")
            )
        slow = [p for p in up if p[3] < self.policy.min_link_rate_gbps]
        if slow:
            return "failed", f"{slow[0][0]} links at {slow[0][3]} Gb/s, below {self.policy.min_link_rate_gbps}"
        return "ok", f"{len(up)} InfiniBand ports up at {min(p[3] for p in up)} Gb/s or more"

    def gpudirect(self) -> tuple[Status, str]:
        if why := self._missing(("lsmod",)):
            return "failed", why
        if "nvidia_peermem" not in _modules(self.out[("lsmod",)].text):
            return "failed", "nvidia_peermem is not loaded: no GPUDirect RDMA between GPUs and the NICs"
        return "ok", "nvidia_peermem loaded"

    def _version(self, argv: tuple[str, ...], pattern: str, name: str, what: str, minimum: str) -> str:
        """The version `argv` reports (kept as `name`), or why the layer fails (raised)."""
        if why := self._missing(argv):
            raise _LayerFailed(why)
        found = re.search(pattern, self.out[argv].text)
        if found is None:
            raise _LayerFailed(f"`{' '.join(argv)}` reports no {what} version")
        version = self.report.found[name] = found.group(1)
        if not at_least(version, minimum):
            raise _LayerFailed(f"{what} {version} is older than {minimum}")
        return version

    def cuda_nccl(self) -> tuple[Status, str]:
        argv = ("nvidia-smi", "--version")
        cuda = self._version(argv, r"CUDA Version\s*:\s*([\d.]+)", "cuda", "CUDA", self.policy.min_cuda)
        if why := self._missing(("ldconfig", "-p")):
            return "failed", why
        if "libnccl.so.2" not in self.out[("ldconfig", "-p")].text:
            return "failed", "NCCL (libnccl.so.2) is not installed"
        return "ok", f"CUDA {cuda}, NCCL present"

    def container_runtime(self) -> tuple[Status, str]:
        argv, minimum = ("nvidia-ctk", "--version"), self.policy.min_container_toolkit
        toolkit = self._version(argv, r"version\s+([\d.]+)", "container_toolkit", "NVIDIA container toolkit", minimum)
        return "ok", f"NVIDIA container toolkit {toolkit}"


def judge(gpu_type: str, outputs: dict[tuple[str, ...], Output]) -> InspectionReport:
    """The report for what the commands gave (`COMMANDS`; one not run counts as not installed)."""
    policy = VERSION_POLICY.get(gpu_type)
    if policy is None:
        report = InspectionReport(gpu_type=gpu_type)
        report.layers.append(
            LayerCheck("firmware", "failed", f"no version policy for GPU type {gpu_type!r} in the catalogue")
        )
        return report
    complete = {argv: outputs.get(argv, Output(None)) for argv in COMMANDS}
    return _Judge(gpu_type, policy, complete).run()
