"""The weight-sanity evaluator: every tensor of every safetensors file of a version, read once,
in bounded memory, against its parent version's.

Per tensor it counts NaN and Inf values and computes the L2 norm (each chunk's sum of squares
in float32 through BLAS, summed in float64; a chunk holding NaN or Inf, or whose squares
overflow float32, is counted value by value and summed in float64);
against the parent it reports the relative change of that norm, tensors added or removed,
tensors whose dtype or shape changed, and files added or removed. The metrics are what gates
hold (`nan_inf_count` max 0, `max_rel_norm_change` max 0.5 for a fine-tune, `shape_changes`
max 0).

Files are read with a fixed buffer (`CHUNK_BYTES`), whatever the model's size: the header
through the `safetensors` package's own parser (which refuses a malformed file), the tensor
data straight from the data offsets the header gives, converted with numpy a chunk at a time.
bfloat16, which numpy lacks, is widened to float32 exactly (its 16 bits are a float32's upper
half). Integer and boolean tensors have no NaN or Inf; their norm is still computed.
"""

from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open

CHUNK_BYTES = 8 << 20
DEFAULT_NORM_THRESHOLD = 0.5

_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8),
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),  # widened to float32 below
    "I64": ("<i8", 8),
    "I32": ("<i4", 4),
    "I16": ("<i2", 2),
    "I8": ("i1", 1),
    "U8": ("u1", 1),
    "BOOL": ("u1", 1),
}
_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})


class SanityError(ValueError):
    """A file that is not a readable safetensors file (the evaluation fails with this reason)."""


@dataclass(frozen=True)
class TensorStats:
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    nan: int
    inf: int
    l2: float


@dataclass
class SanityReport:
    tensors: dict[str, TensorStats] = field(default_factory=dict)  # "<file>:<tensor>" -> stats
    files: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    # Against the parent, when there is one.
    rel_norm_change: dict[str, float] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    shape_changed: list[str] = field(default_factory=list)
    dtype_changed: list[str] = field(default_factory=list)
    files_added: list[str] = field(default_factory=list)
    files_removed: list[str] = field(default_factory=list)
    threshold: float = DEFAULT_NORM_THRESHOLD

    def metrics(self) -> dict[str, float]:
        """What gates hold: every value a number."""
        nan = sum(t.nan for t in self.tensors.values())
        inf = sum(t.inf for t in self.tensors.values())
        changes = list(self.rel_norm_change.values())
        return {
            "nan_inf_count": float(nan + inf),
            "nan_count": float(nan),
            "inf_count": float(inf),
            "tensor_count": float(len(self.tensors)),
            "max_rel_norm_change": max(changes) if changes else 0.0,
            "tensors_over_norm_threshold": float(sum(c > self.threshold for c in changes)),
            "shape_changes": float(len(self.shape_changed)),
            "dtype_changes": float(len(self.dtype_changed)),
            "tensors_added": float(len(self.added)),
            "tensors_removed": float(len(self.removed)),
            "files_added": float(len(self.files_added)),
            "files_removed": float(len(self.files_removed)),
        }

    def details(self, *, most: int = 10) -> dict:
        """The names behind the numbers (largest norm changes first), for people and the events."""
        largest = sorted(self.rel_norm_change.items(), key=lambda item: -item[1])[:most]
        return {
            "nan_or_inf": [k for k, t in self.tensors.items() if t.nan or t.inf][:most],
            "largest_rel_norm_changes": [{"tensor": k, "rel_change": round(v, 6)} for k, v in largest],
            "over_norm_threshold": [k for k, v in largest if v > self.threshold],
            "shape_changed": self.shape_changed[:most],
            "dtype_changed": self.dtype_changed[:most],
            "added": self.added[:most],
            "removed": self.removed[:most],
            "files_added": self.files_added[:most],
            "files_removed": self.files_removed[:most],
            "bytes_read": self.bytes_read,
            "read_gb_per_s": round(self.bytes_read / self.seconds / 1e9, 3) if self.seconds else None,
        }


def _header(path: Path) -> tuple[int, dict]:
    """(where the data starts, the header's tensors) of a safetensors file."""
    try:
        with safe_open(str(path), framework="numpy") as checked:  # the package's own validation
            names = set(checked.keys())
    except Exception as error:  # the package raises its own error types for a malformed file
        raise SanityError(f"{path.name} is not a readable safetensors file: {error}") from error
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    if set(header) != names:
        raise SanityError(f"{path.name}: its header and the safetensors parser disagree")
    return 8 + length, header


def _tensor_stats(f, data_start: int, name: str, entry: dict, file: str, buffer: bytearray) -> TensorStats:
    dtype = entry["dtype"]
    if dtype not in _DTYPES:
        raise SanityError(f"{file}:{name} has dtype {dtype}, which the sanity evaluator does not read")
    numpy_dtype, size = _DTYPES[dtype]
    begin, end = entry["data_offsets"]
    f.seek(data_start + begin)
    remaining, nan, inf, squares = end - begin, 0, 0, 0.0
    step = len(buffer) - len(buffer) % size
    view = memoryview(buffer)
    while remaining:
        n = f.readinto(view[: min(step, remaining)])
        if not n:
            raise SanityError(f"{file}:{name} is cut short")
        values = np.frombuffer(view[:n], dtype=numpy_dtype)
        if dtype == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        elif dtype != "F64":
            values = values.astype(np.float32, copy=False)  # a dot product in BLAS; f16 would overflow
        # One pass in the usual case: a NaN or an Inf makes the sum of squares non-finite, and
        # only then are they counted (and the norm taken in float64 over the finite values).
        chunk = float(np.dot(values, values))
        if not math.isfinite(chunk):
            if dtype in _FLOATS:
                nan += int(np.isnan(values).sum())
                inf += int(np.isinf(values).sum())
            wide = values[np.isfinite(values)].astype(np.float64)
            chunk = float(np.dot(wide, wide))
        squares += chunk
        remaining -= n
    return TensorStats(file, name, dtype, tuple(entry["shape"]), nan, inf, math.sqrt(squares))


def scan(directory: Path) -> SanityReport:
    """Every tensor of every `*.safetensors` file under `directory`."""
    report = SanityReport()
    started = time.monotonic()
    buffer = bytearray(CHUNK_BYTES)
    for path in sorted(directory.rglob("*.safetensors")):
        file = path.relative_to(directory).as_posix()
        report.files.append(file)
        data_start, header = _header(path)
        with open(path, "rb") as f:
            for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
                stats = _tensor_stats(f, data_start, name, header[name], file, buffer)
                report.tensors[f"{file}:{name}"] = stats
                report.bytes_read += header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
    report.seconds = time.monotonic() - started
    return report


def evaluate(directory: Path, parent: Path | None = None, *, threshold: float = DEFAULT_NORM_THRESHOLD) -> SanityReport:
    """The version in `directory`, against the parent version in `parent` (when given)."""
    report = scan(directory)
    report.threshold = threshold
    if parent is None:
        return report
    before = scan(parent)
    report.files_added = sorted(set(report.files) - set(before.files))
    report.files_removed = sorted(set(before.files) - set(report.files))
    for key, now in report.tensors.items():
        old = before.tensors.get(key)
        if old is None:
            report.added.append(key)
            continue
        if old.shape != now.shape:
            report.shape_changed.append(key)
        if old.dtype != now.dtype:
            report.dtype_changed.append(key)
        if old.shape == now.shape:
            # A tensor that was all zeros and is not any more: as large a change as gates can see.
            report.rel_norm_change[key] = abs(now.l2 - old.l2) / old.l2 if old.l2 else (0.0 if not now.l2 else 1e9)
    report.removed = sorted(set(before.tensors) - set(report.tensors))
    return report
