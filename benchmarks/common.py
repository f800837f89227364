"""Shared by the control-plane benchmarks: the engine baseline and DB polling."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from temporalio import activity, workflow
from temporalio.worker import Worker

from gpucloud.adapters.temporal import codec_keys, connect
from gpucloud.config import Settings
from gpucloud.web.service_tokens import agent_audience
from gpucloud.workflows.bringup import STEPS as BRINGUP_STEPS

# Bring-up's activities per workflow: read the nodes, 3 transitions, inspect, burn-in (a batch
# of `bringup_batch_size` nodes takes the same six, each for the whole batch).
ACTIVITIES_PER_NODE = 6
# The agent actions a bring-up takes, in order (inspect, wipe, burn-in), from its step table.
BRINGUP_ACTIONS = tuple(action for step in BRINGUP_STEPS.values() if (action := getattr(step, "action", None)))


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


async def baseline(settings: Settings, nodes: int, *, nodes_per_workflow: int = 1) -> float:
    """Trivial workflows of ACTIVITIES_PER_NODE no-op activities, one per `nodes_per_workflow`
    nodes, on the same server and with the same worker limits: the engine's ceiling for the
    same activity count per node. Returns nodes per second."""
    workflows = -(-nodes // nodes_per_workflow)
    return nodes_per_workflow * await _baseline_workflows(settings, workflows)


async def agent_floor(agent_urls: list[str], *, concurrency: int, issuer=None) -> float:
    """Bring-up's agent calls alone (inspect, wipe and burn-in per node, the three actions a
    bring-up takes, `concurrency` at a time, as many as the batches have in flight), with no
    engine and no database: nodes per second."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    run = uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as http:

        async def node(url: str) -> None:
            async with gate:
                for action in BRINGUP_ACTIONS:
                    # Signed as the control plane signs its calls (the agents check it).
                    auth = {"Authorization": f"Bearer {issuer.mint(agent_audience(url.rsplit('/', 1)[1]))}"}
                    resp = await http.post(
                        f"{url}/actions/{action}",
                        json={"request_id": f"floor-{run}-{url}-{action}"},
                        headers=auth if issuer else {},
                    )
                    resp.raise_for_status()

        started = time.monotonic()
        await asyncio.gather(*(node(u) for u in agent_urls))
        return len(agent_urls) / (time.monotonic() - started)


async def _baseline_workflows(settings: Settings, nodes: int) -> float:
    client = await connect(settings.temporal, keys=codec_keys(settings))
    queue = f"baseline-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(max_workers=4) as executor:
        async with Worker(
            client,
            task_queue=queue,
            workflows=[BaselineWorkflow],
            activities=[noop_activity],
            activity_executor=executor,
            max_concurrent_activities=settings.temporal.worker_max_activities,
            max_concurrent_workflow_tasks=100,
        ):
            started = time.monotonic()
            handles = []
            for i in range(nodes):
                handles.append(
                    await client.start_workflow(
                        BaselineWorkflow.run, ACTIVITIES_PER_NODE, id=f"{queue}-{i}", task_queue=queue
                    )
                )
            gate = asyncio.Semaphore(500)  # bounded result waits (the server limits pollers)

            async def wait(h):
                async with gate:
                    await h.result()

            await asyncio.gather(*(wait(h) for h in handles))
            return nodes / (time.monotonic() - started)


def reset_postgres(url: str) -> None:
    """A fresh `public` schema in the database at `url`: the benchmark's fleet and tenants only."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()


def onboard_tenant(api, name: str, *, timeout_s: float = 120) -> str:
    """Onboard a tenant through the API (operator client `api`) and wait until it is active;
    returns its first API key. It is granted any type in any region (a tenant holds only what
    is granted), up to 1,024 nodes of 8."""
    resp = api.post("/v1/tenants", json={"name": name, "quotas": [{"gpu_type": "*", "region": "*", "max_gpus": 8192}]})
    resp.raise_for_status()
    accepted = resp.json()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = api.get(f"/v1/operations/{accepted['operation']['id']}").json()["status"]
        if status == "succeeded":
            return accepted["api_key"]["key"]
        if status == "failed":
            raise SystemExit(f"onboarding {name} failed")
        time.sleep(0.2)
    raise SystemExit(f"timed out onboarding {name}")


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


def bring_up_fleet(api, settings: Settings, engine, nodes: int) -> None:
    """Enroll the simulated fleet's nodes through the API (500 a request) and wait until every
    one is available."""
    from gpucloud.sim.client import SimFleetClient

    with SimFleetClient(settings.sim_url, token=settings.operator_token, timeout_s=60) as sim:
        inventory = sim.inventory()
    log(f"bring-up: {nodes} nodes")
    for i in range(0, len(inventory), 500):
        api.post("/v1/nodes:enroll", json={"nodes": inventory[i : i + 500]}).raise_for_status()
    wait_for(engine, "available", nodes, "bring-up", 1800)


def add_temporal_db_arg(parser) -> None:
    parser.add_argument(
        "--temporal-db",
        choices=("memory", "file"),
        default="memory",
        help="Temporal's state in memory (default: measures the engine) or in a SQLite file "
        "as `gpucloud up` keeps it (measures this machine's disk too)",
    )


def bench_stack(nodes: int, temporal_db: str, *, sim_heartbeat_s: float = 0, **settings_overrides):
    """A private stack on free ports in a temp dir, fleet not registered (the benchmark enrolls it);
    the simulated agents push heartbeats every `sim_heartbeat_s` (0: never)."""
    import tempfile
    from pathlib import Path

    from gpucloud.devstack.stack import Stack, free_port

    data_dir = Path(tempfile.mkdtemp(prefix="gpucloud-bench-"))
    settings = Settings(
        data_dir=data_dir,
        temporal={"address": f"127.0.0.1:{free_port()}"},
        api={"port": free_port(), "operator_token": "bench-token", **settings_overrides.pop("api", {})},
        agent={"sim_port": free_port()},
        **settings_overrides,
    )
    stack = Stack(
        settings,
        nodes=nodes,
        ui_port=free_port(),
        sim_latency_scale=0.0,
        headless=True,
        register_fleet=False,
        temporal_persist=temporal_db == "file",
        sim_heartbeat_s=sim_heartbeat_s,
    )
    return settings, stack, data_dir


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def history_profile(settings: Settings, workflow_ids: list[str], *, since: datetime) -> dict[str, dict]:
    """Where the time went in these workflows' histories after `since`: for every activity type
    (and for workflow tasks), how many ran, how long each waited in its task queue for a worker
    slot (scheduled -> started) and how long it ran (started -> closed), p50 and p99 seconds."""
    return asyncio.run(_history_profile(settings, workflow_ids, since))


async def _history_profile(settings: Settings, workflow_ids: list[str], since: datetime) -> dict[str, dict]:
    from temporalio.api.enums.v1 import EventType

    client = await connect(settings.temporal, keys=codec_keys(settings))
    waits: dict[str, list[float]] = defaultdict(list)
    runs: dict[str, list[float]] = defaultdict(list)
    scheduled: dict[int, tuple[str, datetime]] = {}
    started: dict[int, datetime] = {}
    closing = {
        EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: "activity_task_completed_event_attributes",
        EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED: "activity_task_failed_event_attributes",
        EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT: "activity_task_timed_out_event_attributes",
        EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED: "workflow_task_completed_event_attributes",
    }
    for workflow_id in workflow_ids:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        for event in history.events:
            at = event.event_time.ToDatetime(tzinfo=UTC)
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                name = event.activity_task_scheduled_event_attributes.activity_type.name
                scheduled[event.event_id] = (name, at)
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
                scheduled[event.event_id] = ("(workflow task)", at)
            elif event.event_type in (
                EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED,
                EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
            ):
                attrs = (
                    event.activity_task_started_event_attributes
                    if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
                    else event.workflow_task_started_event_attributes
                )
                name, queued_at = scheduled.get(attrs.scheduled_event_id, ("?", at))
                if queued_at >= since:
                    waits[name].append((at - queued_at).total_seconds())
                    started[attrs.scheduled_event_id] = at
            elif event.event_type in closing:
                attrs = getattr(event, closing[event.event_type])
                begun = started.pop(attrs.scheduled_event_id, None)
                if begun is not None:
                    runs[scheduled[attrs.scheduled_event_id][0]].append((at - begun).total_seconds())
        scheduled.clear()
        started.clear()

    def pct(values: list[float], q: float) -> float | None:
        found = percentile(values, q)
        return None if found is None else round(found, 3)

    return {
        name: {
            "count": len(waits[name]),
            "queued_p50_s": pct(waits[name], 50),
            "queued_p99_s": pct(waits[name], 99),
            "run_p50_s": pct(runs[name], 50),
            "run_p99_s": pct(runs[name], 99),
        }
        for name in sorted(waits, key=lambda n: -sum(waits[n]))
    }
