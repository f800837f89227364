"""Benchmark the weight registry's push and pull against the disk they write to, in one run.

1. Write a safetensors file of mixed tensor sizes (an 8% embedding larger than a chunk, then 20
   blocks of 10 tensors from ~30% of a block down to norm-sized ones), streamed piece by piece.
2. Hash it with raw BLAKE3 through the same read path the chunker uses, then chunk and hash it.
3. The floor: the same bytes written as chunk-sized files with the store's durability (temp
   file, fsync, rename, directory fsync) from as many threads as the CLI uploads with, through
   the page cache as the targets define it; and the same written with direct I/O, as the store
   writes (ratios against both are printed: `*_ratio` and `*_ratio_vs_direct`).
4. The local chunk store alone on the same chunks (it also verifies every chunk's hash).
5. `gpucloud weights push` as a user runs it, in its own process, over HTTP into the control
   plane's API (hash, upload, the API verifies and stores), then `gpucloud weights pull` back
   (download, verify, write); twice, into two tenants, best of two as the floor and the store
   are (the first runs are printed too). Ratios are against the floor of step 3.
6. A "fine-tune" that rewrites one tensor per block (10% of the tensors, rotating over the
   positions in a block), pushed with the CLI: dedup should store little more than those.

Progress goes to stderr; the last stdout line is one JSON object (GB = 10^9 bytes). Everything
is written under one temp directory that is removed at the end, even on Ctrl-C or SIGTERM.

    python benchmarks/chunking.py [--quick] [--size-gib N] [--dir PARENT] [--concurrency N]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

from gpucloud.client.base import ApiClient
from gpucloud.config import Settings
from gpucloud.devstack.stack import free_port
from gpucloud.devstack.temporal_server import server_args
from gpucloud.registry.chunking import (
    ChunkPolicy,
    FileRegion,
    MiB,
    chunk_file,
    encode_safetensors_header,
    new_hasher,
)
from gpucloud.registry.manifest import ChunkRef
from gpucloud.registry.push import push
from gpucloud.registry.store import LocalChunkStore
from gpucloud.storage.direct import STAGE, write_durably
from gpucloud.storage.local import fsync_path
from gpucloud.web.serving import ThreadedServer

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


def chunk_files_floor(path: Path, chunks: list[ChunkRef], into: Path, concurrency: int, read_size: int) -> float:
    """The disk's durable write rate for these bytes as chunk-sized files, with the store's
    durability (each written to a temp file, fsynced, renamed into place, its directory
    fsynced), from as many threads as a push uploads with: the ceiling for any store here."""
    into.mkdir()

    def one(chunk: ChunkRef) -> None:
        tmp, final = into / f".{chunk.id}", into / chunk.id
        with FileRegion(path, chunk.offset, chunk.size) as region, open(tmp, "wb", buffering=0) as out:
            while piece := region.read(read_size):
                out.write(piece)
            os.fsync(out.fileno())
        os.replace(tmp, final)
        fsync_path(into)

    return _timed(one, chunks, into, concurrency)


def chunk_files_floor_direct(path: Path, chunks: list[ChunkRef], into: Path, concurrency: int) -> float:
    """The same floor written the way the local store writes (whole blocks with `O_DIRECT` from
    an aligned buffer, the last partial block through the page cache, then the same fsyncs): the
    disk's rate for the store's own write path, with nothing else of the store."""
    into.mkdir()

    def one(chunk: ChunkRef) -> None:
        tmp, final = into / f".{chunk.id}", into / chunk.id
        with FileRegion(path, chunk.offset, chunk.size) as region:
            pieces = iter(lambda: region.read(STAGE), b"")
            write_durably(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), tmp, pieces)
        os.replace(tmp, final)
        fsync_path(into)

    return _timed(one, chunks, into, concurrency)


def store_seconds(path: Path, chunks: list[ChunkRef], into: Path, concurrency: int) -> float:
    """The local chunk store alone (verify-on-put, temp file, fsync, rename), same threads."""
    store = LocalChunkStore(into)

    def one(chunk: ChunkRef) -> None:
        with FileRegion(path, chunk.offset, chunk.size) as region:
            store.put(chunk.id, region)

    return _timed(one, chunks, into, concurrency)


def _timed(one: Callable[[ChunkRef], None], chunks: list[ChunkRef], into: Path, concurrency: int) -> float:
    """Seconds to run `one` over every chunk from `concurrency` threads; `into` is removed after."""
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, chunks))
    seconds = time.perf_counter() - started
    shutil.rmtree(into)
    return seconds


@dataclass
class CliRun:
    seconds: float
    peak_rss_mib: float
    output: dict


def cli(args: list[str], env: dict[str, str]) -> CliRun:
    """Run `gpucloud ARGS --output json` as a user would; its time, peak RSS and JSON answer.

    The peak is the child's own VmHWM, read while it runs: the rusage of a forked child would
    count the pages it shared with this process (which hosts the API) before it exec'd."""
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "gpucloud.cli.main", *args, "--output", "json"],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    peak_kib = [0]
    watcher = threading.Thread(target=_watch_peak, args=(child, peak_kib), daemon=True)
    watcher.start()
    answer, _ = child.communicate()
    seconds = time.perf_counter() - started
    watcher.join()
    if child.returncode != 0:
        raise SystemExit(f"gpucloud {' '.join(args)} exited {child.returncode}")
    peak = peak_kib[0] / 1024
    log(f"  gpucloud {args[0]} {args[1]}: {seconds:.1f}s, peak RSS {peak:.0f} MiB")
    return CliRun(seconds, peak, json.loads(answer.strip().splitlines()[-1]))


def _watch_peak(child: subprocess.Popen, peak_kib: list[int]) -> None:
    status = Path(f"/proc/{child.pid}/status")
    while child.poll() is None:
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:") and child.poll() is None:
                    peak_kib[0] = max(peak_kib[0], int(line.split()[1]))
        time.sleep(0.02)


@contextlib.contextmanager
def registry_api(workdir: Path) -> Iterator[str]:
    """The control plane's API (with its Temporal dev server and SQLite DB) on loopback, serving
    from this process while the CLI runs in its own; yields the API URL and the keys of two new
    tenants (each its own chunk store, so the second push of the same bytes finds none there)."""
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
        keys = []
        with ApiClient(url, operator) as op:
            for name in ("bench", "bench-again"):
                tenant = op.create("/v1/tenants", {"name": name})
                keys.append(op.call("POST", f"/v1/tenants/{tenant['id']}/api-keys")["key"])
        yield url, keys
    finally:
        server.stop()
        temporal.kill()
        temporal.wait()


def run(size: int, parent: str | None, concurrency: int) -> dict:
    policy = ChunkPolicy()
    tensors = layout(size)
    workdir = Path(tempfile.mkdtemp(prefix="gpucloud-bench-", dir=parent))
    stack = contextlib.ExitStack()
    try:
        url, keys = stack.enter_context(registry_api(workdir))
        envs = [
            {"GPUCLOUD_API_URL": url, "GPUCLOUD_API_KEY": key, "GPUCLOUD_DATA_DIR": str(workdir / f"client-{i}")}
            for i, key in enumerate(keys)
        ]
        env = envs[0]
        base_dir, tuned_dir = workdir / "base", workdir / "tuned"
        base_dir.mkdir()
        tuned_dir.mkdir()
        model_file = base_dir / "model.safetensors"

        log(f"writing {size / 2**30:.2f} GiB file of {len(tensors)} tensors in {workdir}")
        write_weights(model_file, tensors, variant="base", retuned=set())
        file_bytes = model_file.stat().st_size

        log("raw BLAKE3 over the same bytes")
        raw_seconds = raw_blake3_seconds(model_file, policy.read_size)
        log("chunk and hash")
        started = time.perf_counter()
        chunks = list(chunk_file(model_file, policy=policy).chunks)
        hash_seconds = time.perf_counter() - started

        # Alternated, best of two each: a disk this noisy must not decide the ratio by itself.
        floor_runs, direct_runs, store_runs = [], [], []
        for attempt in (1, 2):
            log(f"durable write floor ({attempt}/2): {len(chunks)} chunk files, {concurrency} threads")
            floor_runs.append(chunk_files_floor(model_file, chunks, workdir / "floor", concurrency, policy.read_size))
            log(f"  {file_bytes / 1e9 / floor_runs[-1]:.3f} GB/s")
            log(f"durable write floor with direct I/O ({attempt}/2)")
            direct_runs.append(chunk_files_floor_direct(model_file, chunks, workdir / "floor-direct", concurrency))
            log(f"  {file_bytes / 1e9 / direct_runs[-1]:.3f} GB/s")
            log(f"the local chunk store alone ({attempt}/2)")
            store_runs.append(store_seconds(model_file, chunks, workdir / "store-alone", concurrency))
            log(f"  {file_bytes / 1e9 / store_runs[-1]:.3f} GB/s")
        floor_seconds, direct_seconds, store_s = min(floor_runs), min(direct_runs), min(store_runs)

        # Alternated and best of two as well, each push into its own tenant's store: the first
        # write into memory this machine has not touched lately costs several times the kernel
        # time of a later one (the floor's best run has that advantage too).
        pushes, pulls = [], []
        for attempt, tenant_env in enumerate(envs, start=1):
            log(f"gpucloud weights push (hash, upload, server-side verify and store) ({attempt}/2)")
            pushes.append(cli(["weights", "push", str(base_dir), "--model", "bench"], tenant_env))
            digest = pushes[-1].output["version"]["digest"]
            log(f"gpucloud weights pull (download, verify, write) ({attempt}/2)")
            pulls.append(cli(["weights", "pull", f"bench@{digest}", str(workdir / "pulled")], tenant_env))
            shutil.rmtree(workdir / "pulled")
        shutil.rmtree(base_dir)  # the stores hold it now
        base, pulled = min(pushes, key=lambda r: r.seconds), min(pulls, key=lambda r: r.seconds)
        digest = pushes[0].output["version"]["digest"]  # the fine-tune's parent, in the first tenant

        retuned = tuned_tensors()
        changed_bytes = sum(s for name, s in tensors if name in retuned)
        log(f"writing fine-tune ({len(retuned)} of {len(tensors)} tensors rewritten)")
        write_weights(tuned_dir / "model.safetensors", tensors, variant="tuned", retuned=retuned)
        log("gpucloud weights push of the fine-tune")
        tuned = cli(["weights", "push", str(tuned_dir), "--model", "bench", "--parent", digest], env)
    finally:
        stack.close()
        shutil.rmtree(workdir, ignore_errors=True)

    gb = file_bytes / 1e9
    floor = gb / floor_seconds
    push_rate, pull_rate = gb / base.seconds, gb / pulled.seconds
    tuned_stats = tuned.output["stats"]
    return {
        "bytes": file_bytes,
        "chunks": len(chunks),
        "blake3_gb_per_s": round(gb / raw_seconds, 3),
        "chunk_hash_gb_per_s": round(gb / hash_seconds, 3),
        "chunk_hash_ratio": round(raw_seconds / hash_seconds, 3),
        "file_write_gb_per_s": round(floor, 3),
        "store_gb_per_s": round(gb / store_s, 3),
        "store_ratio": round(floor_seconds / store_s, 3),
        # The store, push and pull write with direct I/O; the same bytes written that way alone:
        "file_write_direct_gb_per_s": round(gb / direct_seconds, 3),
        "store_ratio_vs_direct": round(direct_seconds / store_s, 3),
        "push_ratio_vs_direct": round(push_rate / (gb / direct_seconds), 3),
        "pull_ratio_vs_direct": round(pull_rate / (gb / direct_seconds), 3),
        "push_gb_per_s": round(push_rate, 3),
        "push_ratio": round(push_rate / floor, 3),
        "pull_gb_per_s": round(pull_rate, 3),
        "pull_ratio": round(pull_rate / floor, 3),
        # The first of the two runs of each, into memory the machine had not written lately.
        "file_write_first_gb_per_s": round(gb / floor_runs[0], 3),
        "file_write_direct_first_gb_per_s": round(gb / direct_runs[0], 3),
        "store_first_gb_per_s": round(gb / store_runs[0], 3),
        "push_first_gb_per_s": round(gb / pushes[0].seconds, 3),
        "pull_first_gb_per_s": round(gb / pulls[0].seconds, 3),
        "dedup_stored_fraction": round(tuned_stats["bytes_uploaded"] / tuned_stats["bytes_total"], 4),
        "finetune_changed_fraction": round(changed_bytes / file_bytes, 4),
        "finetune_chunks_uploaded": tuned_stats["chunks_uploaded"],
        "finetune_push_gb_per_s": round(gb / tuned.seconds, 3),
        # The CLI's own processes (push, pull, fine-tune push): what a user's machine holds.
        "peak_rss_mib": round(max(run.peak_rss_mib for run in (*pushes, *pulls, tuned)), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB instead of 4 GiB")
    parser.add_argument("--size-gib", type=float, default=None, help="file size in GiB (default 4)")
    parser.add_argument("--dir", default=None, help="parent of the temp directory (default: system temp)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=inspect.signature(push).parameters["concurrency"].default,
        help="threads for the floor and the store alone (default: as many as the CLI uploads with)",
    )
    args = parser.parse_args()
    size_gib = args.size_gib if args.size_gib is not None else (0.25 if args.quick else 4.0)
    # SIGTERM would otherwise skip the finally that removes gigabytes of temp files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(int(size_gib * 2**30), args.dir, args.concurrency)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
