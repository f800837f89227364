"""Small model directories for the registry's tests: a safetensors file of random tensors, a
config, and (optionally) a tokenizer directory and an empty file, chunked with a tiny policy
so that a few KB make many chunks."""

from __future__ import annotations

import os
from pathlib import Path

from gpucloud.registry.chunking import ChunkPolicy, encode_safetensors_header

POLICY = ChunkPolicy(max_chunk_size=4096, pack_size=1024, fixed_chunk_size=4096, read_size=1500)
SIZES = (6000, 300, 200, 9000, 2500, 100, 5000)


def random_tensors(sizes: tuple[int, ...] = SIZES) -> dict[str, bytes]:
    return {f"layer.{i}": os.urandom(size) for i, size in enumerate(sizes)}


def write_model(
    directory: Path,
    tensors: dict[str, bytes],
    *,
    config: bytes = b'{"layers": 2}',
    tokenizer: bool = True,
    empty_file: bool = False,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    header = encode_safetensors_header((name, len(data)) for name, data in tensors.items())
    (directory / "model.safetensors").write_bytes(header + b"".join(tensors.values()))
    (directory / "config.json").write_bytes(config)
    if tokenizer:
        (directory / "tokenizer").mkdir(exist_ok=True)
        (directory / "tokenizer" / "vocab.bin").write_bytes(b"v" * 5000)
    if empty_file:
        (directory / "EMPTY").write_bytes(b"")
    return directory


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` by its relative path, with its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def same_tree(a: Path, b: Path) -> bool:
    return tree(a) == tree(b)
