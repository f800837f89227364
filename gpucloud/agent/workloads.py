"""The tenant's processes on a node: started by `provision`, stopped by `release`, owned by the
agent whatever they do.

A workload (a command with its arguments and environment) runs in a PID namespace of its own
(`unshare --pid --fork --kill-child`, util-linux): its first process is PID 1 there, and when
that process dies the kernel kills every other process of the namespace, children that ignore
SIGTERM, double-forked daemons and all. `stop` sends SIGTERM to the workload's process group
(a grace period to checkpoint), then SIGKILL to the namespace's PID 1, and confirms from
`/proc` that no process of that namespace is left before it answers. Where `unshare` is missing
or not permitted (no CAP_SYS_ADMIN), the workload runs in a session of its own and `stop`
signals that process group, which a process that leaves its group escapes: the agent says so in
its status (`isolation`).

A workload with a container `image` runs in a container of the node's runtime (podman, else
docker; `--container-runtime` names another), detached and named after its allocation, with the
node's GPUs and its host network (the fabric is the node's): the runtime owns its processes (a
PID namespace of the container's own), `stop` asks the runtime to stop it (SIGTERM, the grace
period, SIGKILL), removes it, and confirms the runtime no longer lists it. A node without a
runtime refuses such a workload with a clear error instead of running something else.

The supervisor keeps what runs in a state file, so an agent restarted while the tenant's job
runs still finds it, reports it and stops it at release; the job does not depend on the agent
process (a new session, not the agent's child once the agent is gone).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from gpucloud.agent import workload_logs
from gpucloud.agent.workload_logs import DEFAULT_LIMITS, LogLimits
from gpucloud.config import write_private
from gpucloud.protocol.actions import Workload
from gpucloud.protocol.reports import Signal, SignalObservation, WorkloadStatus

log = logging.getLogger(__name__)

# The variable that names the workload's progress file (`Workload.progress_timeout_s`).
PROGRESS_ENV = "GPUCLOUD_PROGRESS_FILE"

Isolation = Literal["pid-namespace", "process-group", "container"]


@dataclass(frozen=True)
class Running:
    """What the state file keeps about the workload the agent started."""

    allocation_id: str
    pid: int  # the process the agent started (unshare, or the command itself)
    pid_namespace: str | None  # `pid:[4026532...]` of the workload's namespace, when it has one
    isolation: str
    started_at: float
    log_path: str
    container: str | None = None  # the container's name, when the workload runs in one
    runtime: str | None = None  # the runtime that runs it (podman or docker)
    # How the workload ended, once this agent saw it end: kept here, so an agent restarted after
    # that still reports it (what it could not see end, it reports without a code).
    exit_code: int | None = None
    # The tenant's progress heartbeat (`Workload.progress_timeout_s`): the file it touches.
    progress_file: str | None = None
    progress_timeout_s: float | None = None


class StopFailed(RuntimeError):
    """Processes of the workload were still alive after SIGKILL."""


class NoContainerRuntime(RuntimeError):
    """The workload names an image and this node has no container runtime."""


class ContainerRuntime:
    """The node's podman or docker CLI: the few commands a workload needs, each bounded in time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.flavour = "podman" if "podman" in Path(path).name else "docker"

    def _run(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run([self.path, *args], capture_output=True, text=True, timeout=timeout_s, check=False)

    def start(
        self, name: str, allocation_id: str, workload: Workload, env_file: Path, log_path: Path, limits: LogLimits
    ) -> None:
        gpus = ["--device", "nvidia.com/gpu=all"] if self.flavour == "podman" else ["--gpus", "all"]
        # The runtime keeps the container's output, rotated by its log driver as the node's own
        # workloads' is (podman's k8s-file driver knows a size, not a count of files).
        logs = ["--log-opt", f"max-size={limits.max_bytes}"]
        if self.flavour == "docker":
            logs += ["--log-opt", f"max-file={limits.files}"]
        answer = self._run(
            "run",
            "--detach",
            "--name",
            name,
            "--label",
            f"gpucloud.allocation={allocation_id}",
            "--env-file",
            str(env_file),
            "--network",
            "host",
            "--ipc",
            "host",
            *logs,
            *gpus,
            "--",
            str(workload.image),
            *workload.command,
            timeout_s=600.0,  # the image may be pulled first
        )
        with open(log_path, "a") as out:
            out.write(answer.stdout + answer.stderr)
        if answer.returncode != 0:
            raise RuntimeError(f"{self.flavour} run {workload.image} failed: {answer.stderr.strip()[-500:]}")

    def state(self, name: str) -> tuple[str, int | None, int]:
        """(status, exit code, main pid); ("missing", None, 0) once the runtime no longer has it."""
        answer = self._run("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}} {{.State.Pid}}", name)
        if answer.returncode != 0:
            return "missing", None, 0
        status, code, pid = [*answer.stdout.split(), "", "0", "0"][:3]
        return status, int(code) if code.lstrip("-").isdigit() else None, int(pid) if pid.isdigit() else 0

    def stop(self, name: str, grace_s: float) -> None:
        self._run("stop", "--time", str(max(1, round(grace_s))), name, timeout_s=grace_s + 60.0)
        self._run("rm", "--force", name)

    def logs_argv(self, name: str, *, tail: int | None, follow: bool) -> list[str]:
        """The command that prints the container's output (stdout and stderr) as the runtime kept it."""
        lines = str(tail) if tail is not None else "all"
        return [self.path, "logs", *(["--follow"] if follow else []), "--tail", lines, name]

    def listed(self, name: str) -> bool:
        answer = self._run("ps", "--all", "--quiet", "--filter", f"name=^{name}$")
        return answer.returncode != 0 or bool(answer.stdout.strip())


def _namespace_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for task in tasks for c in (task / "children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped


def processes_in(namespace: str) -> list[int]:
    """Every live process whose PID namespace is `namespace`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _namespace_of(int(entry.name)) == namespace and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


class WorkloadSupervisor:
    """One node's workload: start, status, stop; its record kept in `state_dir`."""

    def __init__(
        self,
        state_dir: Path,
        *,
        grace_s: float = 10.0,
        unshare: str | None = None,
        container_runtime: str | None = None,
        log_limits: LogLimits = DEFAULT_LIMITS,
    ) -> None:
        """`log_limits`: how much of a workload's output the node keeps (`agent/workload_logs.py`)."""
        self.state_dir = state_dir
        self.log_limits = log_limits
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self._unshare = unshare if unshare is not None else shutil.which("unshare")
        # None: the node's podman, else docker; "": none (commands only).
        found = shutil.which("podman") or shutil.which("docker") if container_runtime is None else container_runtime
        self.runtime = ContainerRuntime(found) if found else None
        self._lock = threading.Lock()
        self._isolation: Isolation | None = None  # probed once, on the first start
        self._proc: subprocess.Popen | None = None  # ours to reap, when this agent started it
        self._pump: subprocess.Popen | None = None  # the process writing its output (ours to reap)
        self._exit_code: int | None = None
        self._hang_reported: float | None = None  # the progress time of the stall last reported

    @property
    def _state_file(self) -> Path:
        return self.state_dir / "workload.json"

    def running(self) -> Running | None:
        try:
            return Running(**json.loads(self._state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _save(self, running: Running | None) -> None:
        if running is None:
            self._state_file.unlink(missing_ok=True)
            return
        write_private(self._state_file, json.dumps(asdict(running)))

    # Start ----------------------------------------------------------------------------------------

    def start(self, allocation_id: str, workload: Workload, *, cwd: Path) -> Running:
        """Start the workload for `allocation_id`; the one already running for it is kept."""
        with self._lock:
            current = self.running()
            if current is not None and self._is_running(current):
                if current.allocation_id == allocation_id:
                    return current
                raise RuntimeError(f"the workload of allocation {current.allocation_id} still runs; release it first")
            cwd.mkdir(parents=True, exist_ok=True)
            log_path = self.state_dir / f"workload-{allocation_id}.log"
            if workload.image is not None:
                return self._start_container(allocation_id, workload, log_path)
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                **workload.env,
                "GPUCLOUD_ALLOCATION_ID": allocation_id,
            }
            progress = self._progress_file(allocation_id) if workload.progress_timeout_s else None
            if progress is not None:
                env[PROGRESS_ENV] = str(progress)
            if self._isolation is None:
                self._isolation = "pid-namespace" if self._namespaces_work() else "process-group"
            isolation = self._isolation
            argv = list(workload.command)
            if isolation == "pid-namespace" and self._unshare:
                argv = [self._unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "--", *argv]
            self._proc = self._start_logged(argv, cwd=cwd, env=env, log_path=log_path)
            self._exit_code = None
            namespace = self._wait_for_namespace(self._proc.pid) if isolation == "pid-namespace" else None
            running = Running(
                allocation_id,
                self._proc.pid,
                namespace,
                isolation,
                time.time(),
                str(log_path),
                progress_file=str(progress) if progress is not None else None,
                progress_timeout_s=workload.progress_timeout_s,
            )
            self._hang_reported = None
            self._save(running)
            log.info("workload of %s started: pid %d (%s)", allocation_id, self._proc.pid, isolation)
            return running

    def _start_container(self, allocation_id: str, workload: Workload, log_path: Path) -> Running:
        if self.runtime is None:
            raise NoContainerRuntime(
                f"the workload runs image {workload.image}, and this node has no container runtime "
                "(podman or docker): run a command instead, or use nodes that have one"
            )
        name = f"gpucloud-{allocation_id}"
        if self.runtime.state(name)[0] != "missing":
            self.runtime.stop(name, self.grace_s)  # a leftover of an earlier try: start afresh
        env_file = self.state_dir / f"workload-{allocation_id}.env"
        write_private(
            env_file,
            "".join(f"{k}={v}\n" for k, v in {**workload.env, "GPUCLOUD_ALLOCATION_ID": allocation_id}.items()),
        )
        try:
            self.runtime.start(name, allocation_id, workload, env_file, log_path, self.log_limits)
        finally:
            env_file.unlink(missing_ok=True)
        _, _, pid = self.runtime.state(name)
        running = Running(
            allocation_id,
            pid,
            _namespace_of(pid) if pid else None,
            "container",
            time.time(),
            str(log_path),
            container=name,
            runtime=self.runtime.path,
        )
        self._save(running)
        self._proc, self._exit_code = None, None
        log.info("workload of %s started: container %s (%s)", allocation_id, name, self.runtime.flavour)
        return running

    def _start_logged(self, argv: list[str], *, cwd: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen:
        """Start `argv` with its stdout and stderr in one pipe, read by the pump that keeps them
        rotated at `log_path` (`agent/workload_logs.py`): a process of its own session, so that
        neither the workload's signals nor the agent's restart end it."""
        self._reap_pump()
        read_end, write_end = os.pipe()
        try:
            self._pump = subprocess.Popen(
                workload_logs.pump_argv(log_path, self.log_limits),
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=workload_logs.pump_env(),
                start_new_session=True,
            )
            os.close(read_end)
            read_end = -1
            return subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=write_end,
                stderr=write_end,
                start_new_session=True,
            )
        finally:
            os.close(write_end)  # the workload holds its own copy: the pump ends when it is gone
            if read_end >= 0:
                os.close(read_end)

    def _reap_pump(self) -> None:
        if self._pump is not None and self._pump.poll() is not None:
            self._pump = None

    def log_path(self) -> Path | None:
        """Where the current (or last) workload's output is kept; None when none ran here."""
        current = self.running()
        return Path(current.log_path) if current is not None else None

    def _namespaces_work(self) -> bool:
        if not self._unshare:
            return False
        probe = subprocess.run(
            [self._unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "true"], capture_output=True, check=False
        )
        return probe.returncode == 0

    def _wait_for_namespace(self, pid: int, timeout_s: float = 5.0) -> str | None:
        """The PID namespace of the workload: that of unshare's child once it exists."""
        own = _namespace_of(pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for child in _children(pid):
                namespace = _namespace_of(child)
                if namespace is not None and namespace != own:
                    return namespace
            if not _alive(pid):
                return None
            time.sleep(0.01)
        return None

    # Status ---------------------------------------------------------------------------------------

    def _is_running(self, current: Running) -> bool:
        if current.container is not None:
            return ContainerRuntime(current.runtime or "docker").state(current.container)[0] == "running"
        self._reap()
        if current.pid_namespace is not None:
            return bool(processes_in(current.pid_namespace))
        return _alive(current.pid) and _namespace_of(current.pid) is not None

    def _reap(self, wait_s: float = 0.0) -> None:
        """The exit code of the process this agent started, once it ended (within `wait_s`)."""
        if self._proc is not None and self._exit_code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._exit_code = self._proc.wait(timeout=wait_s) if wait_s else self._proc.poll()
        self._reap_pump()

    def _progress_file(self, allocation_id: str) -> Path:
        """The file the workload touches to say it makes progress: created now (the clock starts
        at the start), writable by the workload."""
        directory = self.state_dir / "progress"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{allocation_id}.progress"
        path.touch()
        return path

    def hung(self, *, now: float | None = None) -> SignalObservation | None:
        """A `workload_hang` observation when the running workload set a progress timeout and has
        not touched its progress file for longer (once per stall: the next after it touches the
        file again and stalls again); None otherwise."""
        current = self.running()
        if current is None or current.progress_timeout_s is None or current.progress_file is None:
            return None
        now = time.time() if now is None else now
        try:
            last = max(Path(current.progress_file).stat().st_mtime, current.started_at)
        except OSError:
            last = current.started_at
        stalled_s = now - last
        if stalled_s <= current.progress_timeout_s or self._hang_reported == last:
            return None
        if self.status().get("workload") != "running":
            return None
        self._hang_reported = last
        return SignalObservation(
            signal=Signal.WORKLOAD_HANG,
            at=datetime.fromtimestamp(now, tz=UTC),
            source=current.allocation_id[:128],
            detail=f"no progress for {stalled_s:.0f} s (the tenant's timeout is {current.progress_timeout_s:g} s)",
        )

    def report(self) -> WorkloadStatus:
        """`status` as the agent reports it in its heartbeats."""
        now = self.status()
        return WorkloadStatus(
            state=now["workload"],
            allocation_id=now.get("allocation_id"),
            exit_code=now.get("exit_code"),
            isolation=now.get("isolation"),
        )

    def status(self) -> dict:
        """`none`, `running`, or `exited` (with its code, when this agent started it)."""
        with self._lock:
            current = self.running()
            if current is None:
                return {"workload": "none"}
            base = {"allocation_id": current.allocation_id, "isolation": current.isolation, "pid": current.pid}
            if current.container is not None:
                status, code, _ = ContainerRuntime(current.runtime or "docker").state(current.container)
                if status in ("running", "created", "restarting", "paused"):
                    return base | {"workload": "running", "container": current.container}
                return base | {"workload": "exited", "exit_code": code, "container": current.container}
            if self._is_running(current):
                return base | {"workload": "running"}
            self._reap(wait_s=2.0)  # its last process is gone: the one we started ends at once
            return base | {"workload": "exited", "exit_code": self._exit_code_of(current)}

    def _exit_code_of(self, current: Running) -> int | None:
        """The code the workload ended with: seen by this agent (and kept in the state file for
        the next one), or kept there by an earlier one."""
        if current.exit_code is not None:
            return current.exit_code
        ours = self._proc is not None and self._proc.pid == current.pid
        if not ours or self._exit_code is None:
            return None
        self._save(replace(current, exit_code=self._exit_code))
        return self._exit_code

    # Stop -----------------------------------------------------------------------------------------

    def stop(self) -> dict:
        """Stop every process of the workload and confirm none is left; idempotent."""
        with self._lock:
            current = self.running()
            if current is None:
                return {"workload": "none", "stopped": 0}
            if current.container is not None:
                return self._stop_container(current)
            before = self._members(current)
            if before:
                self._signal(current, signal.SIGTERM)
                deadline = time.monotonic() + self.grace_s
                while self._members(current) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if self._members(current):
                self._kill(current)
                deadline = time.monotonic() + 10.0
                while self._members(current) and time.monotonic() < deadline:
                    time.sleep(0.02)
            left = self._members(current)
            if left:
                raise StopFailed(f"{len(left)} processes of the workload of {current.allocation_id} survived SIGKILL")
            self._reap()
            self._save(None)
            log.info("workload of %s stopped (%d processes)", current.allocation_id, len(before))
            return {"workload": "stopped", "allocation_id": current.allocation_id, "stopped": len(before)}

    def _stop_container(self, current: Running) -> dict:
        assert current.container is not None
        runtime = ContainerRuntime(current.runtime or "docker")
        was_running = runtime.state(current.container)[0] == "running"
        runtime.stop(current.container, self.grace_s)
        if runtime.listed(current.container):
            raise StopFailed(f"{runtime.flavour} still lists container {current.container} after stop and rm")
        left = processes_in(current.pid_namespace) if current.pid_namespace is not None else []
        if left:
            raise StopFailed(f"{len(left)} processes of container {current.container} survived its removal")
        self._save(None)
        log.info("workload of %s stopped (container %s removed)", current.allocation_id, current.container)
        return {"workload": "stopped", "allocation_id": current.allocation_id, "stopped": int(was_running)}

    def _members(self, current: Running) -> list[int]:
        self._reap()
        if current.pid_namespace is not None:
            members = processes_in(current.pid_namespace)
            return members + ([current.pid] if _alive(current.pid) else [])
        try:
            os.killpg(current.pid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [current.pid]

    def _signal(self, current: Running, sig: signal.Signals) -> None:
        """`sig` to the workload's process group, and to every process of its namespace."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(current.pid, sig)
        if current.pid_namespace is not None:
            for pid in processes_in(current.pid_namespace):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def _kill(self, current: Running) -> None:
        """SIGKILL: in a namespace, its PID 1 first (the kernel then kills the rest), then all."""
        if current.pid_namespace is not None:
            init = next((c for c in _children(current.pid) if _namespace_of(c) == current.pid_namespace), None)
            if init is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGKILL)
        self._signal(current, signal.SIGKILL)
