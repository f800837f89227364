"""Provisioning throughput: N simulated nodes enrolled -> available, then allocated and
cancelled in gangs of 8, through the real stack (Temporal dev server, worker, API and simulated
fleet as separate processes, SQLite).

Baseline, measured in the same run on the same server: trivial workflows with the same number
of activities per node as bring-up (6 per batch of `bringup_batch_size` nodes: read the nodes,
3 transitions, inspect, burn-in), run by one worker with the same limits.
`ratio` = nodes_per_s / baseline_nodes_per_s.

    python benchmarks/provision.py [--nodes N] [--quick]

Prints progress to stderr and one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    ACTIVITIES_PER_NODE,
    add_temporal_db_arg,
    baseline,
    bench_stack,
    log,
    onboard_tenant,
    wait_for,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="100 nodes, under a minute")
    add_temporal_db_arg(parser)
    args = parser.parse_args()
    nodes = 100 if args.quick else args.nodes

    settings, stack, data_dir = bench_stack(nodes, args.temporal_db)
    try:
        log(f"starting stack in {data_dir}")
        stack.start(on_step=lambda s: log(f"  {s}"))
        batch = settings.reconciler.bringup_batch_size
        log(f"baseline: trivial workflows x {ACTIVITIES_PER_NODE} activities for {nodes} nodes, one per {batch}")
        baseline_nodes_per_s = asyncio.run(baseline(settings, nodes, nodes_per_workflow=batch))
        log(f"  {baseline_nodes_per_s:.1f} nodes/s")

        engine = sa.create_engine(settings.database_url)
        api = httpx.Client(base_url=settings.api_url, headers={"Authorization": "Bearer bench-token"}, timeout=300)
        from gpucloud.sim.client import SimFleetClient

        with SimFleetClient(settings.sim_url, token=settings.operator_token, timeout_s=60) as sim:
            inventory = sim.inventory()
        log(f"bring-up: {nodes} nodes enrolled -> available")
        started = time.monotonic()
        for i in range(0, len(inventory), 500):
            api.post("/v1/nodes:enroll", json={"nodes": inventory[i : i + 500]}).raise_for_status()
        bringup_s = (time.monotonic() - started) + wait_for(engine, "available", nodes, "bring-up", 1800)

        key = onboard_tenant(api, "bench")
        tenant_api = httpx.Client(base_url=settings.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=300)
        gangs = nodes // 8
        log(f"allocate: {gangs} allocations of 8 nodes")
        started = time.monotonic()
        ids = []
        for _ in range(gangs):
            resp = tenant_api.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 8, "region": "us-east-1"})
            resp.raise_for_status()
            ids.append(resp.json()["allocation"]["id"])
        allocate_s = (time.monotonic() - started) + wait_for(engine, "active", gangs * 8, "provisioning", 1800)
        log("cancel all; nodes release -> wipe -> burn-in -> available")
        started = time.monotonic()
        for alloc_id in ids:
            tenant_api.post(f"/v1/allocations/{alloc_id}/cancel").raise_for_status()
        release_s = (time.monotonic() - started) + wait_for(engine, "available", nodes, "release", 1800)
    finally:
        stack.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    nodes_per_s = nodes / bringup_s
    print(
        json.dumps(
            {
                "temporal_db": args.temporal_db,
                "nodes": nodes,
                "bringup_s": round(bringup_s, 2),
                "nodes_per_s": round(nodes_per_s, 2),
                "baseline_nodes_per_s": round(baseline_nodes_per_s, 2),
                "ratio": round(nodes_per_s / baseline_nodes_per_s, 3),
                "allocations": gangs,
                "allocate_ready_s": round(allocate_s, 2),
                "cancel_to_available_s": round(release_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
