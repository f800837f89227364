"""`RangeWriter`: ranges of one file written from many threads, the block-aligned interiors with
direct I/O and the shared partial blocks through the page cache, land byte for byte. `AppendWriter`:
a new file written from its start in pieces of any size, whole blocks direct and the last partial
one buffered, lands byte for byte."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpucloud.storage.direct import (
    BLOCK,
    STAGE,
    AlignedPool,
    AppendWriter,
    RangeWriter,
    direct_pieces,
    is_aligned,
    open_direct,
    range_writer,
)

pytestmark = pytest.mark.unit

# Boundaries off the block grid, on it, ranges shorter than a block, one spanning several stages.
SIZES = [100, BLOCK - 1, 1, 3 * BLOCK, 2 * STAGE + 12345, 7, BLOCK + 1, STAGE, 5000, 2 * BLOCK - 3]


def ranges() -> list[tuple[int, int]]:
    offset, out = 0, []
    for size in SIZES:
        out.append((offset, size))
        offset += size
    return out


def write_file(path: Path, source: bytes, *, direct: bool) -> int:
    with open(path, "xb") as f:
        f.truncate(len(source))
    lock, rng = threading.Lock(), random.Random(7)
    plans = [(offset, size, rng.randrange(1, 300_000)) for offset, size in ranges()]

    def one(plan: tuple[int, int, int]) -> int:
        offset, size, piece = plan
        fd = os.open(path, os.O_WRONLY)
        direct_fd = open_direct(path) if direct else None
        try:
            writer = RangeWriter(fd, direct_fd, offset, size, lock)
            for at in range(offset, offset + size, piece):
                writer.write(memoryview(source)[at : min(at + piece, offset + size)])
            writer.finish()
            return writer.direct_bytes
        finally:
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)

    with ThreadPoolExecutor(4) as pool:
        direct_bytes = sum(pool.map(one, plans))
    return direct_bytes


@pytest.mark.parametrize("direct", [True, False])
def test_ranges_written_from_threads_land_byte_for_byte(tmp_path: Path, direct: bool) -> None:
    source = random.Random(1).randbytes(sum(SIZES))
    probe = tmp_path / "probe"
    probe.touch()
    descriptor = open_direct(probe)
    if direct and descriptor is None:
        pytest.skip("this file system refuses O_DIRECT")
    if descriptor is not None:
        os.close(descriptor)
    target = tmp_path / "model.bin"
    direct_bytes = write_file(target, source, direct=direct)
    assert target.read_bytes() == source
    if direct:
        # Every whole block inside a range went the direct way; only the partial ones did not.
        interiors = sum(max(0, (o + s) // BLOCK * BLOCK - -(-o // BLOCK) * BLOCK) for o, s in ranges())
        assert direct_bytes == interiors > 0
    else:
        assert direct_bytes == 0


def test_a_range_refuses_bytes_past_its_end_and_a_short_finish(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(bytes(3 * BLOCK))
    with range_writer(target, 10, BLOCK, threading.Lock()) as writer:
        writer.write(b"x" * 100)
        with pytest.raises(ValueError, match="run past"):
            writer.write(b"y" * BLOCK)
        with pytest.raises(ValueError, match="written up to 110"):
            writer.finish()
        writer.write(b"z" * (BLOCK - 100))
        writer.finish()
    data = target.read_bytes()
    assert data[10:110] == b"x" * 100 and data[110 : 10 + BLOCK] == b"z" * (BLOCK - 100)
    assert data[:10] == bytes(10) and data[10 + BLOCK :] == bytes(2 * BLOCK - 10)


def direct_refused(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.touch()
    descriptor = open_direct(probe)
    if descriptor is None:
        return True
    os.close(descriptor)
    return False


# Empty, under a block, one block, a block and a byte, a stage exactly, stages and an odd tail.
LENGTHS = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, STAGE, STAGE + BLOCK, 3 * STAGE + 12345]


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("length", LENGTHS)
def test_an_appended_file_lands_byte_for_byte(tmp_path: Path, direct: bool, length: int) -> None:
    if direct and direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = random.Random(length).randbytes(length)
    target = tmp_path / "chunk"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    direct_fd = open_direct(target) if direct else None
    rng = random.Random(3)
    try:
        writer = AppendWriter(fd, direct_fd)
        at = 0
        while at < length:  # pieces of every size, some larger than the stage
            piece = rng.choice([1, 17, BLOCK, STAGE - 5, STAGE + 3, 2 * STAGE + 1])
            writer.write(bytearray(source[at : at + piece]))
            at += piece
        assert writer.close() == length
    finally:
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)
    assert target.read_bytes() == source
    # Every whole block went the direct way (when it could); only the last partial one did not.
    assert writer.direct_bytes == (length // BLOCK * BLOCK if direct else 0)


@pytest.mark.parametrize("length", LENGTHS)
def test_a_file_read_direct_comes_back_whole_in_bounded_pieces(tmp_path: Path, length: int) -> None:
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = random.Random(length).randbytes(length)
    target = tmp_path / "chunk"
    target.write_bytes(source)
    pieces = direct_pieces(target)
    assert pieces is not None
    got = list(pieces)
    assert b"".join(got) == source
    assert all(0 < len(piece) <= STAGE for piece in got)
    assert len(got) == -(-length // STAGE)


def test_a_direct_read_of_a_missing_file_fails_before_it_starts(tmp_path: Path) -> None:
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    with pytest.raises(FileNotFoundError):
        direct_pieces(tmp_path / "absent")


def test_readers_and_writers_leave_no_descriptor_open(tmp_path: Path) -> None:
    """A reader dropped before it starts or half-way, and a writer that gave up, close their files."""
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    target = tmp_path / "chunk"
    target.write_bytes(bytes(3 * STAGE))
    before = len(os.listdir("/proc/self/fd"))
    unstarted = direct_pieces(target)
    half = direct_pieces(target)
    assert half is not None and len(next(half)) == STAGE
    del unstarted
    half.close()
    with range_writer(target, 5, 2 * STAGE, threading.Lock()) as writer:
        writer.write(bytes(STAGE))  # gives up before the end of its range
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_device_that_refuses_a_direct_write_gets_the_bytes_the_ordinary_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logical block larger than `BLOCK` makes a direct write fail with EINVAL: the same bytes
    go through the page cache, then and from then on."""
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = random.Random(9).randbytes(3 * STAGE + 77)
    target = tmp_path / "chunk"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    direct_fd = open_direct(target)
    assert direct_fd is not None
    real_pwrite, refused = os.pwrite, []

    def pwrite(descriptor: int, data, offset: int) -> int:
        if descriptor == direct_fd and offset >= STAGE:  # the first stage goes through, then no more
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(descriptor, data, offset)

    monkeypatch.setattr("gpucloud.storage.direct.os.pwrite", pwrite)
    try:
        writer = AppendWriter(fd, direct_fd)
        for at in range(0, len(source), 300_001):
            writer.write(source[at : at + 300_001])
        assert writer.close() == len(source)
    finally:
        os.close(fd)
        os.close(direct_fd)
    assert target.read_bytes() == source
    assert refused == [STAGE] and writer.direct_bytes == STAGE and writer.direct_fd is None


def test_a_device_that_refuses_a_direct_read_is_read_the_ordinary_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = random.Random(4).randbytes(3 * STAGE + 5)
    target = tmp_path / "chunk"
    target.write_bytes(source)
    real_fdopen = os.fdopen

    class Refusing:
        """The direct descriptor's file: its second read is refused as a misaligned one."""

        def __init__(self, f) -> None:
            self.f, self.reads = f, 0

        def readinto(self, buffer) -> int:
            self.reads += 1
            if self.reads == 2:
                raise OSError(errno.EINVAL, "Invalid argument")
            return self.f.readinto(buffer)

        def fileno(self) -> int:
            return self.f.fileno()

        def read(self, size: int) -> bytes:
            return self.f.read(size)

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    monkeypatch.setattr("gpucloud.storage.direct.os.fdopen", lambda *a, **k: Refusing(real_fdopen(*a, **k)))
    pieces = direct_pieces(target)
    assert pieces is not None
    got = list(pieces)
    assert b"".join(got) == source and len(got[0]) == STAGE


@pytest.mark.parametrize("direct", [True, False])
def test_pieces_in_an_aligned_buffer_are_written_from_it(tmp_path: Path, direct: bool) -> None:
    """A piece that starts on a block in memory (an `AlignedPool` buffer, as an upload's batches
    are) has its whole blocks written from where it is; anything else goes through the stage."""
    if direct and direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    buffer = AlignedPool(4 * STAGE, keep=1).take()
    assert is_aligned(buffer) and not is_aligned(buffer[1:]) and not is_aligned(memoryview(bytes(BLOCK)))
    sizes = [4 * STAGE, STAGE + 100, 5000, 2 * BLOCK]  # the third is plain bytes, the rest from the buffer
    source = random.Random(11).randbytes(sum(sizes))
    target = tmp_path / "chunk"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    direct_fd = open_direct(target) if direct else None
    writer = AppendWriter(fd, direct_fd)
    try:
        at = 0
        for i, size in enumerate(sizes):
            if i == 2:
                writer.write(source[at : at + size])
            else:
                buffer[:size] = source[at : at + size]
                writer.write(buffer[:size])
            if i == 0:
                assert writer._buffer is None  # no stage taken: nothing was copied
            at += size
        assert writer.close() == len(source)
    finally:
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)
    assert target.read_bytes() == source
    assert writer.direct_bytes == (len(source) // BLOCK * BLOCK if direct else 0)


def test_a_file_deleted_while_it_is_read_direct_is_read_to_its_end(tmp_path: Path) -> None:
    """Garbage collection may delete a chunk while it is served: the open file still reads whole,
    its last partial block included (no second open by path)."""
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = random.Random(5).randbytes(3 * STAGE + 5)
    target = tmp_path / "chunk"
    target.write_bytes(source)
    pieces = direct_pieces(target)
    assert pieces is not None
    first = next(pieces)
    target.unlink()
    assert first + b"".join(pieces) == source


def test_a_store_write_that_cannot_start_closes_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucloud.storage.local import LocalObjectStore

    store = LocalObjectStore(tmp_path / "objects")

    def refuse(path):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("gpucloud.storage.direct.open_direct", refuse)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(OSError, match="Too many open files"):
            store.put("a/b", b"x" * 10)
    assert len(os.listdir("/proc/self/fd")) == before
    assert not list((tmp_path / "objects" / "tmp").iterdir())


def test_a_range_the_device_refuses_to_write_direct_is_written_under_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a direct write is refused, a range's interior goes through the page cache like its
    partial blocks, and like them under the file's lock (threads writing other ranges wait
    asleep, not on the inode's lock in the kernel)."""
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = random.Random(3).randbytes(2 * STAGE + 3 * BLOCK)
    target = tmp_path / "model.bin"
    with open(target, "xb") as f:
        f.truncate(len(source))
    lock = threading.Lock()
    real_pwrite, buffered = os.pwrite, []
    with range_writer(target, 5, len(source) - 5, lock) as writer:
        direct_fd = writer.direct_fd

        def pwrite(descriptor: int, data, offset: int) -> int:
            if descriptor == direct_fd:
                raise OSError(errno.EINVAL, "Invalid argument")
            buffered.append((offset, len(data), lock.locked()))
            return real_pwrite(descriptor, data, offset)

        monkeypatch.setattr("gpucloud.storage.direct.os.pwrite", pwrite)
        writer.write(memoryview(source)[5:])
        writer.finish()
    assert target.read_bytes()[5:] == source[5:]
    assert writer.direct_bytes == 0 and writer.direct_fd is None
    assert sum(size for _, size, _ in buffered) == len(source) - 5
    assert any(size >= BLOCK for _, size, _ in buffered)  # the interior, not only the edges
    assert all(held for _, _, held in buffered), buffered


def _open_flags(path: Path) -> list[int]:
    """The status flags of this process's descriptors open on `path` (from /proc)."""
    flags = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == str(path):
                for line in Path(f"/proc/self/fdinfo/{name}").read_text().splitlines():
                    if line.startswith("flags:"):
                        flags.append(int(line.split()[1], 8))
    return flags


def test_a_direct_read_bypasses_the_page_cache(tmp_path: Path) -> None:
    """The file is read on a descriptor open with O_DIRECT, its short tail included."""
    if direct_refused(tmp_path) or not hasattr(os, "O_DIRECT") or not Path("/proc/self/fdinfo").exists():
        pytest.skip("no O_DIRECT here, or no /proc to read a descriptor's flags from")
    target = tmp_path / "chunk"
    target.write_bytes(random.Random(5).randbytes(2 * STAGE + 5))
    pieces = direct_pieces(target)
    assert pieces is not None
    assert len(next(pieces)) == STAGE
    assert [bool(flags & os.O_DIRECT) for flags in _open_flags(target)] == [True]
    assert len(next(pieces)) == STAGE
    assert next(pieces) == target.read_bytes()[2 * STAGE :]
    assert [bool(flags & os.O_DIRECT) for flags in _open_flags(target)] == [True]
    assert next(pieces, None) is None
    assert _open_flags(target) == []
