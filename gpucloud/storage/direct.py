"""Write a byte range of a file with direct I/O where the file system allows it.

A pull writes gigabytes it has just hashed and will not read again. Through the page cache each
byte is copied once more into memory the kernel must first find and fill (on a machine whose
memory was not written lately, more kernel time than receiving and hashing together: 4 GiB
written cold took 9 s of system time, against 0.2-0.4 s with direct I/O at 1.5-1.6 GB/s, see
docs/registry.md "Known limits"), and then written back at the final fsync. With `O_DIRECT` the
disk reads the bytes from a buffer of ours.

Direct I/O wants the buffer, the file offset and the length aligned to the device's block.
`RangeWriter` writes the block-aligned interior of its range that way from an aligned buffer it
fills as bytes arrive, and the partial blocks at either end (which neighbouring ranges share)
through the page cache: the two kinds never touch the same block. A file system that refuses
`O_DIRECT` (tmpfs, some network file systems) gets every byte through the page cache; either way
the caller's fsync makes the file durable.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from pathlib import Path

BLOCK = 4096  # a multiple of every logical block size in use (512 or 4096)
STAGE = 1 << 20  # the aligned buffer each thread fills before a direct write

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # Linux and a few others
_stages = threading.local()


def open_direct(path: str | Path) -> int | None:
    """A write descriptor on `path` that bypasses the page cache, or None where that is refused."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, os.O_WRONLY | _O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class RangeWriter:
    """Writes bytes [offset, offset + size) of a file, in order, as they arrive.

    `fd` is an ordinary write descriptor on the file, `direct_fd` one from `open_direct` (or
    None); buffered writes take `lock`, so threads writing other ranges of the same file wait on
    it asleep instead of spinning on the inode's lock in the kernel. Call `finish` after the last
    byte; bytes past the range are refused.
    """

    def __init__(self, fd: int, direct_fd: int | None, offset: int, size: int, lock: threading.Lock) -> None:
        self.fd, self.direct_fd, self.lock = fd, direct_fd, lock
        self.pos, self.end = offset, offset + size
        self.interior_start = -(-offset // BLOCK) * BLOCK
        self.interior_end = (self.end // BLOCK) * BLOCK
        if direct_fd is None or self.interior_start >= self.interior_end:
            self.interior_start = self.interior_end = self.end  # all of it buffered
        self.stage_at, self.staged = self.interior_start, 0
        self.direct_bytes = 0  # written with direct I/O so far

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        if len(view) > self.end - self.pos:
            raise ValueError(f"{len(view)} bytes at {self.pos} run past the range's end at {self.end}")
        while view:
            if self.interior_start <= self.pos < self.interior_end:
                n = min(len(view), self.interior_end - self.pos, STAGE - self.staged)
                stage = _stage()
                stage[self.staged : self.staged + n] = view[:n]
                self.staged += n
                if self.staged == STAGE or self.pos + n == self.interior_end:
                    self._write_stage(stage)
            else:
                limit = self.interior_start if self.pos < self.interior_start else self.end
                n = min(len(view), limit - self.pos)
                with self.lock:
                    pwrite_all(self.fd, view[:n], self.pos)
            self.pos += n
            view = view[n:]

    def finish(self) -> None:
        if self.pos != self.end:
            raise ValueError(f"range ends at {self.end}, written up to {self.pos}")

    def _write_stage(self, stage: memoryview) -> None:
        assert self.direct_fd is not None
        offset, view = self.stage_at, stage[: self.staged]
        while view:
            written = os.pwrite(self.direct_fd, view, offset)
            if written % BLOCK:  # direct I/O cannot go on from an unaligned point
                raise OSError(errno.EIO, f"direct write of {len(view)} bytes at {offset} wrote {written}")
            view, offset = view[written:], offset + written
        self.direct_bytes += offset - self.stage_at
        self.stage_at, self.staged = offset, 0


def _stage() -> memoryview:
    """This thread's aligned buffer (an anonymous mapping: page-aligned), made once and reused."""
    stage = getattr(_stages, "view", None)
    if stage is None:
        stage = _stages.view = memoryview(mmap.mmap(-1, STAGE))
    return stage


@contextlib.contextmanager
def range_writer(path: str | Path, offset: int, size: int, lock: threading.Lock):
    """A `RangeWriter` on `path` with its descriptors opened, closed again on the way out."""
    fd = os.open(path, os.O_WRONLY)
    direct_fd = None
    try:
        direct_fd = open_direct(path)
        yield RangeWriter(fd, direct_fd, offset, size, lock)
    finally:
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)
