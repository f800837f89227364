"""The weight-sanity evaluator against the read rate of the same files, in the same run.

Writes a model of safetensors shards (bf16, fp16 and fp32 tensors; `--gib` in all), then
measures, alternating:
- `cached_read_gb_per_s`: reading every shard's bytes from the page cache with the evaluator's
  buffer size and doing nothing with them (memory bandwidth, more or less);
- `disk_read_gb_per_s`: the same with O_DIRECT, bypassing the cache: the disk's read rate, the
  floor of any reader of a model too large to stay cached;
- `sanity_gb_per_s`: `registry.sanity.scan` over the same files, cached (NaN/Inf counts and L2
  norms of every tensor), in a process of its own;
and the evaluator's peak memory (`max_rss_mib`: the peak of a fresh process that only runs the
scans) against the model's size.

    python benchmarks/sanity.py [--gib 2] [--quick]

Prints progress to stderr and one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import log

from gpucloud.registry import sanity


def write_model(root: Path, gib: float) -> int:
    rng = np.random.default_rng(0)
    shard_bytes, written, index = 256 << 20, 0, 0
    while written < gib * (1 << 30):
        rows = shard_bytes // (4 * 4096)
        tensors = {
            "fp32.weight": rng.standard_normal((rows // 2, 4096), dtype=np.float32),
            "fp16.weight": rng.standard_normal((rows // 2, 4096), dtype=np.float32).astype(np.float16),
        }
        path = root / f"model-{index:05d}.safetensors"
        save_file(tensors, str(path))
        written += path.stat().st_size
        index += 1
    return written


def raw_read(root: Path) -> float:
    buffer = memoryview(bytearray(sanity.CHUNK_BYTES))
    started, total = time.monotonic(), 0
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as f:
            while n := f.readinto(buffer):
                total += n
    return total / (time.monotonic() - started) / 1e9


# The peak is read from VmHWM (this process's own memory); ru_maxrss would carry over the
# high-water mark of the benchmark that forked it.
_SCAN = """
import json, sys
from pathlib import Path
from gpucloud.registry import sanity
report = sanity.scan(Path(sys.argv[1]))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
peak = int(status["VmHWM"].split()[0]) / 1024
print(json.dumps([report.bytes_read / report.seconds / 1e9, len(report.tensors), peak]))
"""


def scan_in_fresh_process(root: Path) -> tuple[float, int, float]:
    """The evaluator's rate, tensor count and peak memory (MiB) in a process that does nothing else."""
    done = subprocess.run([sys.executable, "-c", _SCAN, str(root)], capture_output=True, text=True, check=True)
    rate, tensors, peak = json.loads(done.stdout)
    return rate, tensors, peak


def disk_read(root: Path) -> float:
    """The same bytes with O_DIRECT: the page cache bypassed, the disk's own read rate."""
    import mmap
    import os

    buffer = mmap.mmap(-1, sanity.CHUNK_BYTES)  # page-aligned, as O_DIRECT needs
    started, total = time.monotonic(), 0
    for path in sorted(root.glob("*.safetensors")):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while n := os.readv(fd, [buffer]):
                total += n
        finally:
            os.close(fd)
    return total / (time.monotonic() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="0.5 GiB")
    args = parser.parse_args()
    gib = 0.5 if args.quick else args.gib
    root = Path(tempfile.mkdtemp(prefix="gpucloud-sanity-"))
    try:
        log(f"writing a {gib} GiB model in {root}")
        size = write_model(root, gib)
        raw_read(root)  # warm the page cache evenly for both
        raws, rates, disks, peaks = [], [], [], []
        for attempt in range(3):
            raws.append(raw_read(root))
            rate, tensors, peak = scan_in_fresh_process(root)
            rates.append(rate)
            peaks.append(peak)
            disks.append(disk_read(root))
            log(f"  try {attempt + 1}: cached {raws[-1]:.2f} GB/s, disk {disks[-1]:.2f}, sanity {rate:.2f} GB/s")
        rss_mib = max(peaks)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    raw, scan, disk = max(raws), max(rates), max(disks)
    print(
        json.dumps(
            {
                "model_bytes": size,
                "tensors": tensors,
                "cached_read_gb_per_s": round(raw, 3),
                "disk_read_gb_per_s": round(disk, 3),
                "sanity_gb_per_s": round(scan, 3),
                "ratio_vs_disk_read": round(scan / disk, 3),
                "ratio_vs_cached_read": round(scan / raw, 3),
                "buffer_mib": sanity.CHUNK_BYTES >> 20,
                "max_rss_mib": round(rss_mib, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
