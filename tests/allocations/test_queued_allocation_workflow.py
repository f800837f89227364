"""A queued allocation's workflow (`AllocationWorkflow._wait_in_queue`) with its activities
stood in for: it tells the pool's scheduler to plan once when the request joins the queue and
only makes sure the scheduler runs at each recheck after that; a scheduler that could not be
told leaves the request queued (asked again at the next recheck), not failed; and a request
queued for days continues as new before its history reaches Temporal's limit.

The last runs on a dev server of its own whose `limit.historyCount.suggestContinueAsNew` is
30 events, so a few rechecks of 50 ms reach it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from gpucloud.activities.control_db import ControlDbActivities
from gpucloud.activities.scheduling import SchedulerActivities
from gpucloud.adapters.temporal import CodecKeys, data_converter
from gpucloud.devstack.temporal_server import temporal_binary
from gpucloud.models import search_attributes
from gpucloud.models.allocation_states import AllocationStatus
from gpucloud.models.messages import AllocationInput, AllocationStatusInput, AllocationView, EnsureSchedulerInput
from gpucloud.models.workflow_ids import allocation_workflow_id
from gpucloud.workflows.allocation import AllocationWorkflow
from support.codec import CODEC_KEYS
from support.workflow_runs import StandIns, final, queue_name, workers
from support.workflow_tier import RUN_TIMEOUT

pytestmark = pytest.mark.workflow


class QueuedRow:
    """The allocation's row as `load_allocation` reads it: queued until `cancel()`."""

    def __init__(self, allocation_id: str) -> None:
        self.view = AllocationView(
            allocation_id=allocation_id,
            tenant_id="ten_a",
            status=AllocationStatus.QUEUED,
            desired="running",
            node_ids=[],
            gpu_type="H100",
            region="us-east-1",
        )

    def load(self, _req: AllocationInput) -> AllocationView:
        return self.view

    def cancel(self) -> None:
        self.view = self.view.model_copy(update={"status": AllocationStatus.CANCELLING, "desired": "cancelled"})

    def set_status(self, req: AllocationStatusInput) -> AllocationView:
        self.view = self.view.model_copy(update={"status": req.status})
        return self.view


def stand_ins_for(row: QueuedRow, ensure) -> StandIns:
    return StandIns(
        {
            ControlDbActivities.load_allocation: row.load,
            ControlDbActivities.set_allocation_status: row.set_status,
            SchedulerActivities.ensure_pool_scheduler: ensure,
        }
    )


async def run_queued(client: Client, stand_ins: StandIns, row: QueuedRow, *, until) -> tuple[str, object]:
    """Start the queued allocation's workflow (rechecks every 50 ms), cancel its row once
    `until(stand_ins)` holds, and return (its first run's id, its result)."""
    queue = queue_name("queued")
    async with workers(client, [AllocationWorkflow], {queue: stand_ins.for_worker()}):
        handle = await client.start_workflow(
            AllocationWorkflow.run,
            AllocationInput(allocation_id=row.view.allocation_id, queue_recheck_s=0.05),
            id=allocation_workflow_id(row.view.allocation_id),
            task_queue=queue,
            execution_timeout=RUN_TIMEOUT,
        )
        # A 50 ms timer fires within about a second on the dev server.
        await stand_ins.until(lambda: until(stand_ins), timeout_s=20)
        row.cancel()
        result = await handle.result()
    assert handle.first_execution_run_id is not None
    return handle.first_execution_run_id, result


def plan_now_asks(stand_ins: StandIns) -> list[bool]:
    return [arg.plan_now for arg in stand_ins.args(SchedulerActivities.ensure_pool_scheduler)]


async def test_the_scheduler_plans_at_once_for_a_new_request_and_is_only_kept_running_after(temporal_env) -> None:
    row = QueuedRow(f"alloc_{uuid.uuid4().hex[:8]}")
    stand_ins = stand_ins_for(row, None)
    _, result = await run_queued(temporal_env.client, stand_ins, row, until=lambda s: len(plan_now_asks(s)) >= 3)

    assert result.status == AllocationStatus.RELEASED
    asks = plan_now_asks(stand_ins)
    assert asks[0] is True and not any(asks[1:]), asks
    assert all(
        isinstance(a, EnsureSchedulerInput) and a.gpu_type == "H100"
        for a in stand_ins.args(SchedulerActivities.ensure_pool_scheduler)
    )


async def test_a_scheduler_that_cannot_be_told_leaves_the_request_queued_and_is_asked_again(temporal_env) -> None:
    row = QueuedRow(f"alloc_{uuid.uuid4().hex[:8]}")
    answers = iter([final("the engine did not answer in time"), final("still not"), None])
    stand_ins = stand_ins_for(row, lambda _req: next(answers, None))
    _, result = await run_queued(temporal_env.client, stand_ins, row, until=lambda s: len(plan_now_asks(s)) >= 4)

    # Not failed: cancelled from the queue, as a tenant's cancel would end it.
    assert result.status == AllocationStatus.RELEASED
    # Asked to plan now until it was told once; kept running after that.
    assert plan_now_asks(stand_ins)[:4] == [True, True, True, False], plan_now_asks(stand_ins)


@pytest.fixture
async def short_history() -> AsyncIterator[Client]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=search_attributes.ALL,
        data_converter=data_converter(CodecKeys.parse(CODEC_KEYS)),
        dev_server_log_level="error",
        dev_server_extra_args=["--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=30"],
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


async def test_a_request_queued_for_long_continues_as_new_and_is_not_told_to_the_scheduler_again(
    short_history: Client,
) -> None:
    row = QueuedRow(f"alloc_{uuid.uuid4().hex[:8]}")
    stand_ins = stand_ins_for(row, None)
    # Some 11 events a recheck: 6 rechecks are past two runs' worth of 30.
    first_run, result = await run_queued(short_history, stand_ins, row, until=lambda s: len(plan_now_asks(s)) >= 6)

    assert result.status == AllocationStatus.RELEASED
    first = short_history.get_workflow_handle(allocation_workflow_id(row.view.allocation_id), run_id=first_run)
    events = [e async for e in first.fetch_history_events()]
    assert events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW, events[-1]
    assert len(events) < 60, len(events)  # continued near the suggestion, not long after
    # The new run knew the scheduler had been told: one plan asked for, in all the runs.
    asks = plan_now_asks(stand_ins)
    assert asks[0] is True and not any(asks[1:]), asks
