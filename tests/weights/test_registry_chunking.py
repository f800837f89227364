"""Chunking: tensor-aligned cuts, stable ids across versions, bounded reads, header edge cases."""

from __future__ import annotations

import io
import json
import os
import struct
import tracemalloc
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.registry.chunking import (
    ChunkPolicy,
    SafetensorsFormatError,
    Span,
    chunk_file,
    chunk_stream,
    encode_safetensors_header,
    plan_safetensors,
)

pytestmark = pytest.mark.unit

POLICY = ChunkPolicy(max_chunk_size=4096, pack_size=1024, fixed_chunk_size=4096, read_size=1000)


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> int:
    """Write the file; return where the header ends (where tensor data starts)."""
    header = encode_safetensors_header((name, len(data)) for name, data in tensors.items())
    path.write_bytes(header + b"".join(tensors.values()))
    return len(header)


def tensor_spans(header_end: int, tensors: dict[str, bytes]) -> dict[str, Span]:
    spans, offset = {}, header_end
    for name, data in tensors.items():
        spans[name] = Span(offset, len(data))
        offset += len(data)
    return spans


def test_header_is_one_chunk_big_tensors_own_chunks_small_ones_packed(tmp_path: Path) -> None:
    tensors = {
        "big": os.urandom(5000),
        "norm1": os.urandom(300),
        "norm2": os.urandom(200),
        "mid": os.urandom(1500),
        "empty": b"",
        "norm3": os.urandom(1000),
    }
    path = tmp_path / "m.safetensors"
    header_end = write_safetensors(path, tensors)
    spans = tensor_spans(header_end, tensors)

    entry = chunk_file(path, policy=POLICY)

    layout = [(c.offset, c.size) for c in entry.chunks]
    assert layout == [
        (0, header_end),
        (spans["big"].offset, 4096),
        (spans["big"].offset + 4096, 904),
        (spans["norm1"].offset, 500),  # norm1 + norm2 packed
        (spans["mid"].offset, 1500),
        (spans["norm3"].offset, 1000),
    ]
    data = path.read_bytes()
    for chunk in entry.chunks:
        assert chunk.id == blake3.blake3(data[chunk.offset : chunk.offset + chunk.size]).hexdigest()


def test_tensor_larger_than_max_chunk_is_split_from_its_start(tmp_path: Path) -> None:
    tensors = {"small": os.urandom(10), "huge": os.urandom(3 * 4096 + 17)}
    path = tmp_path / "m.safetensors"
    header_end = write_safetensors(path, tensors)
    huge = tensor_spans(header_end, tensors)["huge"]

    chunks = chunk_file(path, policy=POLICY).chunks

    pieces = [(c.offset - huge.offset, c.size) for c in chunks if c.offset >= huge.offset]
    assert pieces == [(0, 4096), (4096, 4096), (8192, 4096), (12288, 17)]
    assert all(c.size <= POLICY.max_chunk_size for c in chunks)


def test_changing_one_tensor_changes_only_its_chunks(tmp_path: Path) -> None:
    tensors = {f"t{i}": os.urandom(size) for i, size in enumerate([6000, 200, 3000, 9000, 100])}
    header_end = write_safetensors(tmp_path / "v1.safetensors", tensors)
    tuned = dict(tensors, t3=os.urandom(9000))
    write_safetensors(tmp_path / "v2.safetensors", tuned)
    t3 = tensor_spans(header_end, tensors)["t3"]

    v1 = chunk_file(tmp_path / "v1.safetensors", policy=POLICY).chunks
    v2 = chunk_file(tmp_path / "v2.safetensors", policy=POLICY).chunks

    assert [(c.offset, c.size) for c in v1] == [(c.offset, c.size) for c in v2]
    changed = {c.offset for a, c in zip(v1, v2, strict=True) if a.id != c.id}
    assert changed == {c.offset for c in v2 if t3.offset <= c.offset < t3.end}
    assert len(changed) == 3


@pytest.mark.parametrize(
    ("size", "expected"),
    [(0, []), (1, [1]), (4095, [4095]), (4096, [4096]), (4097, [4096, 1]), (8192, [4096, 4096])],
)
def test_fixed_chunks_at_and_around_the_chunk_size(tmp_path: Path, size: int, expected: list[int]) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(size))

    entry = chunk_file(path, policy=POLICY)

    assert [c.size for c in entry.chunks] == expected
    assert entry.size == size


def test_safetensors_without_tensors_is_one_header_chunk(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    header_end = write_safetensors(path, {})
    assert [(c.offset, c.size) for c in chunk_file(path, policy=POLICY).chunks] == [(0, header_end)]


def test_padding_between_tensors_is_still_covered(tmp_path: Path) -> None:
    body = json.dumps({"a": {"dtype": "U8", "shape": [2000], "data_offsets": [100, 2100]}}).encode()
    path = tmp_path / "padded.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + os.urandom(2200))
    header_end = 8 + len(body)

    chunks = chunk_file(path, policy=POLICY).chunks

    assert [(c.offset, c.size) for c in chunks] == [
        (0, header_end),
        (header_end, 100),
        (header_end + 100, 2000),
        (header_end + 2100, 100),
    ]


def _header_file(body: bytes, data: bytes = b"", declared: int | None = None) -> bytes:
    return struct.pack("<Q", len(body) if declared is None else declared) + body + data


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x01\x00",
        _header_file(b"{}", declared=1000),
        _header_file(b"not json"),
        _header_file(b"[1, 2]"),
        _header_file(b'{"a": {"data_offsets": [0, 50]}}', b"x" * 10),
        _header_file(b'{"a": {"data_offsets": [5, 2]}}', b"x" * 10),
        _header_file(b'{"a": {"data_offsets": [0, 2.5]}}', b"x" * 10),
        _header_file(b'{"a": {"shape": [1]}}'),
    ],
    ids=[
        "empty",
        "short",
        "length-past-end",
        "not-json",
        "not-object",
        "past-end",
        "reversed",
        "float",
        "no-offsets",
    ],
)
def test_malformed_safetensors_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsFormatError):
        chunk_file(path, policy=POLICY)


class RecordingReader(io.RawIOBase):
    """A file wrapper that records the size of every read request."""

    def __init__(self, inner: io.RawIOBase) -> None:
        self.inner, self.requests = inner, []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def read(self, size: int = -1) -> bytes:
        self.requests.append(size)
        return self.inner.read(size)

    def readinto(self, buffer) -> int:
        self.requests.append(len(buffer))
        return self.inner.readinto(buffer)


@pytest.mark.parametrize("safetensors", [True, False])
def test_chunking_never_requests_more_than_the_read_size(tmp_path: Path, safetensors: bool) -> None:
    path = tmp_path / "m.safetensors"
    header_end = write_safetensors(path, {f"t{i}": os.urandom(7000) for i in range(20)})
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as raw:
        reader = RecordingReader(raw)
        entry = chunk_stream(reader, size, safetensors=safetensors, policy=POLICY)

    assert entry.size == size
    assert all(0 < request <= POLICY.read_size for request in reader.requests)
    header_reads = header_end if safetensors else 0
    assert sum(reader.requests) <= size + header_reads + POLICY.read_size


def test_chunking_memory_does_not_grow_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        for _ in range(16):
            f.write(os.urandom(1 << 20))
    policy = ChunkPolicy(fixed_chunk_size=4 << 20, max_chunk_size=4 << 20, read_size=64 << 10)

    tracemalloc.start()
    try:
        chunk_file(path, policy=policy)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 512 << 10  # a 16 MiB file hashed through a 64 KiB buffer


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=20_000), max_size=30),
    header_end=st.integers(min_value=8, max_value=9000),
    max_chunk=st.integers(min_value=1, max_value=5000),
    pack_fraction=st.floats(min_value=0, max_value=1),
)
def test_any_plan_tiles_the_file_and_respects_the_limits(
    sizes: list[int], header_end: int, max_chunk: int, pack_fraction: float
) -> None:
    policy = ChunkPolicy(max_chunk_size=max_chunk, pack_size=int(max_chunk * pack_fraction))
    tensors, offset = [], header_end
    for size in sizes:
        tensors.append(Span(offset, size))
        offset += size

    plan = plan_safetensors(header_end, tensors, offset, policy=policy)

    position = 0
    for span in plan:
        assert span.offset == position and 0 < span.size <= max_chunk
        position = span.end
    assert position == offset
    starts = {span.offset for span in plan}
    assert header_end in starts or header_end == offset
    for tensor in tensors:
        if tensor.size >= policy.pack_size and tensor.size:
            assert tensor.offset in starts and tensor.end in starts | {offset}
