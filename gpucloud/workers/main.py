"""The Temporal worker: every workflow and activity of the control plane on one task queue.

Sync activities (DB transactions) run in a thread pool; agent calls are async. On start the
worker also resumes what a crash may have orphaned (see `recovery`).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from temporalio.client import Client
from temporalio.worker import Worker

from gpucloud.activities.control_db import ControlDbActivities
from gpucloud.activities.host_agent import HostAgentActivities
from gpucloud.activities.reconciler import ReconcilerActivities
from gpucloud.config import Settings
from gpucloud.db import migrate
from gpucloud.workflows.allocation import AllocationWorkflow
from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow
from gpucloud.workflows.reconciler import ReconcileSweepWorkflow

log = logging.getLogger(__name__)

WORKFLOWS = [AllocationWorkflow, NodeOperationWorkflow, ReconcileSweepWorkflow]


def build_worker(client: Client, settings: Settings, *, executor: ThreadPoolExecutor,
                 agent: HostAgentActivities) -> Worker:
    db = ControlDbActivities(settings.db_url, deadline_scale=settings.deadline_scale)
    return Worker(
        client,
        task_queue=settings.task_queue,
        workflows=WORKFLOWS,
        activities=[*db.all(), *agent.all(), *ReconcilerActivities(client, settings).all()],
        activity_executor=executor,
        max_concurrent_activities=settings.worker_max_activities,
        max_concurrent_workflow_tasks=100,
    )


async def run_worker(settings: Settings, *, stop: asyncio.Event | None = None) -> None:
    from gpucloud.client import connect
    from gpucloud.services.schedules import ensure_sweep_schedule
    from gpucloud.workers.recovery import resume_orphans

    migrate(settings.db_url)
    client = await connect(settings)
    agent = HostAgentActivities()
    with ThreadPoolExecutor(max_workers=settings.worker_max_activities, thread_name_prefix="activity") as executor:
        worker = build_worker(client, settings, executor=executor, agent=agent)
        async with worker:
            await ensure_sweep_schedule(client, settings)
            resumed = await resume_orphans(client, settings)
            log.info("worker running on %s (resumed %s)", settings.task_queue, resumed)
            await (stop.wait() if stop else asyncio.Event().wait())
    await agent.aclose()
