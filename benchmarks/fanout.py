"""Weight fan-out benchmark: how long until every node holds the artifact, per strategy.

Runs the discrete-event simulator (`gpucloud.sim.fanout`) for origin-only, tiered mirrors and
p2p on the ARCHITECTURE.md scenario (141 GB to 1,000 nodes, 100 Gb/s NICs and origin, 64 MiB
chunks), or with --quick on a smaller one that finishes in seconds. A table goes to stderr; the
last stdout line is one JSON object with the figures, each time also as a multiple of the lower
bound (size / NIC + ceil(log2 N) x chunk / NIC).

    python benchmarks/fanout.py [--quick] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gpucloud.sim.fanout import STRATEGIES, FanoutConfig, FanoutResult, simulate

GIB = 1 << 30
FULL = {"nodes": 1000, "artifact_bytes": 141 * 10**9}
QUICK = {"nodes": 200, "artifact_bytes": 16 * GIB}


def run_all(scenario: dict, *, seed: int, console: Console) -> dict[str, tuple[FanoutResult, float]]:
    results: dict[str, tuple[FanoutResult, float]] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=len(STRATEGIES))
        for strategy in STRATEGIES:
            progress.update(task, description=f"simulating {strategy}")
            started = time.perf_counter()
            result = simulate(FanoutConfig(strategy=strategy, seed=seed, **scenario))
            results[strategy] = (result, time.perf_counter() - started)
            progress.advance(task)
    return results


def table(results: dict[str, tuple[FanoutResult, float]]) -> Table:
    any_result = next(iter(results.values()))[0]
    config = any_result.config
    title = (
        f"{config.artifact_bytes / 1e9:.1f} GB to {config.nodes} nodes, "
        f"{config.nic_up_gbps:g} Gb/s NICs, {config.origin_gbps:g} Gb/s origin, "
        f"bound {any_result.bound_s:.2f} s"
    )
    out = Table(title=title)
    for column in ("strategy", "p50 s", "p99 s", "max s", "p50/bound", "p99/bound", "egress/size", "wall s"):
        out.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for strategy, (result, wall) in results.items():
        out.add_row(
            strategy,
            f"{result.p50_s:,.2f}",
            f"{result.p99_s:,.2f}",
            f"{result.max_s:,.2f}",
            f"{result.p50_over_bound:,.2f}x",
            f"{result.p99_over_bound:,.2f}x",
            f"{result.origin_egress_x:,.2f}x",
            f"{wall:.1f}",
        )
    return out


def summary(results: dict[str, tuple[FanoutResult, float]], *, quick: bool) -> dict:
    p2p, origin_only, tiered = (results[name][0] for name in ("p2p", "origin_only", "tiered_mirrors"))
    return {
        "scenario": "quick" if quick else "full",
        "nodes": p2p.config.nodes,
        "artifact_bytes": p2p.config.artifact_bytes,
        "chunk_bytes": p2p.config.chunk_bytes,
        "piece_bytes": p2p.piece_bytes,
        "bound_s": round(p2p.bound_s, 4),
        "p2p_p50_s": round(p2p.p50_s, 3),
        "p2p_p99_s": round(p2p.p99_s, 3),
        "p2p_p50_over_bound": round(p2p.p50_over_bound, 4),
        "p2p_p99_over_bound": round(p2p.p99_over_bound, 4),
        "p2p_max_over_bound": round(p2p.max_over_bound, 4),
        "p2p_origin_egress_x": round(p2p.origin_egress_x, 4),
        "origin_only_p99_s": round(origin_only.p99_s, 1),
        "origin_only_p99_over_bound": round(origin_only.p99_over_bound, 2),
        "tiered_p99_s": round(tiered.p99_s, 2),
        "tiered_p99_over_bound": round(tiered.p99_over_bound, 2),
        "tiered_origin_egress_x": round(tiered.origin_egress_x, 2),
        "sim_wall_s": {name: round(wall, 2) for name, (_, wall) in results.items()},
        "real_nodes_verified": None,
        "real_origin_egress_x": None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller scenario, finishes in seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # A pipe gets rich's 80 columns, too narrow for the table; a terminal keeps its own width.
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 110)
    results = run_all(QUICK if args.quick else FULL, seed=args.seed, console=console)
    console.print(table(results))
    print(json.dumps(summary(results, quick=args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
