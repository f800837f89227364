"""Following the kernel log for the signal sampler (`agent/signals.py`): PCIe AER, NVRM and NIC
lines arrive here, not through NVML.

`KernelLog` reads `/dev/kmsg` without blocking: each `read()` there returns one record,
`<priority>,<sequence>,<microseconds since boot>,<flags>;<message>`, followed by continuation
lines (` KEY=value`) that are skipped; `EAGAIN` means nothing new, `EPIPE` that records were
overwritten before they were read (the loss is logged, reading goes on). It starts at the end of
the buffer: what the kernel logged before the agent started was reported by the agent that ran
then, or by the burn-in the node passed since.

A record's time is the kernel's clock since boot (the monotonic one): it is turned into wall time
with the boot instant read once (`time.time() - time.monotonic()`, within a few milliseconds).

A kernel log the agent may not read (no CAP_SYSLOG, a container without it) is logged once and
reads as empty: the InfiniBand sampling goes on without it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from datetime import UTC, datetime
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PATH = Path("/dev/kmsg")
# A record is at most about 1 KiB (the kernel's LOG_LINE_MAX); a regular file (tests, a replayed
# log) is read in chunks of this size and split into lines.
_READ_SIZE = 8192
# At most this many lines per call: a flood (a tenant writing to /dev/kmsg as root) must not hold
# the reporting loop; the rest is read on the next call.
MAX_LINES_PER_CALL = 10_000


class KernelLog:
    """A non-blocking follower of one kernel log; call it for the `(time, line)` pairs since the
    last call."""

    def __init__(self, path: Path = DEFAULT_PATH, *, from_start: bool = False) -> None:
        self.path = path
        self._fd: int | None = None
        self._partial = b""
        self._boot = time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)
        self._from_start = from_start
        self._failed = False
        self.lost = 0  # records overwritten before they were read

    def _open(self) -> int | None:
        if self._fd is not None or self._failed:
            return self._fd
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            self._failed = True
            log.warning(
                "the kernel log %s cannot be read (%s): PCIe AER, NVRM and NIC lines are not followed", self.path, exc
            )
            return None
        if not self._from_start:
            with contextlib.suppress(OSError):  # a pipe cannot seek: it starts where it is
                os.lseek(fd, 0, os.SEEK_END)
        self._fd = fd
        return fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __call__(self) -> list[tuple[datetime, str]]:
        fd = self._open()
        if fd is None:
            return []
        lines: list[tuple[datetime, str]] = []
        while len(lines) < MAX_LINES_PER_CALL:
            try:
                chunk = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                break  # nothing new
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    self.lost += 1
                    log.warning("kernel log records were overwritten before they were read")
                    continue
                if exc.errno == errno.EINVAL:  # a record longer than the buffer: skip it
                    continue
                raise
            if not chunk:
                break  # a regular file's end
            data = self._partial + chunk
            *complete, self._partial = data.split(b"\n")
            for raw in complete:
                parsed = self._record(raw)
                if parsed is not None:
                    lines.append(parsed)
        return lines

    def _record(self, raw: bytes) -> tuple[datetime, str] | None:
        if not raw or raw[:1] == b" ":
            return None  # a continuation line (` SUBSYSTEM=pci`), or nothing
        head, sep, message = raw.partition(b";")
        if not sep:
            return None
        fields = head.split(b",")
        try:
            since_boot_us = int(fields[2])
        except (IndexError, ValueError):
            return None
        at = datetime.fromtimestamp(self._boot + since_boot_us / 1e6, tz=UTC)
        return at, message.decode("utf-8", errors="replace")
