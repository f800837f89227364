"""`gpucloud api` as a process of its own (to kill -9 it), and a client's patience with it."""

from __future__ import annotations

import os
import time

import httpx

from gpucloud.devstack.stack import free_port
from support.forked import CliProcess


class ApiProcess:
    """`gpucloud api` as its own process on its own port, over the harness's database."""

    def __init__(self, settings, log_path) -> None:
        self.port = free_port()
        self.env = {**os.environ, **settings.env(), "GPUCLOUD_API__PORT": str(self.port)}
        self.env["GPUCLOUD_LOG_LEVEL"] = "WARNING"
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: CliProcess | None = None

    def start(self) -> None:
        """Forked from the test process's server that imported the CLI (`support/forked.py`): the
        kill tests start it again after each kill, and a fresh interpreter imports for over a
        CPU-second first."""
        self.proc = CliProcess(["api"], env=self.env, log_path=self.log_path)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def until_answered(call) -> httpx.Response:
    """The call's answer, retried through a dead API, overload and a claim still held."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            resp = call()
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        if resp.status_code not in (409, 429, 503) or not resp.json().get("type", "").endswith(
            ("in-progress", "overloaded", "too-many-requests", "unavailable")
        ):
            return resp
        time.sleep(min(float(resp.headers.get("Retry-After", "0.5")), 1.0))
    raise AssertionError("no answer within 60 s")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
