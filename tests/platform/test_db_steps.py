"""A workflow's DB steps run as local activities (`gpucloud/workflows/db_steps.py`): no activity
task goes through the Temporal server, and a failure reaches the workflow inside an
`ActivityError` as a remote activity's does, so the workflows' handlers take both alike."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from temporalio.api.enums.v1 import EventType

from support.db_step_workflow import Rows, UsesDbSteps
from support.workflow_runs import queue_name, workers

pytestmark = pytest.mark.workflow


async def test_db_steps_are_local_and_their_failures_arrive_as_activity_errors(temporal_env):
    client = temporal_env.client
    rows = Rows()
    queue = queue_name("db-steps")
    with ThreadPoolExecutor(2) as threads:  # the control DB's activities are sync, as here
        async with workers(client, [UsesDbSteps], {queue: [rows.answer, rows.refuse]}, activity_executor=threads):
            handle = await client.start_workflow(UsesDbSteps.run, "n1", id=queue_name("db-steps"), task_queue=queue)
            seen = await handle.result()
    assert seen == ["N1", "db_step_test_refuse", "StateConflict", "True", "row n1 moved"]
    kinds = [event.event_type async for event in handle.fetch_history_events()]
    assert kinds.count(EventType.EVENT_TYPE_MARKER_RECORDED) == 2  # both steps, recorded as markers
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED not in kinds
