"""What a fan-out run is given and what it finds: the configuration, the transfers, the result,
and the lower bound it is measured against (see the package's docstring)."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

MiB = 1 << 20
Strategy = Literal["origin_only", "tiered_mirrors", "p2p"]
STRATEGIES: tuple[Strategy, ...] = ("origin_only", "tiered_mirrors", "p2p")
ORIGIN_SOURCE = -1
"""`Transfer.source` of a transfer the origin served."""


class FanoutConfig(BaseModel):
    """One scenario: fleet shape, link speeds (Gb/s), artifact, strategy and client knobs."""

    model_config = ConfigDict(frozen=True)

    strategy: Strategy
    nodes: int = Field(gt=0)
    artifact_bytes: int = Field(gt=0)
    chunk_bytes: int = Field(default=64 * MiB, gt=0)
    nodes_per_rack: int = Field(default=40, gt=0)
    nic_up_gbps: float = Field(default=100.0, gt=0)
    nic_down_gbps: float = Field(default=100.0, gt=0)
    origin_gbps: float = Field(default=100.0, gt=0)
    rack_oversubscription: float | None = Field(default=None, ge=1.0)
    parallel_fetches: int = Field(default=4, gt=0, description="fetches a node keeps in flight")
    upload_slots: int = Field(default=4, gt=0, description="concurrent uploads per peer/mirror")
    origin_slots: int = Field(default=8, gt=0, description="concurrent uploads at the origin")
    max_transfers: int = Field(default=300_000, gt=0, description="chunk batching threshold")
    seed: int = 0
    audit: bool = Field(default=False, description="record every transfer and peak link rates")


class Transfer(NamedTuple):
    """One finished transfer, recorded by audited runs; node indices, ORIGIN_SOURCE for the origin."""

    source: int
    target: int
    piece: int
    start_s: float
    end_s: float
    size: int


class FanoutResult(BaseModel):
    """Completion times (seconds from the start), their ratio to `lower_bound_s`, egress bytes."""

    config: FanoutConfig
    piece_bytes: int
    pieces: int
    transfers: int
    bound_s: float
    completion_s: list[float] = Field(description="when each node (by index) held every piece")
    p50_s: float
    p99_s: float
    max_s: float
    p50_over_bound: float
    p99_over_bound: float
    max_over_bound: float
    origin_egress_bytes: int
    origin_egress_x: float
    sent_bytes: list[int] = Field(description="bytes each node uploaded to other nodes")
    transfer_log: list[Transfer] | None = None
    peak_up_bytes_per_s: list[float] | None = Field(default=None, description="per node")
    peak_down_bytes_per_s: list[float] | None = None
    peak_origin_bytes_per_s: float | None = None


def lower_bound_s(config: FanoutConfig) -> float:
    """Optimistic yardstick for any strategy; see the module docstring for the argument."""
    up, down, origin = bytes_per_s(config)
    size, nodes = config.artifact_bytes, config.nodes
    delivery = max(size / down, size / origin, nodes * size / (nodes * up + origin))
    depth = math.ceil(math.log2(nodes)) if nodes > 1 else 0
    return delivery + depth * config.chunk_bytes / up


def piece_bytes(config: FanoutConfig) -> int:
    """Bytes the simulator moves per transfer: whole chunks, batched only past max_transfers."""
    chunks = math.ceil(config.artifact_bytes / config.chunk_bytes)
    pieces_per_node = max(1, min(chunks, config.max_transfers // config.nodes))
    return math.ceil(chunks / pieces_per_node) * config.chunk_bytes


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]): the value at least a q share of nodes beat."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def bytes_per_s(config: FanoutConfig) -> tuple[float, float, float]:
    return (config.nic_up_gbps * 1e9 / 8, config.nic_down_gbps * 1e9 / 8, config.origin_gbps * 1e9 / 8)
