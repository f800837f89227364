"""Small model directories for the registry's tests: a safetensors file of random tensors, a
config, and (optionally) a tokenizer directory and an empty file, chunked with a tiny policy
so that a few KB make many chunks; and real float models (fp32, fp16, bf16) for the evaluators."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

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


def write_bf16(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file with bfloat16 tensors (numpy has no bf16: the upper half of float32)."""
    header, blobs, offset = {}, [], 0
    for name, values in tensors.items():
        raw = (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(values.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def float_model(
    root: Path, rng: np.random.Generator, *, scale: float = 1.0, nan: bool = False, wide: int = 512
) -> Path:
    """A real model of a few MiB: fp32 and fp16 tensors in one safetensors file, bf16 in another,
    and a config; `scale` multiplies every weight (a fine-tune), `nan` puts one NaN in the fp16."""
    root.mkdir(parents=True)
    embed = rng.standard_normal((wide, 1024)).astype(np.float32) * scale  # 2 MiB of fp32
    mlp = (rng.standard_normal((wide, 512)) * scale).astype(np.float16)
    if nan:
        mlp[3, 7] = np.nan
    save_file({"embed.weight": embed, "mlp.weight": mlp}, str(root / "model-00001-of-00002.safetensors"))
    write_bf16(root / "model-00002-of-00002.safetensors", {"lm_head.weight": rng.standard_normal((256, 512)) * scale})
    (root / "config.json").write_text("{}")
    return root
