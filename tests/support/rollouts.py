"""The rollout's workflow and activities on a test's own task queue, as the production worker runs them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from gpucloud.activities.rollout import RolloutActivities
from gpucloud.workflows.rollout import RolloutWorkflow


@asynccontextmanager
async def rollout_worker_with(client: Client, activities: RolloutActivities, task_queue: str) -> AsyncIterator[Worker]:
    """A worker for `RolloutWorkflow` and `activities` on `task_queue`; the activities' clients
    are closed when it stops."""
    with ThreadPoolExecutor(4, thread_name_prefix="rollout-activity") as executor:
        worker = Worker(
            client,
            task_queue=task_queue,
            workflows=[RolloutWorkflow],
            activities=activities.all(),
            activity_executor=executor,
            graceful_shutdown_timeout=timedelta(seconds=5),
        )
        try:
            async with worker:
                yield worker
        finally:
            await activities.aclose()
