"""`gpucloud ARGS` in a process of its own, forked from a server that imported the CLI once.

A fresh `python -m gpucloud.cli.main sim` spends about 1.5 CPU-seconds importing before it does
anything, and the suite starts a simulated fleet some 150 times (and a worker process some 20)
on two cores. multiprocessing's
forkserver imports the CLI once per test process and forks each command from there: the child
runs exactly what `python -m gpucloud.cli.main ARGS` runs (the same Typer app, its own
environment, its output appended to a log file), as its own process that the test can
terminate or kill. The forkserver is single-threaded, so forking it is safe.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from gpucloud.devstack.forked import as_cli_process, forget_cli

# What `gpucloud sim` and `gpucloud worker` import by the time they serve.
_PRELOAD = [
    "gpucloud.cli.main",
    "gpucloud.bootstrap",
    "gpucloud.db",
    "gpucloud.sim.fleet",
    "gpucloud.sim.metering",
    "gpucloud.sim.node_weights",
    "gpucloud.entrypoints.simulators",  # the fabric managers' routes, built at import
    "gpucloud.entrypoints.ledger",  # the billing chaos test's ledger, started again after each kill
    "gpucloud.workers.main",
    "alembic.command",
    __name__,
]
_context: multiprocessing.context.ForkServerContext | None = None


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        _context = context
    return _context


def _run(args: list[str], env: dict[str, str], log_path: str) -> None:
    as_cli_process(args, env, stdout=log_path)
    from gpucloud.cli.main import app  # the fork server's, imported once

    app(args, prog_name="gpucloud")


def _run_to_end(args: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    os.chdir(cwd)
    as_cli_process(args, env, stdout=out_path, stderr=err_path, append=False)
    forget_cli()  # imported anew under this command's environment, as a fresh interpreter would
    from gpucloud.cli.main import app

    app(args, prog_name="gpucloud")


def run_cli(
    args: list[str], *, env: Mapping[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`gpucloud ARGS` run to its end in a process of its own, as `subprocess.run(...,
    capture_output=True, text=True)` would run `python -m gpucloud.cli.main ARGS`: its own
    environment (only `env`), working directory, stdout, stderr and exit code; the libraries
    come imported from the fork server, the CLI itself is imported anew (0.1 CPU-s, not the
    0.5 to 0.7 of a fresh interpreter with bytecode)."""
    with tempfile.TemporaryDirectory(prefix="gpucloud-cli-") as scratch:
        out_path, err_path = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        process = _forkserver().Process(
            target=_run_to_end,
            args=(args, dict(env), str(cwd), out_path, err_path),
            name=args[0] if args else "gpucloud",
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join(10)
            raise subprocess.TimeoutExpired(["gpucloud", *args], timeout)
        with open(out_path) as out, open(err_path) as err:
            return subprocess.CompletedProcess(["gpucloud", *args], process.exitcode, out.read(), err.read())


class CliProcess:
    """What the harness needs of a `subprocess.Popen`: poll, terminate, kill, wait."""

    def __init__(self, args: list[str], *, env: Mapping[str, str], log_path: Path) -> None:
        self.args = args
        self._process = _forkserver().Process(target=_run, args=(args, dict(env), str(log_path)), name=args[0])
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["gpucloud", *self.args], timeout or 0)
        return self._process.exitcode
