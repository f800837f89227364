"""The host agent's app: what runs on every GPU node (`gpucloud.entrypoints.agent` runs it).

It serves the control plane's action API (`POST /actions/{action}` with `{"request_id",
"tenant_id"}`), answered by the action core every agent runs, the simulated fleet's nodes too
(`agent/action_core.py`: answers deduplicated by request id, another tenant's data blocks a
provision, a running workload blocks a wipe, burn-in runs only on a wiped idle node) over this
node's real hardware (`Agent`), and it pushes to the control plane: a heartbeat every
`heartbeat_s` (`POST /v1/agents/heartbeats`), a reading every `reading_s`
(`POST /v1/agents/readings`, for the trend rules) and, in the same period, the signals beyond
XIDs its `SignalSampler` saw (`POST /v1/agents/signals`: InfiniBand ports and counters, kept
while the control plane is down), and XID events as the probe raises them
(`POST /v1/agents/events`, stamped with the tenant holding the node). The probe's latest reading
is kept for `GET /readings`.

With a ledger URL it meters (`AgentMetering`): a provision names the allocation it is for
(`allocation_id`), and from then until the workload stops (release, reboot) the node's GPU time
is cut into interval-aligned samples in a durable spool (SQLite, `gpucloud/agent/spool.py`) and
shipped to the ledger at-least-once; `GET /metering` tells how far behind the spool is.

It serves the weights API a staged rollout drives (`/weights/*`: prefetch, verify, activate,
check, evaluate, rollback) and the peer service its swarm fetches chunks from (`/chunks/*`), for
the tenant holding the node, from `<state_dir>/weights` (`gpucloud.agent.tenant_weights`).

Actions that drive hardware run real tools (`ACTION_COMMANDS`; a wipe's GPU reset and disk
sanitize: `agent/cleaning.py`); where a tool is not installed the action answers 501 with a
problem naming it, never a pretend success. The tools run through a
`CommandRunner`, so tests (and a dry run) can stand in for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import subprocess
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Scope

from gpucloud.adapters.probe import Probe
from gpucloud.agent import inspection
from gpucloud.agent.action_core import ActionCore, NodeFacts, Outcome, action_failed, answer_action, problem
from gpucloud.agent.cleaning import Cleaner, CleaningFailed
from gpucloud.agent.host import HostState, gpu_type_of
from gpucloud.agent.logs_api import install_workload_logs
from gpucloud.agent.reporting import AgentMetering, Reporter
from gpucloud.agent.spool import NodeAllocation, wall_clock_ms
from gpucloud.agent.ssh_keys import AuthorizedKeys, KeysNotWritten
from gpucloud.agent.tenant_weights import TenantWeights, caller_refusal
from gpucloud.agent.tools import (
    ACTION_COMMANDS,
    DEFAULT_BURN_IN,
    BurnInLimits,
    CommandRunner,
    action_failure,
    burn_in_figure,
    diagnose,
    thermal_soak,
)
from gpucloud.agent.workloads import NoContainerRuntime, StopFailed, WorkloadSupervisor
from gpucloud.config import RequestBodySettings
from gpucloud.protocol.actions import SCRATCH, ActionRequest, AgentAction, CleaningStep, Diagnosis
from gpucloud.protocol.logs import WORKLOAD_LOGS_PATH
from gpucloud.protocol.reports import NodeReading
from gpucloud.web import problems
from gpucloud.web.gate import BODY_DEFAULTS, Gate
from gpucloud.web.metrics import install_metrics
from gpucloud.web.readiness import install_readiness
from gpucloud.web.service_tokens import Verifier, logs_refusal_reason

log = logging.getLogger(__name__)


class Agent:
    """The production agent: the action core (`agent/action_core.py`) over this node's real
    hardware, which this class drives as the core's `NodeHardware`: the tools through its
    `CommandRunner` (`ACTION_COMMANDS`, the stack's inspection, a wipe's cleaning), the GPUs through
    its probe, the tenant's processes through its `WorkloadSupervisor`, and the tenancy kept on
    disk (`HostState.save`) and metered (`HostState.allocation`). Independent of HTTP."""

    def __init__(
        self,
        state: HostState,
        probe: Probe,
        *,
        runner: CommandRunner | None = None,
        tool_timeout_s: float = 3600.0,
        gpu_type: str | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
        burn_in_limits: BurnInLimits = DEFAULT_BURN_IN,
        inspect_stack: bool = True,
        workloads: WorkloadSupervisor | None = None,
        weights_dir: Path | None = None,
        tenant_disks: tuple[str, ...] = (),
        mounts_file: Path = Path("/proc/mounts"),
        ssh_keys: AuthorizedKeys | None = None,
    ) -> None:
        """`inspect_stack`: `inspect` checks every layer of the node's stack (`agent/inspection.py`);
        off only where the GPUs are simulated and there is no real stack to check. `weights_dir`:
        the tenants' model weights (`agent/tenant_weights.py`), removed with the scratch on wipe.
        `tenant_disks`: the block devices the tenant writes to, sanitized on wipe
        (`agent/cleaning.py`); `mounts_file`: where the mounted filesystems are listed; `ssh_keys`:
        the login user's authorized_keys, which the workload's keys go to (None: a workload that
        names keys is refused)."""
        self.state, self.probe = state, probe
        self.inspect_stack = inspect_stack
        self.workloads = workloads  # the tenant's processes (None: provision starts nothing)
        self.weights_dir = weights_dir
        self.last_inspection: inspection.InspectionReport | None = None
        self.runner = runner or CommandRunner()
        self.tool_timeout_s = tool_timeout_s
        self.burn_in_limits = burn_in_limits
        self.gpu_type = gpu_type  # None: named from the probe's first GPU at provision
        self.tenant_disks, self.mounts_file = tuple(tenant_disks), mounts_file
        self.ssh_keys = ssh_keys
        self._clock_ms = clock_ms
        self.core = ActionCore(state, self, clock_ms=clock_ms)

    async def act(self, action: AgentAction, req: ActionRequest) -> Outcome:
        return await self.core.act(action, req)

    async def run_tools(self, action: AgentAction) -> Outcome | None:
        if action == AgentAction.WIPE and (missing := self._cleaner().tools_missing()):
            return self._not_installed(action, missing)
        failed = await self._run_tools(action)
        if failed is None and action == AgentAction.INSPECT and self.inspect_stack:
            failed = await self._inspect()
        return failed

    async def start_workload(self, req: ActionRequest) -> Outcome | None:
        """Start the provision's workload (its SSH keys are in by then); None once it runs."""
        if req.workload is None:
            return None
        if self.workloads is None:
            return problem(501, "No workload runner", "this agent was started without a workload runner")
        if req.allocation_id is None:
            return problem(422, "Allocation required", "a workload belongs to an allocation: name it")
        try:
            await asyncio.to_thread(
                self.workloads.start, req.allocation_id, req.workload, cwd=self.state.scratch_dir / "work"
            )
        except NoContainerRuntime as exc:
            return problem(422, "No container runtime", str(exc))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            return problem(409, "Workload not started", str(exc))
        return None

    async def stop_workload(self) -> Outcome | None:
        """Every process of the allocation, children that ignore SIGTERM too."""
        if self.workloads is None:
            return None
        try:
            await asyncio.to_thread(self.workloads.stop)
        except StopFailed as exc:
            return problem(500, "Workload not stopped", str(exc))
        return None

    async def install_ssh_keys(self, keys: Sequence[str]) -> Outcome | None:
        """The workload's keys in the login user's authorized_keys (`agent/ssh_keys.py`)."""
        if self.ssh_keys is None:
            if not keys:
                return None
            return problem(501, "No SSH access", "this agent was started without a login user for the tenant's keys")
        try:
            await asyncio.to_thread(self.ssh_keys.install, keys)
        except (KeysNotWritten, OSError) as exc:
            return problem(422, "SSH keys not written", str(exc))
        return None

    async def remove_ssh_keys(self) -> Outcome | None:
        """No key of the tenant opens the node, and no session it opened stays (a failure fails
        the release: the wipe follows)."""
        if self.ssh_keys is None:
            return None
        try:
            await asyncio.to_thread(self.ssh_keys.remove)
        except (KeysNotWritten, OSError) as exc:
            return problem(500, "SSH keys not removed", str(exc))
        killed = await asyncio.to_thread(self.ssh_keys.end_sessions)
        if killed:
            log.info("ended %d processes of %s, the tenant's login user", len(killed), self.ssh_keys.user)
        return None

    def take_credential(self, credential: str) -> None:
        self.state.take_credential(credential)

    async def diagnose(self) -> Diagnosis:
        """The short scheduled tests (`tools.diagnose`), held to this node's GPU type's floors."""
        gpus = len((await asyncio.to_thread(self.probe.read)).gpus)
        return await asyncio.to_thread(
            diagnose, self.runner, gpus, self.burn_in_limits, timeout_s=self.tool_timeout_s, now=datetime.now(UTC)
        )

    async def settle(self, action: AgentAction, req: ActionRequest, *, started_ms: int) -> NodeFacts:
        s = self.state
        if not s.workload_running and s.allocation is not None and s.allocation.ended_ms is None:
            # The meter cuts the allocation here. Its end is taken and published under the
            # meter's lock: a tick between the two could otherwise meter past it.
            with s.meter_lock:
                s.allocation = dataclasses.replace(s.allocation, ended_ms=self._clock_ms())
        reading = await asyncio.to_thread(self.probe.read)
        if action == AgentAction.PROVISION:
            self._meter_from(req, reading, started_ms)
        await asyncio.to_thread(s.save)
        return NodeFacts(
            node_id=s.node_id,
            boot_id=s.boot_id,
            image_digest=s.image_digest,
            gpu_count=len(reading.gpus),
            is_gpu_node=reading.is_gpu_node,
            fatal_error=reading.fatal_error,
            extras=self.workload_status(),
        )

    def workload_status(self) -> dict:
        if self.workloads is None:
            return {}
        return {"workload_status": self.workloads.status()}

    async def _inspect(self) -> Outcome | None:
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
        return problem(422, "Inspection failed", report.summary(), layer=failed.layer, layers=layers)

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

    def _not_installed(self, action: AgentAction, missing: list[str]) -> Outcome:
        return problem(
            501,
            "Tool not installed",
            f"{action} needs {', '.join(missing)}, which is not installed on {self.state.node_id}",
            tools=missing,
        )

    async def _run_tools(self, action: AgentAction) -> Outcome | None:
        commands = ACTION_COMMANDS.get(action, ())
        missing = [argv[0] for argv in commands if self.runner.which(argv[0]) is None]
        if missing:
            return self._not_installed(action, missing)
        # Only burn-in needs the GPU count (its command lines and its bandwidth per GPU).
        gpus = len((await asyncio.to_thread(self.probe.read)).gpus) if action == AgentAction.BURN_IN else 0
        for template in commands:
            argv = tuple(str(gpus) if arg == "{gpus}" else arg for arg in template)
            try:
                result = await asyncio.to_thread(self.runner.run, argv, self.tool_timeout_s)
            except subprocess.TimeoutExpired:
                return action_failed(f"{action}: {argv[0]} ran past {self.tool_timeout_s:g} s")
            if result.returncode != 0:
                return action_failed(
                    f"{action}: {' '.join(argv)} exited {result.returncode}: {result.output[-500:]}",
                )
            burn_in = action == AgentAction.BURN_IN
            if burn_in and (why := burn_in_figure(argv[0], result.output, gpus, self.burn_in_limits)):
                return action_failed(f"burn-in failed: {why}")
            if not burn_in and (why := action_failure(argv[0], result.output)):
                return action_failed(f"{action}: {why}")
        if action == AgentAction.BURN_IN:
            why = thermal_soak(await asyncio.to_thread(self.probe.read), self.burn_in_limits)
            if why:
                return action_failed(f"burn-in failed: thermal soak: {why}")
        return None

    def _cleaner(self) -> Cleaner:
        return Cleaner(self.runner, self.tenant_disks, mounts_file=self.mounts_file, timeout_s=self.tool_timeout_s)

    async def clean(self) -> tuple[list[CleaningStep], CleaningFailed | None]:
        """The wipe's steps in order: every GPU reset, each tenant disk sanitized, the tenant's
        files removed (`agent/cleaning.py`); the node is nobody's only when all of them passed.

        A failed reset or sanitize fails the wipe. The tenant's files are removed all the same:
        nothing is gained by leaving them on a node that waits for repair."""
        cleaner = self._cleaner()
        failure: CleaningFailed | None = None
        try:
            steps = await asyncio.to_thread(cleaner.clean)
        except CleaningFailed as exc:
            steps, failure = cleaner.steps, exc
        steps.append(await asyncio.to_thread(self._wipe_scratch))
        return steps, failure

    def _wipe_scratch(self) -> CleaningStep:
        """The tenant's files (its work, its workload's output, its weights) go; its SSH keys
        went before the cleaning (`remove_ssh_keys`)."""
        removed = [self.state.scratch_dir]
        if self.state.scratch_dir.exists():
            shutil.rmtree(self.state.scratch_dir)
        if self.weights_dir is not None:
            removed.append(self.weights_dir)
            if self.weights_dir.exists():
                shutil.rmtree(self.weights_dir)
        if self.workloads is not None:
            for output in self.workloads.state_dir.glob("workload-*.log*"):  # rotated ones too
                output.unlink(missing_ok=True)
        self.state.scratch_dir.mkdir(parents=True, exist_ok=True)
        answer = f"removed {', '.join(map(str, removed))}" + (" and the workloads' output" if self.workloads else "")
        return CleaningStep(step=SCRATCH, target=str(self.state.scratch_dir), method="remove", ok=True, answer=answer)


def create_app(
    agent: Agent,
    reporter: Reporter | None = None,
    *,
    control_plane: Verifier,
    heartbeat_s: float = 10.0,
    reading_s: float = 30.0,
    metering: AgentMetering | None = None,
    metrics_tokens: tuple[str, ...] = (),
    request_body: RequestBodySettings = BODY_DEFAULTS,
    weights: TenantWeights | None = None,
) -> FastAPI:
    """The agent's HTTP API, behind the gate every server has (`web/gate.py`, bodies read as
    `request_body` says). Everything but `/healthz` answers only the control plane: a token
    it signed for this node (`web/service_tokens.py`), checked against its public key; but
    `/chunks/*` answers a rollout's peer token for a swarm of the node's tenant, and `/metrics`
    a scraper holding one of `metrics_tokens` (none: nobody). With `weights`, it serves the
    weights API and the peer service (`/weights/*`, `/chunks/*`) of the tenant holding the node."""

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

    async def control_plane_only(scope: Scope) -> ASGIApp | None:
        if scope["path"] in ("/healthz", "/readyz", "/metrics"):  # /metrics checks its own token
            return None
        if scope["path"] == WORKLOAD_LOGS_PATH:  # a log reader's token too (`protocol/logs.py`)
            node_id = agent.state.node_id
            reason = logs_refusal_reason(control_plane, problems.header(scope, b"authorization"), node_id=node_id)
            return problems.unauthenticated(reason) if reason else None
        return caller_refusal(control_plane, scope, node_id=agent.state.node_id, tenant=agent.state.tenant_id)

    app.add_middleware(Gate, check=control_plane_only, body=request_body)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "node_id": agent.state.node_id}

    install_metrics(app, lambda: metrics_tokens)

    async def gpus() -> None:
        reading = await asyncio.to_thread(agent.probe.read)
        if reading.fatal_error is not None:
            raise RuntimeError(f"the GPU probe reports {reading.fatal_error.model_dump_json()}")

    install_readiness(app, {"gpus": gpus})

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
    async def act(action: str, req: ActionRequest) -> JSONResponse:
        return await answer_action(action, req, agent.act)

    install_workload_logs(app, agent.workloads)

    if weights is not None:  # after every route above: what none of them serves goes here
        app.mount("", weights)
    return app
