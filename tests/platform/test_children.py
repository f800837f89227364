"""A process's children die with it, however it dies (`gpucloud/children.py`): `kill -9` of a
parent leaves nothing running that it started. (Linux: `PR_SET_PDEATHSIG`.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from support.api_process import healthy
from support.stack import wait_until

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
]

ROOT = Path(__file__).resolve().parents[2]


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for whoever adopted it to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@contextmanager
def stack_holding(tmp_path: Path, spawn: str) -> Iterator[tuple[subprocess.Popen, str, int]]:
    """A process that makes a `Stack` as `gpucloud up` does and runs `spawn` (which leaves the
    child it started in `child`), then waits: (that process, the child's kind, its pid). Whatever
    is left running is killed at the end."""
    script = (
        textwrap.dedent(
            f"""
        import os, sys, time
        from gpucloud.config import Settings
        from gpucloud.devstack.stack import Stack

        stack = Stack(Settings(data_dir={str(tmp_path)!r}))
        """
        )
        + textwrap.dedent(spawn)
        + "\nprint(type(child).__name__, child.pid, flush=True)\ntime.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    child = None
    try:
        assert parent.stdout is not None
        kind, pid = parent.stdout.readline().split()
        child = int(pid)
        yield parent, kind, child
    finally:
        parent.kill()
        parent.wait(10)
        if child is not None and running(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_of_the_local_stack_dies_when_up_is_killed(tmp_path) -> None:
    """`gpucloud up` starts its children as `Stack._spawn` does (a session of their own, so a
    Ctrl-C reaches only `up`): killed outright, `up` stops nothing itself, and the kernel does."""
    sleeper = 'child = stack._spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], env={})'
    with stack_holding(tmp_path, sleeper) as (parent, _, child):
        assert running(child)
        parent.kill()
        parent.wait(10)
        assert wait_gone(child, 10), f"the stack's child {child} outlived `up`"


def test_a_forked_child_of_the_local_stack_serves_in_its_own_session_and_dies_when_up_is_killed(tmp_path) -> None:
    """`up`'s Python children are forked from its fork server (`devstack/forked.py`), not started
    afresh: each serves as `gpucloud <command>` would, in a session of its own, and `kill -9` of
    `up` ends the fork server and, through it, the child."""
    from gpucloud.devstack.stack import free_port

    port = free_port()
    fabric = f"""
        env = {{**os.environ, "GPUCLOUD_LOG_LEVEL": "WARNING"}}
        state = {str(tmp_path / "fabric.json")!r}
        stack._spawn_cli("fabric", "fabric-managers", "--port", "{port}", "--state", state, env=env)
        child = stack.processes["fabric"]
        """
    with stack_holding(tmp_path, fabric) as (parent, kind, child):
        assert kind == "ForkedChild"
        wait_until(lambda: healthy(f"http://127.0.0.1:{port}"), timeout_s=60, what="the forked fabric managers")
        assert os.getsid(child) == child  # a Ctrl-C at `up`'s terminal does not reach it
        # Forked from the fork server (its command line is the server's), not a fresh interpreter.
        assert b"multiprocessing.forkserver" in Path(f"/proc/{child}/cmdline").read_bytes()
        parent.kill()
        parent.wait(10)
        assert wait_gone(child, 15), f"the stack's forked child {child} outlived `up`"


def test_a_child_whose_parent_died_before_it_asked_exits_at_once() -> None:
    """Between its start and its request the parent may already be gone: nobody would signal."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; from gpucloud import children; children.die_with_parent(os.getppid() + 1)"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 1 and "is gone: exiting with it" in done.stderr, done.stderr
    alive = subprocess.run(
        [sys.executable, "-c", "import os; from gpucloud import children; children.die_with_parent(os.getppid())"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert alive.returncode == 0, alive.stderr


def test_uvicorn_workers_that_ask_die_with_a_master_killed_outright() -> None:
    """Uvicorn's master starts its workers through multiprocessing (no `preexec_fn` of ours), so
    each worker asks itself, in the app factory, as the API's do; `kill -9` of the master then
    frees the port instead of leaving two orphans serving it."""
    from gpucloud.devstack.stack import free_port

    port = free_port()
    master = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import uvicorn; uvicorn.run('support.dying_worker_app:create_app', factory=True, workers=2, "
            f"host='127.0.0.1', port={port}, log_level='warning')",
        ],
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"},
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2:
            assert master.poll() is None and time.monotonic() < deadline, "the workers did not come up"
            if _answers(port):  # one has asked; the other asks when it gets that far, or finds the master gone
                workers = [pid for pid in _children(master.pid) if "spawn_main" in _cmdline(pid)]
            time.sleep(0.2)
        master.kill()
        master.wait(10)
        assert all(wait_gone(pid, 30) for pid in workers), "uvicorn workers outlived their master"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
    finally:
        master.kill()
        master.wait(10)
        for pid in workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_api_workers_ask_to_die_with_their_master(monkeypatch, tmp_path) -> None:
    """`gpucloud api --workers N` builds each worker's app with `create_app_from_env`, which asks
    (the real master, on Postgres: tests/api/test_api_workers.py)."""
    from gpucloud import children
    from gpucloud.entrypoints.api import create_app_from_env

    asked = []
    monkeypatch.setenv("GPUCLOUD_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(children, "die_with_multiprocessing_parent", lambda: asked.append(True))
    create_app_from_env()
    assert asked == [True]


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except FileNotFoundError:
        return ""


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
