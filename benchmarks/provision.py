"""Provisioning throughput: N simulated nodes enrolled -> available, then allocated and
cancelled in gangs of 8, through the real stack (Temporal dev server, worker, API and simulated
fleet as separate processes, SQLite).

Baseline, measured in the same run on the same server: trivial workflows with the same number
of activities per node as bring-up (6: read node, 3 transitions, inspect, burn-in), run by one
worker with the same limits. `ratio` = nodes_per_s / baseline_nodes_per_s.

    python benchmarks/provision.py [--nodes N] [--quick]

Prints progress to stderr and one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import sqlalchemy as sa
from temporalio import activity, workflow
from temporalio.worker import Worker

from gpucloud.client import connect
from gpucloud.config import Settings
from gpucloud.stack import Stack, free_port

ACTIVITIES_PER_NODE = 6


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@activity.defn
async def noop_activity(_: str) -> str:
    return "ok"


@workflow.defn(sandboxed=False)
class BaselineWorkflow:
    @workflow.run
    async def run(self, n: int) -> int:
        for _ in range(n):
            await workflow.execute_activity(noop_activity, "x", start_to_close_timeout=timedelta(seconds=30))
        return n


async def baseline(settings: Settings, nodes: int) -> float:
    client = await connect(settings)
    queue = f"baseline-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(max_workers=4) as executor:
        async with Worker(client, task_queue=queue, workflows=[BaselineWorkflow], activities=[noop_activity],
                          activity_executor=executor, max_concurrent_activities=settings.worker_max_activities,
                          max_concurrent_workflow_tasks=100):
            started = time.monotonic()
            handles = []
            for i in range(nodes):
                handles.append(await client.start_workflow(BaselineWorkflow.run, ACTIVITIES_PER_NODE,
                                                           id=f"{queue}-{i}", task_queue=queue))
            gate = asyncio.Semaphore(500)  # bounded result waits (the server limits pollers)

            async def wait(h):
                async with gate:
                    await h.result()

            await asyncio.gather(*(wait(h) for h in handles))
            return nodes / (time.monotonic() - started)


def count_states(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT state, count(*) FROM node GROUP BY state")).all())


def wait_for(engine: sa.Engine, state: str, want: int, what: str, timeout_s: float) -> float:
    started = time.monotonic()
    last = -1
    while time.monotonic() - started < timeout_s:
        counts = count_states(engine)
        have = counts.get(state, 0)
        if have != last:
            log(f"  {what}: {have}/{want} {state}  {dict(sorted(counts.items()))}")
            last = have
        if have >= want:
            return time.monotonic() - started
        time.sleep(0.5)
    raise SystemExit(f"timed out: {what} ({count_states(engine)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="100 nodes, under a minute")
    args = parser.parse_args()
    nodes = 100 if args.quick else args.nodes

    data_dir = Path(tempfile.mkdtemp(prefix="gpucloud-bench-"))
    settings = Settings(data_dir=data_dir, temporal_address=f"127.0.0.1:{free_port()}", api_port=free_port(),
                        sim_port=free_port(), operator_token="bench-token")
    stack = Stack(settings, nodes=nodes, ui_port=free_port(), sim_latency_scale=0.0, headless=True,
                  register_fleet=False)
    try:
        log(f"starting stack in {data_dir}")
        stack.start(on_step=lambda s: log(f"  {s}"))
        log(f"baseline: {nodes} trivial workflows x {ACTIVITIES_PER_NODE} activities")
        baseline_nodes_per_s = asyncio.run(baseline(settings, nodes))
        log(f"  {baseline_nodes_per_s:.1f} workflows/s")

        engine = sa.create_engine(settings.db_url)
        api = httpx.Client(base_url=settings.api_url, headers={"Authorization": "Bearer bench-token"}, timeout=300)
        inventory = httpx.get(f"{settings.sim_url}/v1/inventory").json()
        log(f"bring-up: {nodes} nodes enrolled -> available")
        started = time.monotonic()
        for i in range(0, len(inventory), 500):
            api.post("/v1/nodes:enroll", json={"nodes": inventory[i:i + 500]}).raise_for_status()
        bringup_s = (time.monotonic() - started) + wait_for(engine, "available", nodes, "bring-up", 1800)

        tenant = api.post("/v1/tenants", json={"name": "bench"}).json()
        key = api.post(f"/v1/tenants/{tenant['id']}/api-keys").json()["key"]
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
    print(json.dumps({
        "nodes": nodes, "bringup_s": round(bringup_s, 2), "nodes_per_s": round(nodes_per_s, 2),
        "baseline_nodes_per_s": round(baseline_nodes_per_s, 2), "ratio": round(nodes_per_s / baseline_nodes_per_s, 3),
        "allocations": gangs, "allocate_ready_s": round(allocate_s, 2), "cancel_to_available_s": round(release_s, 2),
    }))


if __name__ == "__main__":
    main()
