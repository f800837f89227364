"""The command evaluator: a model's own evaluation program, run by the platform against a pulled
and verified version directory, under a time limit.

The program gets the directory as `GPUCLOUD_MODEL_DIR` (and as its working directory), its own
environment on top of a minimal one, and prints its metrics as one JSON object (names to
finite numbers) as the last line of its standard output. Anything else fails the evaluation
with the reason, never a pass:

- it exits non-zero (the reason carries the code and the end of its standard error; in a
  container, the end of its standard output only, as the runtime's client writes its own errors
  to the same standard error, and none of the runtime's words reach the tenant);
- it runs past the time limit (its whole process group is killed: children too);
- its last line is not one JSON object of finite numbers (the reason quotes what it printed);
- it prints more than `MAX_OUTPUT_BYTES` (it cannot fill the platform's memory).

What it printed is what the platform then signs as this evaluator's results. A reason is at
most `MAX_FAILURE_CHARS` long: it is signed and shown to the tenant.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpucloud import children

MAX_OUTPUT_BYTES = 1 << 20
MAX_METRICS = 256
MAX_FAILURE_CHARS = 2048
OUTPUT_TAIL_CHARS = 500
# What docker and podman `run` exit with when the runtime itself failed (125: the runtime, say
# an image it cannot pull; 126: the program cannot be run; 127: no such program in the image).
RUNTIME_EXIT_CODES = {
    125: "the container runtime could not run the command",
    126: "the program could not be run in the image",
    127: "the program was not found in the image",
}


@dataclass(frozen=True)
class CommandOutcome:
    ok: bool
    metrics: dict[str, float]
    reason: str
    seconds: float
    exit_code: int | None


def bounded(reason: str) -> str:
    """A failure reason cut to `MAX_FAILURE_CHARS`."""
    return reason if len(reason) <= MAX_FAILURE_CHARS else reason[: MAX_FAILURE_CHARS - 3] + "..."


def _failed(reason: str, started: float, exit_code: int | None = None) -> CommandOutcome:
    return CommandOutcome(False, {}, bounded(reason), time.monotonic() - started, exit_code)


def _exit_reason(code: int, stdout: bytes, stderr_tail: str, *, in_container: bool) -> str:
    """Why a command that exited `code` failed, in words the tenant may see (see the module doc)."""
    if not in_container:
        return f"the command exited with {code}: {stderr_tail[-OUTPUT_TAIL_CHARS:] or 'no error output'}"
    if code in RUNTIME_EXIT_CODES:
        return f"{RUNTIME_EXIT_CODES[code]} (exit {code})"
    said = stdout.decode(errors="replace").strip()[-OUTPUT_TAIL_CHARS:]
    return f"the command exited with {code}: {said or 'no output'}"


def parse_metrics(last_line: str) -> dict[str, float]:
    """One JSON object of names to finite numbers; ValueError naming what is wrong otherwise."""
    try:
        value = json.loads(last_line)
    except json.JSONDecodeError:
        raise ValueError(f"its last line is not JSON: {last_line[:200]!r}") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"its last line is not a JSON object of metrics: {last_line[:200]!r}")
    if len(value) > MAX_METRICS:
        raise ValueError(f"it printed {len(value)} metrics, more than {MAX_METRICS}")
    metrics = {}
    for name, number in value.items():
        if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number):
            raise ValueError(f"metric {name!r} is {number!r}, not a finite number")
        if not name or len(name) > 100:
            raise ValueError(f"metric name {name!r} is empty or longer than 100 characters")
        metrics[name] = float(number)
    return metrics


def run_command(
    argv: list[str],
    model_dir: Path,
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    in_container: bool = False,
) -> CommandOutcome:
    """Run one evaluation command against `model_dir`; its outcome, never an exception.
    `in_container`: `argv` is a container runtime's `run`, whose own errors are never quoted."""
    started = time.monotonic()
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {}), "GPUCLOUD_MODEL_DIR": str(model_dir)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as errors:
        try:
            # SIGTERM should the worker die while it waits (a container runtime's client passes
            # it on to the container, which `--rm` then removes).
            process = subprocess.Popen(
                argv,
                cwd=model_dir,
                env=environment,
                stdout=out,
                stderr=errors,
                start_new_session=True,
                **children.popen_kwargs(),
            )
        except OSError as error:
            return _failed(f"the command could not start: {error}", started)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return _failed(f"the command ran past its time limit of {timeout_s:g} s and was killed", started)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # whatever it left running in its group
        size = out.tell()
        out.seek(0)
        stdout = out.read(MAX_OUTPUT_BYTES + 1)
        errors.seek(max(0, errors.tell() - 2000))
        stderr_tail = errors.read().decode(errors="replace").strip()
    if code != 0:
        return _failed(_exit_reason(code, stdout, stderr_tail, in_container=in_container), started, code)
    if size > MAX_OUTPUT_BYTES:
        return _failed(f"the command printed {size} bytes, more than {MAX_OUTPUT_BYTES}", started, code)
    lines = [line for line in stdout.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return _failed("the command printed nothing; it must print its metrics as one JSON object", started, code)
    try:
        metrics = parse_metrics(lines[-1].strip())
    except ValueError as error:
        return _failed(f"the command's output is not metrics: {error}", started, code)
    return CommandOutcome(True, metrics, "ok", time.monotonic() - started, code)
