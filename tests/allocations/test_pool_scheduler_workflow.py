"""`PoolSchedulerWorkflow` with its plan stood in for: the allocations one plan placed or expired
are all told in one workflow task, not one workflow task's round trip after another (a plan that
placed 64 requests held the next plan back for minutes on a busy worker while nodes sat free,
found by `benchmarks/scheduling.py --stack`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from gpucloud.activities.scheduling import SchedulerActivities
from gpucloud.models.messages import PoolPlanResult, PoolSchedulerInput
from gpucloud.models.workflow_ids import allocation_workflow_id
from gpucloud.workflows.pool_scheduler import PoolSchedulerWorkflow
from support.workflow_runs import StandIns, in_turn, queue_name, workers
from support.workflow_tier import RUN_TIMEOUT

pytestmark = pytest.mark.workflow


async def test_a_plans_allocations_are_told_in_one_workflow_task(temporal_env) -> None:
    placed = [f"alloc_{uuid.uuid4().hex[:8]}" for _ in range(6)]
    expired = [f"alloc_{uuid.uuid4().hex[:8]}"]
    stand_ins = StandIns({SchedulerActivities.plan_pool: PoolPlanResult(placed=placed, expired=expired, queued=0)})
    queue = queue_name("scheduler")
    async with workers(temporal_env.client, [PoolSchedulerWorkflow], {queue: stand_ins.for_worker()}):
        handle = await temporal_env.client.start_workflow(
            PoolSchedulerWorkflow.run,
            PoolSchedulerInput(gpu_type="H100", region="r1", poll_s=0.1),
            id=f"{queue}-{uuid.uuid4().hex[:6]}",
            task_queue=queue,
            execution_timeout=RUN_TIMEOUT,
        )
        assert await handle.result() == 1  # one plan: nothing left queued
        history = await handle.fetch_history()

    signals = [
        e.signal_external_workflow_execution_initiated_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
    ]
    told = sorted(s.workflow_execution.workflow_id for s in signals)
    assert told == sorted(allocation_workflow_id(a) for a in placed + expired)
    assert len({s.workflow_task_completed_event_id for s in signals}) == 1


@asynccontextmanager
async def scheduling(client, stand_ins: StandIns) -> AsyncIterator[WorkflowHandle]:
    """A pool's scheduler (`poll_s` 0.1) on a worker of its own with `stand_ins` for its plan."""
    queue = queue_name("scheduler")
    async with workers(client, [PoolSchedulerWorkflow], {queue: stand_ins.for_worker()}):
        yield await client.start_workflow(
            PoolSchedulerWorkflow.run,
            PoolSchedulerInput(gpu_type="H100", region="r1", poll_s=0.1),
            id=f"{queue}-{uuid.uuid4().hex[:6]}",
            task_queue=queue,
            execution_timeout=RUN_TIMEOUT,
        )


async def test_with_only_reservations_whose_holds_are_ahead_it_sleeps_until_poked(temporal_env) -> None:
    """Nothing queued and the one reservation's hold an hour ahead: no plan every `poll_s` (it
    would change nothing for an hour); a poke (a new request, say) plans at once, and once no
    reservation is open the scheduler ends."""
    stand_ins = StandIns(
        {SchedulerActivities.plan_pool: in_turn(PoolPlanResult(reservations=1, quiet_s=3600), PoolPlanResult())}
    )
    async with scheduling(temporal_env.client, stand_ins) as handle:
        await stand_ins.until(lambda: len(stand_ins.calls) == 1)
        await asyncio.sleep(1.5)  # 15 rounds of poll_s
        assert len(stand_ins.calls) == 1, stand_ins.names
        await handle.signal(PoolSchedulerWorkflow.poke)
        assert await handle.result() == 2


async def test_a_reservation_whose_hold_has_begun_is_planned_every_round(temporal_env) -> None:
    answers = in_turn(*[PoolPlanResult(reservations=1, quiet_s=0)] * 3, PoolPlanResult())
    async with scheduling(temporal_env.client, StandIns({SchedulerActivities.plan_pool: answers})) as handle:
        assert await handle.result() == 4  # three rounds with the reservation open, then none


async def test_a_recheck_only_starts_a_scheduler_where_none_runs_and_a_new_request_asks_it_to_plan(
    temporal_env,
) -> None:
    """The gateway (`poke_pool_scheduler`): `plan_now=False` (a queued request's recheck, the
    sweep) starts the pool's scheduler where none runs and leaves a running one to its round, no
    signal; `plan_now=True` (a request joining the queue) signals it to plan now. No worker serves
    this queue: only what Temporal recorded is read."""
    from gpucloud.adapters.temporal_gateway import poke_pool_scheduler
    from gpucloud.config import Settings
    from gpucloud.models.workflow_ids import pool_scheduler_workflow_id

    settings = Settings(temporal={"task_queue": queue_name("no-worker")})
    region = f"r-{uuid.uuid4().hex[:8]}"
    handle = temporal_env.client.get_workflow_handle(pool_scheduler_workflow_id("H100", region))
    try:
        await poke_pool_scheduler(temporal_env.client, settings, "H100", region, plan_now=False)
        await poke_pool_scheduler(temporal_env.client, settings, "H100", region, plan_now=False)
        first = await handle.describe()
        signals = [
            e
            async for e in handle.fetch_history_events()
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        ]
        assert signals == []
        await poke_pool_scheduler(temporal_env.client, settings, "H100", region, plan_now=True)
        signals = [
            e
            async for e in handle.fetch_history_events()
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        ]
        assert len(signals) == 1
        assert (await handle.describe()).run_id == first.run_id  # the one already running, told
    finally:
        await handle.terminate("test over")
