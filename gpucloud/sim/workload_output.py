"""What a simulated node's workload prints, and how it ends, synthesized from its command.

The simulated fleet runs in the control plane's devstack process, which holds platform secrets:
it never executes the tenant's command (architecture: tenant code runs only where no platform
secret is). It reads the command the way a person reading it would guess its output, and plays
that out in time, as a recording:

- `echo WORDS` prints the words (`$NAME` and `${NAME}` from the workload's environment, with
  `GPUCLOUD_ALLOCATION_ID` as the real agent sets it); `true`, `false` and `exit N` end with their
  status; `sleep S` waits S seconds. These, joined by `;`, `&&` or new lines, also inside
  `sh -c` / `bash -c`, are a program the simulator plays to its end: the node then reports the
  workload `exited` with the status of its last step.
- Anything else (a trainer, an image without a command) is a long job: it prints a step line every
  `STEP_S` seconds (deterministic numbers drawn from the command) until it is released, as the
  real thing would run until the tenant's allocation ends.

Nothing is stored per line: the output at any moment is a function of the command and the time
since the provision, so a fleet of thousands costs nothing while nobody reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import shlex
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gpucloud.protocol.actions import Workload
from gpucloud.protocol.logs import MAX_TAIL_BYTES, MAX_TAIL_LINES

STEP_S = 2.0  # a simulated long job prints one step line this often
SHELLS = frozenset({"sh", "bash", "dash", "zsh"})
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_STATEMENTS = re.compile(r";|\n")


@dataclass(frozen=True)
class SimulatedRun:
    """A workload as the simulator plays it: `lines` printed at their second since the start,
    then the end (`ends_at_s`, `exit_code`); `ends_at_s` None: a long job printing steps."""

    lines: tuple[tuple[float, str], ...]
    ends_at_s: float | None
    exit_code: int | None
    seed: int = 0

    def finished(self, elapsed_s: float) -> bool:
        return self.ends_at_s is not None and elapsed_s >= self.ends_at_s

    def status(self, elapsed_s: float) -> tuple[str, int | None]:
        """`running`, or `exited` with its code."""
        return ("exited", self.exit_code) if self.finished(elapsed_s) else ("running", None)

    def count(self, elapsed_s: float) -> int:
        """How many lines it has printed `elapsed_s` seconds after its start."""
        if self.ends_at_s is not None:
            return sum(1 for at, _ in self.lines if at <= elapsed_s)
        return max(0, math.floor(elapsed_s / STEP_S)) + len(self.lines)

    def line(self, index: int) -> str:
        """Its `index`-th line (0: the first it printed)."""
        if index < len(self.lines):
            return self.lines[index][1]
        step = index - len(self.lines) + 1
        loss = 2.5 * math.exp(-step / 400) + (self.seed % 1000) / 100_000
        return f"step {step} loss {loss:.4f} tokens/s {9000 + (self.seed + step * 7919) % 2000}"


def simulate(workload: Workload, *, allocation_id: str | None) -> SimulatedRun:
    """How the simulator plays `workload` (module doc)."""
    seed = int.from_bytes(hashlib.sha256(" ".join(workload.command).encode()).digest()[:4], "big")
    env = {**workload.env, "GPUCLOUD_ALLOCATION_ID": allocation_id or ""}
    script = _script_of(workload.command)
    played = _play(script, env) if script is not None and workload.image is None else None
    if played is None:
        return SimulatedRun(lines=(), ends_at_s=None, exit_code=None, seed=seed)
    lines, ends_at_s, code = played
    return SimulatedRun(lines=tuple(lines), ends_at_s=ends_at_s, exit_code=code, seed=seed)


def _script_of(command: list[str]) -> str | None:
    if not command:
        return None
    if command[0].rsplit("/", 1)[-1] in SHELLS and len(command) >= 3 and command[1] == "-c":
        return command[2]
    return shlex.join(command)


def _play(script: str, env: dict[str, str]) -> tuple[list[tuple[float, str]], float, int] | None:
    """The lines, end and status of a script of simple steps; None when a step is not one."""
    lines: list[tuple[float, str]] = []
    now, status = 0.0, 0
    for statement in _STATEMENTS.split(script):
        for position, step in enumerate(statement.split("&&")):
            if position > 0 and status != 0:
                break  # `a && b`: b runs only if a succeeded
            try:
                words = [w for w in shlex.split(step) if not w.startswith((">", "1>", "2>"))]
            except ValueError:
                return None
            if not words:
                continue
            args = [_VARIABLE.sub(lambda m: env.get(m.group(1) or m.group(2), ""), w) for w in words[1:]]
            played = _step(words[0], args)
            if played is None:
                return None
            kind, value = played
            if kind == "exit":
                return lines, now, int(value)
            if kind == "echo":
                lines.append((now, str(value)))
            elif kind == "sleep":
                now += float(value)
            status = 1 if kind == "false" else 0
    return lines, now, status


def _step(program: str, args: list[str]) -> tuple[str, str | float | int] | None:
    """One simple step: what it does, and its value (a line, seconds, a status)."""
    if program == "echo":
        return "echo", " ".join(args)
    if program in ("true", ":"):
        return "true", 0
    if program == "false":
        return "false", 1
    if program == "exit":
        return "exit", _code(args[0] if args else "0")
    if program == "sleep" and len(args) == 1 and (seconds := _seconds(args[0])) is not None:
        return "sleep", seconds
    return None


def _code(word: str) -> int:
    return int(word) % 256 if word.lstrip("-").isdigit() else 2


def _seconds(word: str) -> float | None:
    try:
        value = float(word)
    except ValueError:
        return None
    return value if 0 <= value < 86400 * 365 else None


def tail_text(run: SimulatedRun, elapsed_s: float, *, lines: int | None) -> tuple[str, int]:
    """The last `lines` lines printed by `elapsed_s` (bounded as a real agent bounds them,
    `protocol/logs.py`), and how many were printed in all (where a follow goes on)."""
    printed = run.count(elapsed_s)
    wanted = min(MAX_TAIL_LINES if lines is None else lines, MAX_TAIL_LINES)
    text, size = [], 0
    for index in range(printed - 1, max(-1, printed - 1 - wanted), -1):
        line = run.line(index) + "\n"
        size += len(line.encode())
        if size > MAX_TAIL_BYTES:
            break
        text.append(line)
    return "".join(reversed(text)), printed


async def follow_text(
    run: SimulatedRun,
    started_s: float,
    *,
    since: int,
    deadline_s: float,
    running: Callable[[], bool],
    clock: Callable[[], float],
    poll_s: float = 0.25,
) -> AsyncIterator[str]:
    """The lines printed after the first `since`, as they are printed, until the run ended (or
    the node's workload was stopped) or `deadline_s` passed."""
    end = clock() + deadline_s
    sent = since
    while clock() < end:
        elapsed = clock() - started_s
        printed = run.count(elapsed)
        if printed > sent:
            yield "".join(run.line(i) + "\n" for i in range(sent, printed))
            sent = printed
            continue
        if run.finished(elapsed) or not running():
            return
        await asyncio.sleep(poll_s)
