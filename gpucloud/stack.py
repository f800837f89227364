"""The embedded stack for one laptop: Temporal dev server, worker, API and simulated fleet as
child processes, started in order, each waited on until it answers, stopped in reverse.

Everything lives in the data dir (databases, logs, operator token), so a second `up` on the
same data dir resumes where the first stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gpucloud.config import Settings
from gpucloud.temporal_server import server_args


class StackError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass
class Stack:
    settings: Settings
    nodes: int = 16
    ui_port: int | None = None
    sim_latency_scale: float = 1.0
    headless: bool = False
    register_fleet: bool = True
    sim_heartbeat_s: float = 10.0
    temporal_persist: bool = True
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def log_dir(self) -> Path:
        return self.settings.data_dir / "logs"

    @property
    def ui_url(self) -> str:
        host, port = self.settings.temporal_address.rsplit(":", 1)
        return f"http://{host}:{self.ui_port or int(port) + 1000}"

    def env(self) -> dict[str, str]:
        s = self.settings
        return {
            **os.environ,
            "GPUCLOUD_DATA_DIR": str(s.data_dir.resolve()),
            "GPUCLOUD_TEMPORAL_ADDRESS": s.temporal_address,
            "GPUCLOUD_TEMPORAL_NAMESPACE": s.temporal_namespace,
            "GPUCLOUD_DATABASE_URL": s.db_url,
            "GPUCLOUD_API_HOST": s.api_host,
            "GPUCLOUD_API_PORT": str(s.api_port),
            "GPUCLOUD_SIM_HOST": s.sim_host,
            "GPUCLOUD_SIM_PORT": str(s.sim_port),
            "GPUCLOUD_OPERATOR_TOKEN": s.resolved_operator_token,
            "GPUCLOUD_SWEEP_INTERVAL_S": str(s.sweep_interval_s),
            "GPUCLOUD_HEARTBEAT_TIMEOUT_S": str(s.heartbeat_timeout_s),
            "GPUCLOUD_DEADLINE_SCALE": str(s.deadline_scale),
        }

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                start_new_session=True)
        self.processes[name] = proc
        return proc

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "gpucloud.cli", *args]

    def _check_ports(self) -> None:
        host, port = self.settings.temporal_address.rsplit(":", 1)
        for what, h, p in (("Temporal", host, int(port)), ("API", self.settings.api_host, self.settings.api_port),
                           ("simulated fleet", self.settings.sim_host, self.settings.sim_port)):
            if port_in_use(h, p):
                raise StackError(f"port {p} for the {what} is already in use (another `gpucloud up`?); "
                                 f"stop it or pick other ports with GPUCLOUD_* settings")

    def start(self, on_step: Callable[[str], None] = lambda _: None) -> None:
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self._check_ports()
        _, port = self.settings.temporal_address.rsplit(":", 1)
        on_step("starting Temporal dev server")
        self._spawn("temporal", server_args(self.settings.data_dir.resolve(), port=int(port),
                                            ui_port=self.ui_port, headless=self.headless,
                                            persist=self.temporal_persist))
        self._wait("temporal", self._temporal_ready, 90)
        on_step("starting worker")
        self._spawn("worker", self._cli("worker"))
        on_step("starting API")
        self._spawn("api", self._cli("api"))
        self._wait("api", lambda: self._http_ok(f"{self.settings.api_url}/healthz"), 60)
        on_step(f"starting simulated fleet ({self.nodes} nodes)")
        register = ["--register"] if self.register_fleet else []
        self._spawn("sim", self._cli("sim", "--nodes", str(self.nodes), *register,
                                     "--latency-scale", str(self.sim_latency_scale),
                                     "--heartbeat-interval", str(self.sim_heartbeat_s)))
        self._wait("sim", lambda: self._http_ok(f"{self.settings.sim_url}/healthz"), 60)
        self._ensure_alive("worker")

    def _temporal_ready(self) -> bool:
        from gpucloud.client import connect

        async def probe() -> bool:
            try:
                client = await connect(self.settings)
                await client.count_workflows()
                return True
            except Exception:
                return False

        return asyncio.run(probe())

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _ensure_alive(self, name: str) -> None:
        proc = self.processes[name]
        if proc.poll() is not None:
            raise StackError(f"{name} exited with code {proc.returncode}; see {self.log_dir / (name + '.log')}")

    def _wait(self, name: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._ensure_alive(name)
            if ready():
                return
            time.sleep(0.3)
        raise StackError(f"{name} did not become ready within {timeout_s:.0f}s; see {self.log_dir / (name + '.log')}")

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes.values())

    def stop(self, timeout_s: float = 15.0) -> None:
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()
