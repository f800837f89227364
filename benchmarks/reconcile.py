"""Fleet reconciler at scale: N simulated nodes (default 10,000) brought up, a sweep over the
converged fleet, and 1% of active nodes drifting (wiped behind the control plane's back)
until every one is restored. Real stack: Temporal dev server, worker, API and simulated fleet
as separate processes, SQLite; agents heartbeat every 5 s.

Bring-up runs in batches (`BringupBatchWorkflow`, `bringup_batch_size` nodes per workflow, six
activities per batch). Baselines, measured in the same run on the same machine:
- `baseline_nodes_per_s`: the engine alone, trivial workflows with the same activity count per
  node (six no-op activities per batch of nodes); `ratio` = nodes_per_s / baseline_nodes_per_s.
- `agent_floor_nodes_per_s`: bring-up's agent calls alone (inspect and burn-in per node straight
  to the simulated agents, as concurrent as the worker's HTTP pool), no engine, no database;
  `ratio_vs_agent_floor` = nodes_per_s / agent_floor_nodes_per_s.

    python benchmarks/reconcile.py [--nodes N] [--quick]

Prints progress to stderr and one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from common import add_temporal_db_arg, agent_floor, baseline, bench_stack, log, onboard_tenant, wait_for

from gpucloud import bootstrap
from gpucloud.activities.host_agent import BATCH_CONCURRENCY
from gpucloud.adapters.temporal import codec_keys, connect
from gpucloud.config import Settings
from gpucloud.models.messages import SweepInput
from gpucloud.workflows.reconciler import ReconcileSweepWorkflow


async def one_sweep(settings: Settings):
    client = await connect(settings.temporal, keys=codec_keys(settings))
    started = time.monotonic()
    result = await client.execute_workflow(
        ReconcileSweepWorkflow.run,
        SweepInput(),
        id=f"bench-sweep-{uuid.uuid4().hex[:6]}",
        task_queue=settings.temporal.task_queue,
    )
    return time.monotonic() - started, result


def drifted(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM node WHERE drifted")).scalar_one()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="200 nodes, about a minute")
    add_temporal_db_arg(parser)
    args = parser.parse_args()
    nodes = 200 if args.quick else args.nodes

    settings, stack, data_dir = bench_stack(nodes, args.temporal_db, reconciler={"sweep_interval_s": 15.0})
    try:
        log(f"starting stack in {data_dir}")
        stack.start(on_step=lambda s: log(f"  {s}"))
        batch = settings.reconciler.bringup_batch_size
        log(f"baseline: trivial workflows for {nodes} nodes, one per {batch}")
        baseline_nodes_per_s = asyncio.run(baseline(settings, nodes, nodes_per_workflow=batch))
        log(f"  {baseline_nodes_per_s:.1f} nodes/s")

        engine = sa.create_engine(settings.database_url)
        api = httpx.Client(base_url=settings.api_url, headers={"Authorization": "Bearer bench-token"}, timeout=600)
        sim = httpx.Client(
            base_url=settings.sim_url, headers={"Authorization": f"Bearer {settings.operator_token}"}, timeout=600
        )
        inventory = sim.get("/v1/inventory").json()

        def heartbeat(client: httpx.Client = api) -> dict:
            beats = sim.get("/v1/heartbeats").json()
            drifted_ids: list[str] = []
            for i in range(0, len(beats), 5000):
                resp = client.post("/v1/agents/heartbeats", json={"heartbeats": beats[i : i + 5000]})
                resp.raise_for_status()
                drifted_ids += resp.json()["drifted"]
            return {"drifted": drifted_ids}

        log(f"bring-up: {nodes} nodes enrolled -> available")
        started = time.monotonic()
        for i in range(0, len(inventory), 1000):
            api.post("/v1/nodes:enroll", json={"nodes": inventory[i : i + 1000]}).raise_for_status()
        bringup_s = (time.monotonic() - started) + wait_for(engine, "available", nodes, "bring-up", 7200)
        log(f"  {nodes} available in {bringup_s:.1f} s ({nodes / bringup_s:.1f} nodes/s)")
        # From here to the drift the fleet reports every 5 s, as agents do: the floor runs longer
        # than the heartbeat timeout, and a silent fleet would be marked unreachable meanwhile.
        quiet = threading.Event()

        def keep_beating() -> None:
            with httpx.Client(base_url=settings.api_url, headers=api.headers, timeout=600) as own:
                while True:
                    heartbeat(own)
                    if quiet.wait(5.0):
                        return

        beating = threading.Thread(target=keep_beating, name="heartbeats", daemon=True)
        beating.start()

        log("agent floor: bring-up's agent calls alone")
        # As many calls in flight as the batches make: BATCH_CONCURRENCY per running batch
        # activity, as many batches as the limit on node operations runs at once, within the
        # worker's activity slots and its HTTP pool (200 connections).
        batches = min(
            -(-nodes // batch),
            max(1, settings.reconciler.max_concurrent_node_ops // batch),
            settings.temporal.worker_max_activities,
        )
        in_flight = min(200, BATCH_CONCURRENCY * batches)
        agent_floor_nodes_per_s = asyncio.run(
            agent_floor(
                [n["agent_url"] for n in inventory], concurrency=in_flight, issuer=bootstrap.token_issuer(settings)
            )
        )
        log(f"  {agent_floor_nodes_per_s:.1f} nodes/s")

        log("steady state: one sweep over the converged fleet")
        steady_sweep_s, steady = asyncio.run(one_sweep(settings))
        log(f"  {steady_sweep_s:.3f} s, {steady}")
        quiet.set()
        beating.join()

        drift_n = max(8, nodes // 100) // 8 * 8
        key = onboard_tenant(api, "bench")
        tenant_api = httpx.Client(base_url=settings.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
        for _ in range(drift_n // 8):
            tenant_api.post(
                "/v1/allocations", json={"gpu_type": "H100", "node_count": 8, "region": "us-east-1"}
            ).raise_for_status()
        wait_for(engine, "active", drift_n, "allocate the nodes that will drift", 3600)
        with engine.connect() as conn:
            victims = [r[0] for r in conn.execute(sa.text("SELECT id FROM node WHERE state = 'active'"))]
        log(f"drift: {len(victims)} active nodes wiped behind the control plane's back")
        started = time.monotonic()
        for node_id in victims:
            sim.post(f"/v1/nodes/{node_id}/drift", json={"kind": "wipe"}).raise_for_status()
        reported = heartbeat()["drifted"]  # agents report; the API reconciles them at once
        while drifted(engine):
            time.sleep(1.0)
            heartbeat()
        drift_converge_s = time.monotonic() - started
        log(f"  {len(reported)} reported, all restored in {drift_converge_s:.1f} s")
    finally:
        stack.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    nodes_per_s = nodes / bringup_s
    print(
        json.dumps(
            {
                "temporal_db": args.temporal_db,
                "nodes": nodes,
                "bringup_s": round(bringup_s, 1),
                "nodes_per_s": round(nodes_per_s, 2),
                "baseline_nodes_per_s": round(baseline_nodes_per_s, 2),
                "ratio": round(nodes_per_s / baseline_nodes_per_s, 3),
                "agent_floor_nodes_per_s": round(agent_floor_nodes_per_s, 2),
                "ratio_vs_agent_floor": round(nodes_per_s / agent_floor_nodes_per_s, 3),
                "bringup_batch_size": batch,
                "steady_sweep_s": round(steady_sweep_s, 3),
                "steady_starts": steady.started,
                "steady_candidates": steady.candidates,
                "drifted_nodes": len(victims),
                "drift_converge_s": round(drift_converge_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
