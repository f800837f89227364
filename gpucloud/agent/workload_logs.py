"""A workload's output on its node: captured, bounded, rotated, and read back for the control plane.

The workload's stdout and stderr go, interleaved as the program wrote them (as `kubectl logs` and
`docker logs` show them), into one pipe whose other end a small pump process reads (`pump`, run
as `python -m gpucloud.agent.workload_logs`, like podman's conmon): it writes what it reads to
`<name>.log` and, once that file holds `max_bytes`, shifts the files (`<name>.log` becomes
`<name>.log.1`, that one `<name>.log.2`, ...), keeping `files` of them, so a workload that prints
without end costs the node `max_bytes × files` of disk at most. The pump runs in a session of its
own: an agent that restarts while the tenant's job runs does not cut the pipe (a job writing to a
pipe nobody reads would die of SIGPIPE); it ends when the last process of the workload closed the
pipe, that is when the workload ended.

What the workload printed is the tenant's text: it is read back as bytes and handed over as they
are (`tail`, `follow`), bounded in size and time, never parsed (the tenant has root on the node and
writes whatever it likes there).

This module imports nothing but the standard library: the pump starts with the workload.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BYTES = 10 * 1024 * 1024  # per file
DEFAULT_FILES = 5  # the current file and four older ones
READ_CHUNK = 64 * 1024
# The most a tail hands over at once, whatever it is asked: a screenful of lines is what a
# person reads, and a program that wants all of it follows from the start of the newest file.
MAX_TAIL_BYTES = 1024 * 1024
MAX_TAIL_LINES = 10_000


@dataclass(frozen=True)
class LogLimits:
    """How much of a workload's output a node keeps (`--workload-log-max-bytes`, `--workload-log-files`)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    files: int = DEFAULT_FILES

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.files < 1:
            raise ValueError("a workload's log needs at least one file of at least one byte")


DEFAULT_LIMITS = LogLimits()


def rotated(path: Path, index: int) -> Path:
    """The `index`-th older file of the log at `path` (0: the current one)."""
    return path if index == 0 else path.with_name(f"{path.name}.{index}")


def files_of(path: Path, limits: LogLimits) -> list[Path]:
    """The log's files that exist, oldest first."""
    return [p for p in (rotated(path, i) for i in reversed(range(limits.files))) if p.exists()]


class RotatingWriter:
    """Writes bytes to `path`, shifting it to `path.1` (and so on) each time it holds `max_bytes`."""

    def __init__(self, path: Path, limits: LogLimits) -> None:
        self.path, self.limits = path, limits
        self._file = open(path, "ab")  # noqa: SIM115 (kept open while the pump runs)
        self._size = self._file.tell()

    def write(self, data: bytes) -> None:
        while data:
            if self._size >= self.limits.max_bytes:
                self._rotate()
            room = self.limits.max_bytes - self._size
            piece, data = data[:room], data[room:]
            self._file.write(piece)
            self._file.flush()  # a reader sees each piece as soon as the program wrote it
            self._size += len(piece)

    def _rotate(self) -> None:
        self._file.close()
        for index in reversed(range(1, self.limits.files)):
            older = rotated(self.path, index - 1)
            if older.exists():
                os.replace(older, rotated(self.path, index))
        if self.limits.files == 1:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        self._file.close()


def pump(source: int, path: Path, limits: LogLimits) -> None:
    """Copy what arrives on the descriptor `source` to the rotated log until its writers are gone."""
    writer = RotatingWriter(path, limits)
    try:
        while data := os.read(source, READ_CHUNK):
            writer.write(data)
    finally:
        writer.close()


def pump_argv(path: Path, limits: LogLimits) -> list[str]:
    """The command that runs `pump` on its standard input, as a process of its own."""
    return [
        sys.executable,
        "-m",
        "gpucloud.agent.workload_logs",
        str(path),
        "--max-bytes",
        str(limits.max_bytes),
        "--files",
        str(limits.files),
    ]


def pump_env() -> dict[str, str]:
    """The pump's environment: where Python finds this package, nothing of the agent's own."""
    python_path = os.pathsep.join(p for p in sys.path if os.path.isdir(p))
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": python_path}


# Reading back --------------------------------------------------------------------------------------


def tail(
    path: Path, limits: LogLimits, *, lines: int | None, max_bytes: int = MAX_TAIL_BYTES, end: int | None = None
) -> bytes:
    """The last `lines` lines of the log across its files (None: as much as `max_bytes` allows),
    and never more than `max_bytes` of them: whole lines where they fit. `end`: read the current
    file only that far (where a `follow` then starts)."""
    wanted = MAX_TAIL_LINES if lines is None else min(lines, MAX_TAIL_LINES)
    if wanted == 0:
        return b""
    kept, cut_short = b"", False
    for file in reversed(files_of(path, limits)):  # newest first, until enough is read
        room = max_bytes - len(kept)
        try:
            with open(file, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                if file == path and end is not None:
                    size = min(size, end)
                f.seek(max(0, size - room))
                kept = f.read(room) + kept
                cut_short = size > room
        except FileNotFoundError:
            continue  # rotated away while being read: its bytes are in the next older name
        if kept.count(b"\n") > wanted or len(kept) >= max_bytes:
            break
    lines_kept = kept.splitlines(keepends=True)
    if cut_short and len(lines_kept) > 1:
        lines_kept = lines_kept[1:]  # the oldest line read was cut by the byte bound
    return b"".join(lines_kept[-wanted:])


def follow(
    path: Path,
    *,
    since: int,
    running: Callable[[], bool],
    deadline_s: float,
    poll_s: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[bytes]:
    """What the log at `path` gains after byte `since` of its current file, piece by piece, until
    the workload is no longer `running` (and all it wrote is handed over) or `deadline_s` passed.
    A rotation is followed as `tail -F` follows it: the file open before it is read to its end
    first (its descriptor still reads the renamed file), then the new one from its start."""
    end = clock() + deadline_s
    current = _open(path)
    if current is not None:
        current.seek(since)
    try:
        while clock() < end:
            if current is None:
                current = _open(path)
            data = current.read(READ_CHUNK) if current is not None else b""
            if data:
                yield data
                continue
            if current is not None and _replaced(path, current):
                current.close()
                current = _open(path)
                continue
            if not running():
                rest = current.read() if current is not None else b""
                if rest:
                    yield rest
                return
            sleep(poll_s)
    finally:
        if current is not None:
            current.close()


def _open(path: Path):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        return None


def _replaced(path: Path, current) -> bool:
    try:
        return os.stat(path).st_ino != os.fstat(current.fileno()).st_ino
    except FileNotFoundError:
        return False


def size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="copy standard input to a rotated log (a workload's output)")
    parser.add_argument("path", type=Path)
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    parser.add_argument("--files", type=int, default=DEFAULT_FILES)
    args = parser.parse_args(argv)
    pump(sys.stdin.fileno(), args.path, LogLimits(max_bytes=args.max_bytes, files=args.files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
