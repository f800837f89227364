"""Benchmark the weight registry's push path against raw BLAKE3 on the same machine.

1. Write a safetensors file of mixed tensor sizes (an 8% embedding larger than a chunk, then 20
   blocks of 10 tensors from ~30% of a block down to norm-sized ones), streamed piece by piece.
2. Hash it with raw BLAKE3 through the same read path the chunker uses (unbuffered reads into
   one buffer of the policy's read size, all cores).
3. Push it the way `gpucloud weights push` does: chunk, hash and sign locally, then upload what
   the registry lacks over HTTP to the control plane's API, whose local store fsyncs every chunk
   (the API and its Temporal dev server run in this process and a child).
4. Write a "fine-tune" that rewrites one tensor per block (10% of the tensors, rotating over the
   positions in a block) and push it: dedup should store little more than those tensors.

Progress goes to stderr; the last stdout line is one JSON object (GB = 10^9 bytes). Everything
is written under one temp directory that is removed at the end, even on Ctrl-C or SIGTERM.

    python benchmarks/chunking.py [--quick] [--size-gib N] [--dir PARENT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import blake3

from gpucloud.client.registry import RegistryClient, RegistryPushTarget
from gpucloud.config import Settings
from gpucloud.devstack.serving import ThreadedServer
from gpucloud.devstack.stack import free_port
from gpucloud.devstack.temporal_server import server_args
from gpucloud.registry.chunking import ChunkPolicy, MiB, encode_safetensors_header, new_hasher
from gpucloud.registry.manifest import Lineage, Signer
from gpucloud.registry.push import PushResult, PushStats, push

BLOCKS = 20
BLOCK_FRACTIONS = [0.30, 0.22, 0.16, 0.12, 0.08, 0.06, 0.03, 0.015, 0.01, 0.005]
GENERATE_PIECE = 8 * MiB


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def layout(total: int) -> list[tuple[str, int]]:
    """Tensor names and byte sizes (multiples of 8) adding up to about `total` bytes."""
    embedding = int(total * 0.08) // 8 * 8
    block = (total - embedding) / BLOCKS
    tensors = [("embed_tokens.weight", embedding)]
    for b in range(BLOCKS):
        tensors += [(f"layers.{b}.t{i}.weight", int(block * f) // 8 * 8) for i, f in enumerate(BLOCK_FRACTIONS)]
    return tensors


def tuned_tensors() -> set[str]:
    """One tensor per block, rotating through the block's positions: 10% of the tensors."""
    return {f"layers.{b}.t{(3 * b) % len(BLOCK_FRACTIONS)}.weight" for b in range(BLOCKS)}


def write_weights(path: Path, tensors: list[tuple[str, int]], *, variant: str, retuned: set[str]) -> None:
    """Stream pseudo-random tensor bytes (BLAKE3 XOF) without holding more than one piece."""
    with open(path, "wb") as f:
        f.write(encode_safetensors_header(tensors))
        for name, size in tensors:
            seed = blake3.blake3(f"{variant if name in retuned else 'base'}:{name}".encode())
            for offset in range(0, size, GENERATE_PIECE):
                f.write(seed.digest(length=min(GENERATE_PIECE, size - offset), seek=offset))
        f.flush()
        os.fsync(f.fileno())  # so neither measurement pays for writing the generated file back


def raw_blake3_seconds(path: Path, read_size: int) -> float:
    """Best of three passes: start-up and a busy neighbour must not flatter the ratio."""
    return min(_raw_blake3_pass(path, read_size) for _ in range(3))


def _raw_blake3_pass(path: Path, read_size: int) -> float:
    started = time.perf_counter()
    hasher = new_hasher(read_size)
    buffer = memoryview(bytearray(read_size))
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            hasher.update(buffer[:count])
    hasher.hexdigest()
    return time.perf_counter() - started


class Reporter:
    def __init__(self, label: str) -> None:
        self.label, self.last = label, 0.0

    def __call__(self, phase: str, stats: PushStats) -> None:
        done, total = (
            (stats.bytes_hashed, stats.bytes_total)
            if phase == "hash"
            else (stats.bytes_uploaded, stats.bytes_to_upload)
        )
        now = time.monotonic()
        if now - self.last >= 2 or done == total:
            self.last = now
            log(f"  {self.label} {phase}: {done / 2**30:.2f} / {total / 2**30:.2f} GiB")


@contextlib.contextmanager
def registry_api(workdir: Path) -> Iterator[RegistryClient]:
    """The control plane's API (with its Temporal dev server and SQLite DB) on loopback, and a
    client holding a new tenant's key: the path `gpucloud weights push` takes."""
    from gpucloud.api.app import create_app

    temporal_port = free_port()
    temporal = subprocess.Popen(
        server_args(workdir, port=temporal_port, headless=True, persist=False),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    operator = "bench-operator"
    settings = Settings(
        data_dir=workdir / "server",
        temporal={"address": f"127.0.0.1:{temporal_port}"},
        api={"operator_token": operator},
    )
    server = ThreadedServer(create_app(settings), name="api")
    try:
        url = server.start(timeout_s=60)
        with RegistryClient(url, operator) as op:
            tenant = op.create("/v1/tenants", {"name": "bench"})
            key = op.call("POST", f"/v1/tenants/{tenant['id']}/api-keys")["key"]
        with RegistryClient(url, key) as client:
            yield client
    finally:
        server.stop()
        temporal.kill()
        temporal.wait()


def run(size: int, parent: str | None) -> dict:
    policy = ChunkPolicy()
    tensors = layout(size)
    workdir = Path(tempfile.mkdtemp(prefix="gpucloud-bench-", dir=parent))
    stack = contextlib.ExitStack()
    try:
        api = stack.enter_context(registry_api(workdir))
        target = RegistryPushTarget(api)
        signer = Signer.generate()
        base_dir, tuned_dir = workdir / "base", workdir / "tuned"
        base_dir.mkdir()
        tuned_dir.mkdir()

        log(f"writing {size / 2**30:.2f} GiB file of {len(tensors)} tensors in {workdir}")
        started = time.perf_counter()
        write_weights(base_dir / "model.safetensors", tensors, variant="base", retuned=set())
        write_seconds = time.perf_counter() - started
        file_bytes = (base_dir / "model.safetensors").stat().st_size
        log(f"  written in {write_seconds:.1f}s")

        log("raw BLAKE3 over the same bytes")
        raw_seconds = raw_blake3_seconds(base_dir / "model.safetensors", policy.read_size)

        log("push over the API (chunk + hash, then upload what the registry lacks)")
        started = time.perf_counter()
        base = push(
            base_dir,
            model="bench",
            target=target,
            signer=signer,
            policy=policy,
            report=Reporter("base"),
        )
        push_seconds = time.perf_counter() - started
        shutil.rmtree(base_dir)  # the store holds it now; keeps peak disk use near 2x the size

        retuned = tuned_tensors()
        changed_bytes = sum(s for name, s in tensors if name in retuned)
        log(f"writing fine-tune ({len(retuned)} of {len(tensors)} tensors rewritten)")
        write_weights(tuned_dir / "model.safetensors", tensors, variant="tuned", retuned=retuned)
        log("push fine-tune")
        started = time.perf_counter()
        tuned: PushResult = push(
            tuned_dir,
            model="bench",
            target=target,
            signer=signer,
            policy=policy,
            lineage=Lineage(parent=base.digest),
            report=Reporter("tuned"),
        )
        tuned_seconds = time.perf_counter() - started
    finally:
        stack.close()
        shutil.rmtree(workdir, ignore_errors=True)

    gb = file_bytes / 1e9
    return {
        "bytes": file_bytes,
        "chunks": base.chunks_total,
        "gb_per_s": round(gb / push_seconds, 3),
        "blake3_gb_per_s": round(gb / raw_seconds, 3),
        "ratio": round(raw_seconds / push_seconds, 3),
        "chunk_hash_gb_per_s": round(gb / base.hash_seconds, 3),
        "chunk_hash_ratio": round(raw_seconds / base.hash_seconds, 3),
        # Uploads over loopback HTTP into the API's local store (which fsyncs every chunk).
        "store_gb_per_s": round(base.bytes_uploaded / 1e9 / base.upload_seconds, 3),
        # The same disk's plain sequential write (generate + write + one fsync): the ceiling for
        # any store that must write every byte once.
        "file_write_gb_per_s": round(gb / write_seconds, 3),
        "dedup_stored_fraction": round(tuned.bytes_uploaded / tuned.bytes_total, 4),
        "finetune_changed_fraction": round(changed_bytes / file_bytes, 4),
        "finetune_chunks_uploaded": tuned.chunks_uploaded,
        "finetune_push_gb_per_s": round(gb / tuned_seconds, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB instead of 4 GiB")
    parser.add_argument("--size-gib", type=float, default=None, help="file size in GiB (default 4)")
    parser.add_argument("--dir", default=None, help="parent of the temp directory (default: system temp)")
    args = parser.parse_args()
    size_gib = args.size_gib if args.size_gib is not None else (0.25 if args.quick else 4.0)
    # SIGTERM would otherwise skip the finally that removes gigabytes of temp files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(int(size_gib * 2**30), args.dir)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
