"""`gpucloud up`'s Python children, forked from one interpreter that imported the control plane.

Every child of the local stack but one is `gpucloud <command>` (the ledger, the fabric managers,
the tracker, the worker, the API, the simulated fleet), and a fresh interpreter spends about 1.2
to 2 CPU-seconds importing before it serves: most of what `up` costs to start. Here one fork
server (multiprocessing's `forkserver`, a single-threaded process started for the purpose)
imports what they share once, and each child is forked from it and runs exactly what `python -m
gpucloud.cli.main <command>` runs: the same Typer app, with only its own environment (the
server's is cleared), its output appended to its log, in a session of its own (a Ctrl-C reaches
only `up`), dying with the fork server, which ends when `up` does, however `up` dies.

The evaluation worker is not forked: it runs tenants' evaluation commands, and a forked process
keeps its parent's memory and start-up environment (`/proc/<pid>/environ`), which hold what `up`
was started with. It is started afresh, as are Temporal and the image server (not Python CLIs).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpucloud import children

# What the forked commands import by the time they serve (each child imports the rest itself).
PRELOAD = [
    "gpucloud.cli.main",
    "gpucloud.bootstrap",
    "gpucloud.db",
    "gpucloud.workers.main",
    "gpucloud.entrypoints.api",
    "gpucloud.entrypoints.ledger",
    "gpucloud.entrypoints.simulators",
    "gpucloud.sim.fleet",
    "alembic.command",
]


def _run(args: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked child: `gpucloud ARGS` as a fresh interpreter would run it."""
    os.setsid()
    children.die_with_parent(os.getppid())  # the fork server, which ends with `up`
    # multiprocessing hands each child the write end of the pipe whose end tells the fork server
    # that its parent is gone; a child that kept it would keep the server, and itself, alive
    # after `up` died. These children start no process through the fork server.
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    as_cli_process(args, env, stdout=log_path)
    forget_cli()
    runpy.run_module("gpucloud.cli.main", run_name="__main__", alter_sys=True)


def as_cli_process(
    args: list[str], env: dict[str, str], *, stdout: str, stderr: str | None = None, append: bool = True
) -> None:
    """In a freshly forked child: make it the process `python -m gpucloud.cli.main ARGS` would be
    before it runs, standard input /dev/null on descriptor 0 (multiprocessing leaves a private
    one, which uvicorn's workers cannot reopen), `stdout` on 1 and `stderr` (else the same file)
    on 2, only `env` in its environment, ARGS in `sys.argv`."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's standard input, for its life
    mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    for fd, path in ((1, stdout), (2, stderr or stdout)):
        opened = os.open(path, mode, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["gpucloud", *args]


def forget_cli() -> None:
    """Drop the CLI's own modules, so that importing them again makes their consoles under this
    process's environment (they read COLUMNS, NO_COLOR and the terminal when made)."""
    for name in [n for n in sys.modules if n == "gpucloud.cli" or n.startswith("gpucloud.cli.")]:
        del sys.modules[name]


@contextlib.contextmanager
def _main_not_run_again() -> Iterator[None]:
    """multiprocessing runs the parent's `__main__` module again in each child (as `__mp_main__`,
    for pickled references to it); these children run the CLI themselves (`_run`)."""
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {key: main.__dict__[key] for key in ("__spec__", "__file__") if key in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


class ForkedChild:
    """What the stack needs of a `subprocess.Popen` (poll, returncode, send_signal, terminate,
    kill, wait, pid), for a `gpucloud ARGS` child forked from the fork server."""

    _context: multiprocessing.context.ForkServerContext | None = None

    def __init__(self, args: list[str], *, env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self._process = self._server().Process(target=_run, args=(args, dict(env), str(log_path)), name=args[0])
        with _main_not_run_again():
            self._process.start()
        self.pid: int = self._process.pid or 0

    @classmethod
    def _server(cls) -> multiprocessing.context.ForkServerContext:
        if cls._context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            cls._context = context
        return cls._context

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["gpucloud", *self.args], timeout or 0)
        return self._process.exitcode


def available() -> bool:
    """Whether children can be forked here (Linux: the death signal they rely on)."""
    return sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods()
