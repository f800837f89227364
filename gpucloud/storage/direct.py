"""File I/O with direct I/O where the file system allows it: a pull's writes, the local store's
chunk writes and its reads.

Weights are written once and read back rarely, gigabytes at a time. Through the page cache each
byte is copied once more into memory the kernel must first find and fill: on a machine whose
memory was not written lately that is more kernel time than receiving and hashing together (4 GiB
written cold took 9 s of system time, against 0.2-0.4 s with direct I/O at 1.5-1.6 GB/s; reading
chunks back through the page cache cost 2 s of system time per GiB, see docs/registry.md "Known
limits"), and the cached copy pushes out pages that are used. With `O_DIRECT` the disk reads the
bytes from a buffer of ours, or writes them into one. Object stores built for large objects do
the same (MinIO writes with O_DIRECT).

Direct I/O wants the buffer, the file offset and the length aligned to the device's block. The
aligned buffers (`STAGE` bytes each) come from a pool, so the memory is written again and again
rather than fresh. `RangeWriter` writes the block-aligned interior of a range of a file that way,
and the partial blocks at either end (which neighbouring ranges share) through the page cache:
the two kinds never touch the same block. `AppendWriter` writes a new file from its start, its
length unknown until the end, the partial last block through the page cache. `direct_pieces`
reads a file. A file system that refuses `O_DIRECT` (tmpfs, some network file systems) gets every
byte through the page cache; either way the caller's fsync makes a written file durable.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

BLOCK = 4096  # a multiple of every logical block size in use (512 or 4096)
STAGE = 1 << 20  # the aligned buffer a writer fills before a direct write, and a direct read's size

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # Linux and a few others
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)  # what a file system without direct I/O answers


class AlignedPool:
    """Page-aligned buffers of `size` bytes (anonymous mappings), at most `keep` of them idle: a
    writer or reader holds one from its first direct I/O to its end, whichever threads run it.
    Reused, their memory stays written (fresh pages cost this kind of machine dearly)."""

    def __init__(self, size: int, keep: int) -> None:
        self._size, self._keep = size, keep
        self._idle: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self) -> memoryview:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return memoryview(mmap.mmap(-1, self._size))

    def give(self, buffer: memoryview) -> None:
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(buffer)


_BUFFERS = AlignedPool(STAGE, keep=16)


def open_direct(path: str | Path) -> int | None:
    """A write descriptor on `path` that bypasses the page cache, or None where that is refused."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, os.O_WRONLY | _O_DIRECT)
    except OSError as exc:
        if exc.errno in _REFUSED:
            return None
        raise


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pwrite_direct(fd: int, data: memoryview, offset: int) -> int:
    """Write block-aligned `data` at `offset` with direct I/O; the offset after it."""
    while data:
        written = os.pwrite(fd, data, offset)
        if written % BLOCK:  # direct I/O cannot go on from an unaligned point
            raise OSError(errno.EIO, f"direct write of {len(data)} bytes at {offset} wrote {written}")
        data, offset = data[written:], offset + written
    return offset


class _Staged:
    """A writer's aligned buffer, taken from the pool on first use and given back by `release`,
    and its block-aligned writes: direct, or through the page cache where the device refuses
    them (a logical block larger than `BLOCK`), from then on."""

    _buffer: memoryview | None = None
    fd: int
    direct_fd: int | None

    def _write_aligned(self, data: memoryview, offset: int) -> int:
        """Write `data` at `offset`; the offset after it."""
        if self.direct_fd is not None:
            try:
                return _pwrite_direct(self.direct_fd, data, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct_fd = None  # the same bytes again, the ordinary way
        self._pwrite_buffered(data, offset)
        return offset + len(data)

    def _pwrite_buffered(self, data: memoryview, offset: int) -> None:
        pwrite_all(self.fd, data, offset)

    def _stage(self) -> memoryview:
        if self._buffer is None:
            self._buffer = _BUFFERS.take()
        return self._buffer

    def release(self) -> None:
        """Give the buffer back (after the last write; calling it again does nothing)."""
        if self._buffer is not None:
            _BUFFERS.give(self._buffer)
            self._buffer = None


class RangeWriter(_Staged):
    """Writes bytes [offset, offset + size) of a file, in order, as they arrive.

    `fd` is an ordinary write descriptor on the file, `direct_fd` one from `open_direct` (or
    None); buffered writes take `lock`, so threads writing other ranges of the same file wait on
    it asleep instead of spinning on the inode's lock in the kernel. Call `finish` after the last
    byte, and `release` in the end (`range_writer` does); bytes past the range are refused.
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
                stage = self._stage()
                stage[self.staged : self.staged + n] = view[:n]
                self.staged += n
                if self.staged == STAGE or self.pos + n == self.interior_end:
                    self._write_stage(stage)
            else:
                limit = self.interior_start if self.pos < self.interior_start else self.end
                n = min(len(view), limit - self.pos)
                self._pwrite_buffered(view[:n], self.pos)
            self.pos += n
            view = view[n:]

    def _pwrite_buffered(self, data: memoryview, offset: int) -> None:
        # Under the lock, the interior too once the device has refused direct writes.
        with self.lock:
            pwrite_all(self.fd, data, offset)

    def finish(self) -> None:
        if self.pos != self.end:
            raise ValueError(f"range ends at {self.end}, written up to {self.pos}")

    def _write_stage(self, stage: memoryview) -> None:
        direct = self.direct_fd is not None
        end = self._write_aligned(stage[: self.staged], self.stage_at)
        if direct and self.direct_fd is not None:
            self.direct_bytes += end - self.stage_at
        self.stage_at, self.staged = end, 0


@contextlib.contextmanager
def range_writer(path: str | Path, offset: int, size: int, lock: threading.Lock):
    """A `RangeWriter` on `path` with its descriptors opened, closed again on the way out."""
    fd = os.open(path, os.O_WRONLY)
    with _staged_on(fd, path, lambda fd, direct_fd: RangeWriter(fd, direct_fd, offset, size, lock)) as writer:
        yield writer


_W = TypeVar("_W", bound="_Staged")


@contextlib.contextmanager
def _staged_on(fd: int, path: str | Path, make: Callable[[int, int | None], _W]) -> Iterator[_W]:
    """`make(fd, direct_fd)`, with a direct descriptor opened on `path` where allowed; on the way
    out, whatever fails (opening included), the writer's stage is released and both descriptors
    are closed."""
    direct_fd: int | None = None
    writer: _W | None = None
    try:
        direct_fd = open_direct(path)
        writer = make(fd, direct_fd)
        yield writer
    finally:
        if writer is not None:
            writer.release()
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)


class AppendWriter(_Staged):
    """Writes a new file from its start, in order, as bytes arrive, its length unknown until
    `close`: every whole `STAGE` with direct I/O from an aligned buffer, then at `close` the
    remaining whole blocks the same way and the partial last block through the page cache.
    `fd` is an ordinary write descriptor on the file, `direct_fd` one from `open_direct` (or None:
    every byte through `fd`). The caller fsyncs (either descriptor) once `close` returns, and calls
    `release` if it gives up before `close`."""

    def __init__(self, fd: int, direct_fd: int | None) -> None:
        self.fd, self.direct_fd = fd, direct_fd
        self.pos = 0  # bytes written to the file
        self.staged = 0  # bytes waiting in the stage, to be written at `pos`
        self.direct_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.direct_fd is None and not self.staged:
            pwrite_all(self.fd, view, self.pos)
            self.pos += len(view)
            return
        if not self.staged and len(view) >= BLOCK and is_aligned(view):
            # Already in an aligned buffer (an `AlignedPool`'s): its whole blocks go straight from
            # there, in one system call and without a copy.
            whole = len(view) // BLOCK * BLOCK
            direct = self.direct_fd is not None
            self.pos = self._write_aligned(view[:whole], self.pos)
            if direct and self.direct_fd is not None:
                self.direct_bytes += whole
            view = view[whole:]
            if not view:
                return
        stage = self._stage()
        while view:
            n = min(len(view), STAGE - self.staged)
            stage[self.staged : self.staged + n] = view[:n]
            self.staged += n
            view = view[n:]
            if self.staged == STAGE:
                self._flush(STAGE)

    def close(self) -> int:
        """Write what is staged and give the buffer back; the file's length."""
        if self.staged:
            aligned = self.staged // BLOCK * BLOCK
            if aligned:
                self._flush(aligned)
            if self.staged:
                pwrite_all(self.fd, self._stage()[: self.staged], self.pos)
                self.pos, self.staged = self.pos + self.staged, 0
        self.release()
        return self.pos

    def _flush(self, count: int) -> None:
        stage = self._stage()
        self.pos = self._write_aligned(stage[:count], self.pos)
        if self.direct_fd is not None:
            self.direct_bytes += count
        rest = self.staged - count
        if rest:  # keep the unaligned remainder at the stage's start
            stage[:rest] = stage[count : self.staged]
        self.staged = rest


def is_aligned(view: memoryview) -> bool:
    """Whether the buffer starts on a `BLOCK` boundary in memory (only a writable one can tell)."""
    if view.readonly or not view.c_contiguous or not len(view):
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % BLOCK == 0


def write_durably(
    fd: int, path: str | Path, pieces: Iterable[bytes | memoryview], *, check: Callable[[], None] | None = None
) -> int:
    """Write `pieces` into the new, empty file at `path` open as `fd` (whole blocks with direct I/O
    where allowed, see `AppendWriter`), run `check` after the last piece, fsync, and close every
    descriptor whatever happens; the file's length."""
    with _staged_on(fd, path, AppendWriter) as writer:
        for piece in pieces:
            writer.write(piece)
        length = writer.close()
        if check is not None:
            check()
        os.fsync(fd)
        return length


def direct_pieces(path: str | Path) -> Iterator[bytes] | None:
    """The file's bytes in pieces of up to `STAGE`, read with direct I/O into an aligned buffer
    and copied out (into memory the process reuses: a page-cache read would first have the kernel
    find and fill fresh pages), or None where the file system refuses O_DIRECT. The file is opened
    now, once: a missing one raises `FileNotFoundError` here, and one deleted meanwhile is still
    read to its end."""
    if not _O_DIRECT:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECT)
    except OSError as exc:
        if exc.errno in _REFUSED:
            return None
        raise
    f = os.fdopen(fd, "rb", buffering=0)  # closed by the iterator, or when dropped unstarted

    def pieces() -> Iterator[bytes]:
        with f:
            buffer = _BUFFERS.take()
            try:
                while True:
                    try:
                        count = f.readinto(buffer)
                    except OSError as exc:
                        if exc.errno not in _REFUSED:
                            raise
                        count = None  # the device wants more alignment than `BLOCK`
                    if count is not None and count % BLOCK == 0:
                        if not count:
                            return
                        yield bytes(buffer[:count])
                        continue
                    if count:
                        yield bytes(buffer[:count])
                    # The end of a file reads short of a block; the rest, if any, and what the
                    # device refused to read direct, are read through the page cache from here on.
                    descriptor = f.fileno()
                    fcntl.fcntl(descriptor, fcntl.F_SETFL, fcntl.fcntl(descriptor, fcntl.F_GETFL) & ~_O_DIRECT)
                    while piece := f.read(STAGE):
                        yield piece
                    return
            finally:
                _BUFFERS.give(buffer)

    return pieces()
