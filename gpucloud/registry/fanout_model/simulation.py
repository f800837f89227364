"""Run one fan-out to completion and summarise it against the lower bound."""

from __future__ import annotations

import math

from gpucloud.registry.fanout_model.config import FanoutConfig, FanoutResult, lower_bound_s, percentile, piece_bytes
from gpucloud.registry.fanout_model.network import Network
from gpucloud.registry.fanout_model.strategies import Fanout, OriginOnly, PeerToPeer, TieredMirrors


def simulate(config: FanoutConfig) -> FanoutResult:
    """Run one fan-out to completion and summarise it."""
    size = piece_bytes(config)
    count = math.ceil(config.artifact_bytes / size)
    sizes = [size] * (count - 1) + [config.artifact_bytes - size * (count - 1)]
    network = Network(config)
    fanout: Fanout
    if config.strategy == "origin_only":
        fanout = OriginOnly(config, network, sizes)
    elif config.strategy == "tiered_mirrors":
        fanout = TieredMirrors(config, network, sizes)
    else:
        fanout = PeerToPeer(config, network, sizes)
    fanout.run()
    return summarise(config, network, fanout, size)


def summarise(config: FanoutConfig, network: Network, fanout: Fanout, size: int) -> FanoutResult:
    bound = lower_bound_s(config)
    done = [t for t in fanout.completion if t is not None]  # all of them: `run` raises otherwise
    p50, p99, worst = percentile(done, 0.50), percentile(done, 0.99), max(done)
    origin_bytes = network.sent[network.origin]
    return FanoutResult(
        config=config,
        piece_bytes=size,
        pieces=len(fanout.sizes),
        transfers=network.transfers,
        bound_s=bound,
        completion_s=done,
        p50_s=p50,
        p99_s=p99,
        max_s=worst,
        p50_over_bound=p50 / bound,
        p99_over_bound=p99 / bound,
        max_over_bound=worst / bound,
        origin_egress_bytes=origin_bytes,
        origin_egress_x=origin_bytes / config.artifact_bytes,
        sent_bytes=network.sent[: network.origin],
        transfer_log=network.log,
        peak_up_bytes_per_s=network.peak_up[: network.origin] if config.audit else None,
        peak_down_bytes_per_s=network.peak_down if config.audit else None,
        peak_origin_bytes_per_s=network.peak_up[network.origin] if config.audit else None,
    )
