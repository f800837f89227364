"""The host agent process (`gpucloud agent`): what runs on every GPU node.

It serves the control plane's action API, the same one the simulated fleet speaks
(`POST /actions/{action}` with `{"request_id", "tenant_id"}`, answers deduplicated by request id,
the same invariants: another tenant's data blocks a provision, a running workload blocks a wipe,
burn-in runs only on a wiped idle node), and it pushes to the control plane: a heartbeat every
`heartbeat_s` (`POST /v1/agents/heartbeats`), a reading every `reading_s`
(`POST /v1/agents/readings`, for the trend rules) and XID events as the probe raises them
(`POST /v1/agents/events`, stamped with the tenant holding the node). The probe's latest reading
is kept for `GET /readings`.

With a ledger URL it meters (`AgentMetering`): a provision names the allocation it is for
(`allocation_id`), and from then until the workload stops (release, reboot) the node's GPU time
is cut into interval-aligned samples in a durable spool (SQLite, `gpucloud/agent/spool.py`) and
shipped to the ledger at-least-once; `GET /metering` tells how far behind the spool is.

Actions that drive hardware run real tools (`ACTION_COMMANDS`); where a tool is not installed the
action answers 501 with a problem naming it, never a pretend success. The tools run through a
`CommandRunner`, so tests (and a dry run) can stand in for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gpucloud.agent import inspection
from gpucloud.agent.probe import Probe
from gpucloud.agent.readings import AGENT_MAX_EVENTS, NodeReading, XidEvent
from gpucloud.agent.schemas import ActionRequest
from gpucloud.agent.shipper import Shipper
from gpucloud.agent.spool import Meter, NodeAllocation, Spool, wall_clock_ms
from gpucloud.agent.workloads import StopFailed, WorkloadSupervisor
from gpucloud.ledger.client import AgentLedgerToken, UsageLedger
from gpucloud.models.catalog import GPU_TYPES
from gpucloud.web import problems
from gpucloud.web.service_tokens import Verifier, refusal
from gpucloud.web.tls import ServerTLS, client_verify, serve_options

log = logging.getLogger(__name__)

REMEMBERED_REQUESTS = 64
MAX_PENDING_EVENTS = 10_000  # kept while the control plane is unreachable; oldest dropped first
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


@dataclass
class HostState:
    """What the agent knows about the node's tenancy; the control plane reads it in heartbeats."""

    node_id: str
    boot_id: str
    scratch_dir: Path
    tenant_id: str | None = None
    workload_running: bool = False
    # What the meter bills the node's GPU time to (None: nothing ran since the agent started).
    allocation: NodeAllocation | None = None
    recent: OrderedDict = field(default_factory=OrderedDict)  # request_id -> (status, body)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Held by the meter while it reads the allocation and cuts its usage (`spool.Meter.tick`).
    meter_lock: threading.Lock = field(default_factory=threading.Lock)
    # The node's agent credential the reports carry; a wipe replaces it.
    credential: str | None = None
    credential_file: Path | None = None
    # Where the tenancy above is kept across the agent's restarts (None: memory only).
    state_file: Path | None = None

    def save(self) -> None:
        """Keep the tenant, whether it holds the node, and the allocation metered (0600): an
        agent restarted while a tenant holds the node still stops its workload and meters it."""
        if self.state_file is None:
            return
        kept = {
            "tenant_id": self.tenant_id,
            "workload_running": self.workload_running,
            "allocation": dataclasses.asdict(self.allocation) if self.allocation else None,
        }
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(tmp, self.state_file)

    def restore(self) -> None:
        """What `save` kept, if anything (the boot id is this boot's: a reboot is seen)."""
        if self.state_file is None or not self.state_file.is_file():
            return
        kept = json.loads(self.state_file.read_text())
        self.tenant_id, self.workload_running = kept.get("tenant_id"), bool(kept.get("workload_running"))
        if kept.get("allocation"):
            self.allocation = NodeAllocation(**kept["allocation"])

    def take_credential(self, credential: str) -> None:
        """Report with `credential` from now on, and keep it (0600) for the next start."""
        self.credential = credential
        if self.credential_file is not None:
            write_credential(self.credential_file, credential)

    def describe(self) -> dict:
        return {
            "node_id": self.node_id,
            "tenant_id": self.tenant_id,
            "workload_running": self.workload_running,
            "boot_id": self.boot_id,
        }


def gpu_type_of(reading: NodeReading) -> str:
    """The catalogue's GPU type from NVML's device name ("NVIDIA H100 80GB HBM3" -> "H100");
    longest first, so a GB200 is not taken for a B200."""
    name = reading.gpus[0].name.upper() if reading.gpus else ""
    return next((t for t in sorted(GPU_TYPES, key=len, reverse=True) if t in name), name or "unknown")


class AgentMetering:
    """The node's meter and shipper, each on its own thread, over one durable spool."""

    def __init__(
        self,
        agent: Agent,
        spool_path: Path,
        ledger_url: str,
        *,
        interval_s: float = 60.0,
        token: Callable[[], str] | None = None,
    ) -> None:
        self.spool = Spool(spool_path, agent.state.node_id)
        self.meter = Meter(
            self.spool,
            lambda: agent.state.allocation,
            interval_ms=max(1, int(interval_s * 1000)),
            lock=agent.state.meter_lock,
        )
        # `token`: the ledger takes this node's usage only with a token for this node.
        self.shipper = Shipper(self.spool, UsageLedger(ledger_url, token=token))
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.meter.run, args=(self._stop,), name="meter", daemon=True),
            threading.Thread(target=self.shipper.run, args=(self._stop,), name="shipper", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self.meter.tick()  # a workload that ended since the last tick is cut at its end
        self.shipper.close()
        self.spool.close()

    def report(self) -> dict:
        lag = self.spool.lag()
        return dataclasses.asdict(lag)


def write_credential(path: Path, credential: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(credential + "\n")
    os.replace(tmp, path)


def read_boot_id() -> str:
    path = Path("/proc/sys/kernel/random/boot_id")
    return path.read_text().strip() if path.exists() else uuid.uuid4().hex


def _problem(status: int, title: str, detail: str, **extra) -> tuple[int, dict]:
    return status, problems.body(status, problems.slug(title), title, detail, **extra)


class Agent:
    """The action API's logic, independent of HTTP."""

    def __init__(
        self,
        state: HostState,
        probe: Probe,
        *,
        runner: CommandRunner | None = None,
        tool_timeout_s: float = 3600.0,
        gpu_type: str | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
        burn_in_limits: BurnInLimits = BurnInLimits(),
        inspect_stack: bool = True,
        workloads: WorkloadSupervisor | None = None,
    ) -> None:
        """`inspect_stack`: `inspect` checks every layer of the node's stack (`agent/inspection.py`);
        off only where the GPUs are simulated and there is no real stack to check."""
        self.state, self.probe = state, probe
        self.inspect_stack = inspect_stack
        self.workloads = workloads  # the tenant's processes (None: provision starts nothing)
        self.last_inspection: inspection.InspectionReport | None = None
        self.runner = runner or CommandRunner()
        self.tool_timeout_s = tool_timeout_s
        self.burn_in_limits = burn_in_limits
        self.gpu_type = gpu_type  # None: named from the probe's first GPU at provision
        self._clock_ms = clock_ms

    async def act(self, action: str, req: ActionRequest) -> tuple[int, dict]:
        async with self.state.lock:
            if req.request_id in self.state.recent:
                return self.state.recent[req.request_id]
            outcome = await self._apply(action, req)
            if outcome[0] < 500 or outcome[0] == 501:  # a missing tool stays missing; a crash may not
                self.state.recent[req.request_id] = outcome
                while len(self.state.recent) > REMEMBERED_REQUESTS:
                    self.state.recent.popitem(last=False)
            return outcome

    async def _apply(self, action: str, req: ActionRequest) -> tuple[int, dict]:
        s = self.state
        if action == "provision":
            if not req.tenant_id:
                return _problem(422, "Tenant required", "provision needs a tenant_id")
            if s.tenant_id not in (None, req.tenant_id):
                return _problem(409, "Node holds data", f"node holds data of tenant {s.tenant_id}; wipe it first")
        elif action == "wipe" and s.workload_running:
            return _problem(409, "Workload running", "a workload is still running; release the node first")
        elif action == "burn_in" and (s.tenant_id is not None or s.workload_running):
            return _problem(409, "Node not wiped", "burn-in runs only on a wiped, idle node")
        failed = await self._run_tools(action)
        if failed is None and action == "inspect" and self.inspect_stack:
            failed = await self._inspect()
        if failed is not None:
            return failed
        now_ms = self._clock_ms()
        if action == "provision" and req.workload is not None:
            if (started := await self._start_workload(req)) is not None:
                return started
        elif action in ("release", "reboot", "wipe") and self.workloads is not None:
            try:  # every process of the allocation, children that ignore SIGTERM too, before the answer
                await asyncio.to_thread(self.workloads.stop)
            except StopFailed as exc:
                return _problem(500, "Workload not stopped", str(exc))
        if action == "provision":
            s.tenant_id, s.workload_running = req.tenant_id, True
        elif action == "release":
            s.workload_running = False
        elif action == "wipe":
            self._wipe_scratch()
            if req.credential:  # the tenant who had root here held the old one
                s.take_credential(req.credential)
        elif action == "reboot":
            s.workload_running = False
        if not s.workload_running and s.allocation is not None and s.allocation.ended_ms is None:
            # The meter cuts the allocation here. Its end is taken and published under the
            # meter's lock: a tick between the two could otherwise meter past it.
            with s.meter_lock:
                s.allocation = dataclasses.replace(s.allocation, ended_ms=self._clock_ms())
        reading = await asyncio.to_thread(self.probe.read)
        if action == "provision":
            self._meter_from(req, reading, now_ms)
        await asyncio.to_thread(s.save)
        return 200, s.describe() | self.workload_status() | {
            "action": action,
            "gpu_count": len(reading.gpus),
            "is_gpu_node": reading.is_gpu_node,
            "fatal_error": reading.fatal_error.model_dump(mode="json") if reading.fatal_error else None,
        }

    def workload_status(self) -> dict:
        if self.workloads is None:
            return {}
        return {"workload_status": self.workloads.status()}

    async def _start_workload(self, req: ActionRequest) -> tuple[int, dict] | None:
        """Start the provision's workload (its SSH keys let in first); None once it runs."""
        assert req.workload is not None
        if self.workloads is None:
            return _problem(501, "No workload runner", "this agent was started without a workload runner")
        if req.allocation_id is None:
            return _problem(422, "Allocation required", "a workload belongs to an allocation: name it")
        if req.workload.ssh_keys:
            ssh = self.state.scratch_dir / ".ssh"
            ssh.mkdir(parents=True, exist_ok=True, mode=0o700)
            keys = ssh / "authorized_keys"
            keys.write_text("".join(k.strip() + "\n" for k in req.workload.ssh_keys))
            keys.chmod(0o600)
        try:
            await asyncio.to_thread(
                self.workloads.start, req.allocation_id, req.workload, cwd=self.state.scratch_dir / "work"
            )
        except (RuntimeError, OSError) as exc:
            return _problem(409, "Workload not started", str(exc))
        return None

    async def _inspect(self) -> tuple[int, dict] | None:
        """Every layer of the stack in order (`agent/inspection.py`); the first that fails, with
        its cause, as a 422 the control plane records (the node stays out of burn-in)."""
        outputs: dict[tuple[str, ...], inspection.Output] = {}
        for argv in inspection.COMMANDS:
            if self.runner.which(argv[0]) is None:
                continue  # not installed: the layer that needs it says so
            try:
                result = await asyncio.to_thread(self.runner.run, argv, 60.0)
            except subprocess.TimeoutExpired:
                outputs[argv] = inspection.Output(124, f"{argv[0]} ran past 60 s")
                continue
            outputs[argv] = inspection.Output(result.returncode, result.output)
        gpu_type = self.gpu_type or gpu_type_of(await asyncio.to_thread(self.probe.read))
        report = self.last_inspection = inspection.judge(gpu_type, outputs)
        if report.ok:
            log.info("%s", report.summary())
            return None
        failed = report.first_failure
        assert failed is not None
        layers = [{"layer": c.layer, "status": c.status, "detail": c.detail} for c in report.layers]
        return _problem(422, "Inspection failed", report.summary(), layer=failed.layer, layers=layers)

    def _meter_from(self, req: ActionRequest, reading: NodeReading, now_ms: int) -> None:
        """The provisioned workload's GPU time counts from now, for the allocation it names; a
        repeated provision of the same running allocation changes nothing."""
        current = self.state.allocation
        if req.allocation_id is None or req.tenant_id is None:
            log.warning("provision for %s names no allocation: its usage is not metered", req.tenant_id)
            return
        if current is not None and current.allocation_id == req.allocation_id and current.ended_ms is None:
            return
        self.state.allocation = NodeAllocation(
            allocation_id=req.allocation_id,
            tenant_id=req.tenant_id,
            gpu_type=self.gpu_type or gpu_type_of(reading),
            gpu_count=max(1, len(reading.gpus)),
            started_ms=now_ms,
        )

    async def _run_tools(self, action: str) -> tuple[int, dict] | None:
        commands = ACTION_COMMANDS.get(action, ())
        missing = [argv[0] for argv in commands if self.runner.which(argv[0]) is None]
        if missing:
            return _problem(
                501,
                "Tool not installed",
                f"{action} needs {', '.join(missing)}, which is not installed on {self.state.node_id}",
                tools=missing,
            )
        # Only burn-in needs the GPU count (its command lines and its bandwidth per GPU).
        gpus = len((await asyncio.to_thread(self.probe.read)).gpus) if action == "burn_in" else 0
        for template in commands:
            argv = tuple(str(gpus) if arg == "{gpus}" else arg for arg in template)
            try:
                result = await asyncio.to_thread(self.runner.run, argv, self.tool_timeout_s)
            except subprocess.TimeoutExpired:
                return _problem(422, "Action failed", f"{action}: {argv[0]} ran past {self.tool_timeout_s:g} s")
            if result.returncode != 0:
                return _problem(
                    422,
                    "Action failed",
                    f"{action}: {' '.join(argv)} exited {result.returncode}: {result.output[-500:]}",
                )
            if action == "burn_in" and (why := burn_in_figure(argv[0], result.output, gpus, self.burn_in_limits)):
                return _problem(422, "Action failed", f"burn-in failed: {why}")
        if action == "burn_in":
            why = thermal_soak(await asyncio.to_thread(self.probe.read), self.burn_in_limits)
            if why:
                return _problem(422, "Action failed", f"burn-in failed: thermal soak: {why}")
        return None

    def _wipe_scratch(self) -> None:
        """The tenant's files (its work, its SSH keys, its workload's output) go; the node is
        nobody's again."""
        if self.state.scratch_dir.exists():
            shutil.rmtree(self.state.scratch_dir)
        if self.workloads is not None:
            for output in self.workloads.state_dir.glob("workload-*.log"):
                output.unlink(missing_ok=True)
        self.state.scratch_dir.mkdir(parents=True, exist_ok=True)
        self.state.tenant_id = None


class _CurrentCredential(httpx.Auth):
    """The node's credential as it is now (a wipe replaces it while the agent runs)."""

    def __init__(self, state: HostState) -> None:
        self.state = state

    def auth_flow(self, request: httpx.Request):
        if self.state.credential:
            request.headers["Authorization"] = f"Bearer {self.state.credential}"
        yield request


class Reporter:
    """Pushes heartbeats, readings and XID events to the control plane; events wait while it is
    down. Readings do not: their counters are cumulative, so the next one delivered carries
    what the lost ones would have shown."""

    def __init__(self, agent: Agent, client: httpx.AsyncClient) -> None:
        self.agent, self.client = agent, client
        client.auth = _CurrentCredential(agent.state)
        self.pending: list[XidEvent] = []
        self.latest: NodeReading | None = None

    async def heartbeat_once(self) -> None:
        try:
            beat = self.agent.state.describe()
            if self.agent.workloads is not None:
                report = await asyncio.to_thread(self.agent.workloads.report)
                beat["workload"] = report.model_dump(mode="json")
            resp = await self.client.post("/v1/agents/heartbeats", json={"heartbeats": [beat]})
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("heartbeat not delivered: %s", exc)

    async def read_once(self) -> NodeReading:
        """Read the probe and push the reading; the reading either way."""
        self.latest = await asyncio.to_thread(self.agent.probe.read)
        try:
            resp = await self.client.post(
                "/v1/agents/readings", json={"readings": [self.latest.model_dump(mode="json")]}
            )
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("reading not delivered (dropped; the next one carries its counters): %s", exc)
        return self.latest

    async def events_once(self, wait_s: float) -> int:
        """Wait up to `wait_s` for XIDs, then push what is pending; the number delivered."""
        tenant = self.agent.state.tenant_id
        new = await asyncio.to_thread(self.agent.probe.wait_events, wait_s)
        self.pending += [e if e.tenant_id else e.model_copy(update={"tenant_id": tenant}) for e in new]
        del self.pending[:-MAX_PENDING_EVENTS]
        if not self.pending:
            return 0
        batch = self.pending[:AGENT_MAX_EVENTS]
        try:
            resp = await self.client.post(
                "/v1/agents/events", json={"events": [e.model_dump(mode="json") for e in batch]}
            )
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("%d XID events not delivered (kept): %s", len(self.pending), exc)
            return 0
        del self.pending[: len(batch)]
        return len(batch)

    async def run(self, *, heartbeat_s: float, reading_s: float, event_wait_s: float = 1.0) -> None:
        async def every(period: float, step: Callable) -> None:
            while True:
                await step()
                await asyncio.sleep(period)

        async def events() -> None:
            while True:
                await self.events_once(event_wait_s)

        await asyncio.gather(every(heartbeat_s, self.heartbeat_once), every(reading_s, self.read_once), events())


def create_app(
    agent: Agent,
    reporter: Reporter | None = None,
    *,
    control_plane: Verifier,
    heartbeat_s: float = 10.0,
    reading_s: float = 30.0,
    metering: AgentMetering | None = None,
) -> FastAPI:
    """The agent's HTTP API. Everything but `/healthz` answers only the control plane: a token
    it signed for this node (`web/service_tokens.py`), checked against its public key."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(reporter.run(heartbeat_s=heartbeat_s, reading_s=reading_s)) if reporter else None
        if metering is not None:
            metering.start()
        yield
        if task is not None:
            task.cancel()
        if metering is not None:
            await asyncio.to_thread(metering.stop)
        agent.probe.close()

    app = FastAPI(title=f"gpucloud agent {agent.state.node_id}", lifespan=lifespan)
    problems.install(app)

    @app.middleware("http")
    async def control_plane_only(request: Request, call_next):
        if request.url.path == "/healthz":
            return await call_next(request)
        authorization = request.headers.get("authorization")
        return refusal(control_plane, authorization, node_id=agent.state.node_id) or await call_next(request)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "node_id": agent.state.node_id}

    @app.get("/readings")
    async def readings() -> dict:
        reading = reporter.latest if reporter and reporter.latest else await asyncio.to_thread(agent.probe.read)
        return reading.model_dump(mode="json")

    @app.get("/metering")
    async def metering_lag() -> JSONResponse:
        """How far behind the usage spool is (samples and milliseconds not yet in the ledger)."""
        if metering is None:
            return problems.problem_response(404, "Not metering", "this agent was started without a ledger URL")
        return JSONResponse(await asyncio.to_thread(metering.report))

    @app.post("/actions/{action}")
    async def act(action: str, req: ActionRequest):
        if action not in ACTIONS:
            status, body = _problem(404, "Unknown action", f"unknown action {action!r}; known: {', '.join(ACTIONS)}")
        else:
            status, body = await agent.act(action, req)
        return problems.response(body, status) if status >= 400 else JSONResponse(body, status_code=status)

    return app


def main(
    *,
    node_id: str,
    control_plane_url: str,
    token: str,
    control_plane_key: Path,
    token_file: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8200,
    scratch_dir: Path = Path("/var/lib/gpucloud/scratch"),
    heartbeat_s: float = 10.0,
    reading_s: float = 30.0,
    allow_simulated: bool = False,
    ledger_url: str | None = None,
    spool_path: Path = Path("/var/lib/gpucloud/usage-spool.db"),
    meter_interval_s: float = 60.0,
    gpu_type: str | None = None,
    tls: ServerTLS | None = None,
    insecure: bool = False,
    state_dir: Path = Path("/var/lib/gpucloud/agent"),
) -> None:
    """Run the agent until stopped: `gpucloud agent` on a GPU node. It refuses to start without
    its node's credential (`gpa_<node id>.<secret>`) and the control plane's public key."""
    import uvicorn

    if not token.startswith(f"gpa_{node_id}."):
        raise SystemExit(
            f"the agent needs {node_id}'s own credential (gpa_{node_id}.<secret>): issue one with "
            f"`POST /v1/nodes/{node_id}/agent-credential` and pass it as --token"
        )
    if not control_plane_key.is_file():
        raise SystemExit(
            f"no control plane public key at {control_plane_key}: copy the control plane's "
            "issuer_key.pub there (or pass --control-plane-key)"
        )
    from gpucloud.web.service_tokens import load_verifier

    secure = serve_options(host, tls, insecure=insecure, what="agent's action API")
    verifier = load_verifier(control_plane_key)

    state = HostState(
        node_id=node_id,
        boot_id=read_boot_id(),
        scratch_dir=scratch_dir,
        credential=token,
        credential_file=token_file,
        state_file=state_dir / "host.json",
    )
    state.restore()  # a restart mid-allocation: the tenant still holds the node, and is metered
    from gpucloud.bootstrap import detect_probe
    from gpucloud.sim.probe import SimulatedProbe

    probe = detect_probe(node_id, allow_simulated=allow_simulated)
    # Simulated GPUs (--allow-simulated, a dev machine) have no stack to inspect.
    agent = Agent(
        state,
        probe,
        gpu_type=gpu_type,
        inspect_stack=not isinstance(probe, SimulatedProbe),
        workloads=WorkloadSupervisor(state_dir / "workloads"),
    )
    client = httpx.AsyncClient(base_url=control_plane_url, timeout=30, verify=client_verify())
    metering = None
    if ledger_url:
        spool_path.parent.mkdir(parents=True, exist_ok=True)
        ledger_token = AgentLedgerToken(control_plane_url, lambda: state.credential)
        metering = AgentMetering(agent, spool_path, ledger_url, interval_s=meter_interval_s, token=ledger_token)
    else:
        log.warning("no ledger URL: this node's usage is not metered")
    app = create_app(
        agent,
        Reporter(agent, client),
        control_plane=verifier,
        heartbeat_s=heartbeat_s,
        reading_s=reading_s,
        metering=metering,
    )
    uvicorn.run(app, host=host, port=port, log_level="info", **secure)
