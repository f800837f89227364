"""Cut files into content-addressed chunks, reading them in bounded buffers.

A safetensors file (8-byte little-endian header length, JSON header, tensor bytes) is cut at
tensor boundaries: the header is a chunk of its own, a tensor of at least `pack_size` bytes gets
its own chunks (pieces of at most `max_chunk_size`, counted from the tensor's start), and runs of
smaller tensors are packed together into chunks of at most `pack_size`. A fine-tune that rewrites
some tensors therefore changes only those tensors' chunks (and the pack a small tensor sits in);
every other tensor keeps its chunk ids, and versions of one model share them. Packing keeps a
model with thousands of tiny tensors (norms, biases) from becoming thousands of tiny objects; a
changed small tensor re-sends at most `pack_size` bytes. Other files are cut into fixed pieces.

A chunk id is the BLAKE3 hex digest of the chunk's bytes. Every read goes through one buffer of
`read_size` bytes, so memory stays constant whatever the file size; planning the cuts is pure
logic over the header (`plan_safetensors`, `plan_fixed`) and is tested without any file.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import blake3

from gpucloud.registry.manifest import ChunkRef, FileEntry

if TYPE_CHECKING:
    from typing_extensions import Buffer


class ReadableFile(Protocol):
    """What chunking reads a file through: an unbuffered binary file (`open(..., buffering=0)`)."""

    def read(self, size: int = -1, /) -> bytes | None: ...

    def readinto(self, buffer: Any, /) -> int | None: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...


MiB = 1 << 20
MAX_HEADER_SIZE = 100_000_000  # safetensors' own limit; a longer header is not a safetensors file
_THREADED_HASH_MIN = 1 * MiB  # below this, spreading one hash over threads costs more than it saves


class SafetensorsFormatError(ValueError):
    """A file named *.safetensors whose header cannot be parsed or points outside the file."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkPolicy:
    """Chunk size limits; tests pass small ones, production keeps the defaults."""

    max_chunk_size: int = 64 * MiB
    # Small tensors in real checkpoints are norms and biases of a few KiB: 1 MiB packs fold
    # hundreds of them into one object while a changed one re-sends little.
    pack_size: int = 1 * MiB
    fixed_chunk_size: int = 64 * MiB
    read_size: int = 8 * MiB

    def __post_init__(self) -> None:
        if min(self.max_chunk_size, self.fixed_chunk_size, self.read_size) < 1:
            raise ValueError("chunk and read sizes must be positive")
        if not 0 <= self.pack_size <= self.max_chunk_size:
            raise ValueError("pack_size must lie between 0 and max_chunk_size")


DEFAULT_POLICY = ChunkPolicy()


@dataclass(frozen=True, slots=True)
class Span:
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


def new_hasher(size_hint: int) -> blake3.blake3:
    """A BLAKE3 hasher that spreads large inputs over all cores."""
    threads = blake3.blake3.AUTO if size_hint >= _THREADED_HASH_MIN else 1
    return blake3.blake3(max_threads=threads)


def is_safetensors_path(path: str | Path) -> bool:
    return str(path).endswith(".safetensors")


def split_span(span: Span, max_size: int) -> list[Span]:
    """Pieces of at most max_size, counted from the span's start so they stay stable."""
    return [Span(offset, min(max_size, span.end - offset)) for offset in range(span.offset, span.end, max_size)]


def plan_fixed(file_size: int, *, chunk_size: int) -> list[Span]:
    return split_span(Span(0, file_size), chunk_size)


def plan_safetensors(header_end: int, tensors: Iterable[Span], file_size: int, *, policy: ChunkPolicy) -> list[Span]:
    """Cuts for a safetensors file whose header ends at header_end (tensor spans are absolute).

    Every tensor start and end is a cut, so bytes outside any tensor (padding some writers add)
    become segments of their own and the plan always tiles [0, file_size).
    """
    cuts = {header_end, file_size}
    for tensor in tensors:
        cuts.update((tensor.offset, tensor.end))
    points = sorted(cuts)
    spans = split_span(Span(0, header_end), policy.max_chunk_size)
    pack: Span | None = None
    for start, end in itertools.pairwise(points):
        segment = Span(start, end - start)
        if segment.size < policy.pack_size:
            if pack is not None and pack.size + segment.size <= policy.pack_size:
                pack = Span(pack.offset, pack.size + segment.size)
                continue
            if pack is not None:
                spans.append(pack)
            pack = segment
            continue
        if pack is not None:
            spans.append(pack)
            pack = None
        spans.extend(split_span(segment, policy.max_chunk_size))
    if pack is not None:
        spans.append(pack)
    return spans


def _read_exact(f: ReadableFile, size: int, read_size: int) -> bytes:
    parts = []
    while size:
        part = f.read(min(size, read_size))
        if not part:
            raise SafetensorsFormatError("file ends inside its header")
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


def read_safetensors_header(f: ReadableFile, file_size: int, *, read_size: int) -> tuple[int, list[Span]]:
    """Parse the header at the start of f; return where it ends and the tensors' absolute spans."""
    if file_size < 8:
        raise SafetensorsFormatError(f"{file_size} bytes is too short for a safetensors header")
    f.seek(0)
    (header_size,) = struct.unpack("<Q", _read_exact(f, 8, read_size))
    if header_size > min(MAX_HEADER_SIZE, file_size - 8):
        raise SafetensorsFormatError(f"header length {header_size} exceeds the file or the limit")
    try:
        header = json.loads(_read_exact(f, header_size, read_size))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFormatError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("header is not a JSON object")
    header_end = 8 + header_size
    data_size = file_size - header_end
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise SafetensorsFormatError(f"tensor {name!r} has bad data_offsets {offsets!r}")
        tensors.append(Span(header_end + offsets[0], offsets[1] - offsets[0]))
    return header_end, tensors


def encode_safetensors_header(tensors: Iterable[tuple[str, int]], *, metadata: dict[str, str] | None = None) -> bytes:
    """Length prefix + JSON header for byte tensors (dtype U8) of the given sizes, in order.

    The inverse of `read_safetensors_header`, for simulators, benchmarks and tests that write
    weight files without a tensor library; the tensor bytes follow the header back to back.
    """
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, size in tensors:
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # safetensors pads the header so tensor data is 8-aligned
    return struct.pack("<Q", len(body)) + body


def plan_stream(f: ReadableFile, file_size: int, *, safetensors: bool, policy: ChunkPolicy) -> list[Span]:
    if not safetensors:
        return plan_fixed(file_size, chunk_size=policy.fixed_chunk_size)
    header_end, tensors = read_safetensors_header(f, file_size, read_size=policy.read_size)
    return plan_safetensors(header_end, tensors, file_size, policy=policy)


def hash_spans(
    f: ReadableFile, spans: list[Span], *, read_size: int, on_chunk: Callable[[ChunkRef], None] | None = None
) -> Iterator[ChunkRef]:
    """Hash consecutive spans of f through one reused buffer of at most read_size bytes."""
    if not spans:
        return
    buffer = memoryview(bytearray(min(read_size, max(span.size for span in spans))))
    f.seek(spans[0].offset)
    for span in spans:
        hasher = new_hasher(span.size)
        remaining = span.size
        while remaining:
            count = f.readinto(buffer[: min(remaining, len(buffer))])
            if not count:
                raise EOFError(f"file ended at offset {span.end - remaining}, inside a chunk")
            hasher.update(buffer[:count])
            remaining -= count
        chunk = ChunkRef(id=hasher.hexdigest(), offset=span.offset, size=span.size)
        if on_chunk is not None:
            on_chunk(chunk)
        yield chunk


def chunk_stream(
    f: ReadableFile,
    file_size: int,
    *,
    safetensors: bool,
    policy: ChunkPolicy = DEFAULT_POLICY,
    on_chunk: Callable[[ChunkRef], None] | None = None,
) -> FileEntry:
    spans = plan_stream(f, file_size, safetensors=safetensors, policy=policy)
    chunks = list(hash_spans(f, spans, read_size=policy.read_size, on_chunk=on_chunk))
    return FileEntry(size=file_size, chunks=chunks)


def chunk_file(
    path: str | Path,
    *,
    policy: ChunkPolicy = DEFAULT_POLICY,
    on_chunk: Callable[[ChunkRef], None] | None = None,
) -> FileEntry:
    """Chunk and hash one file: safetensors-aware when its name ends in .safetensors."""
    # Unbuffered, so every read is one of ours and no hidden buffer doubles the copies.
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            return chunk_stream(f, size, safetensors=is_safetensors_path(path), policy=policy, on_chunk=on_chunk)
        except (EOFError, SafetensorsFormatError) as exc:
            raise type(exc)(f"{path}: {exc}") from None


class FileRegion(io.RawIOBase):
    """A read-only view of [offset, offset + size) of a file, for streaming one chunk to a store."""

    def __init__(self, path: str | Path, offset: int, size: int) -> None:
        super().__init__()
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close(), as a RawIOBase is
        self._file.seek(offset)
        self._remaining = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Buffer) -> int:
        if not self._remaining:
            return 0
        view = memoryview(buffer).cast("B")
        count = self._file.readinto(view[: min(len(view), self._remaining)]) or 0
        self._remaining -= count
        return count

    def close(self) -> None:
        self._file.close()
        super().close()
