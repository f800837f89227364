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
from gpucloud.activities.fabric import FabricActivities
from gpucloud.activities.faults import FaultHook
from gpucloud.activities.host_agent import HostAgentActivities
from gpucloud.activities.ledger import LedgerActivities
from gpucloud.activities.reconciler import ReconcilerActivities
from gpucloud.activities.rollout import RolloutActivities
from gpucloud.activities.storage import TenantStorageActivities
from gpucloud.activities.tenant import TenantActivities
from gpucloud.config import Settings
from gpucloud.db import migrate
from gpucloud.registry.config import build_stores
from gpucloud.storage.bootstrap import open_tenant_store
from gpucloud.workflows.allocation import AllocationWorkflow
from gpucloud.workflows.billing_close import BillingCatchUpWorkflow, BillingCloseWorkflow
from gpucloud.workflows.bringup import BringupBatchWorkflow
from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow
from gpucloud.workflows.reconciler import ReconcileSweepWorkflow
from gpucloud.workflows.rollout import RolloutWorkflow
from gpucloud.workflows.tenant import TenantOffboardingWorkflow, TenantOnboardingWorkflow

log = logging.getLogger(__name__)

WORKFLOWS = [
    AllocationWorkflow,
    BringupBatchWorkflow,
    NodeOperationWorkflow,
    ReconcileSweepWorkflow,
    BillingCloseWorkflow,
    BillingCatchUpWorkflow,
    TenantOnboardingWorkflow,
    TenantOffboardingWorkflow,
    RolloutWorkflow,
]


def build_worker(
    client: Client,
    settings: Settings,
    *,
    executor: ThreadPoolExecutor,
    agent: HostAgentActivities,
    fault_hook: FaultHook | None = None,
) -> Worker:
    """`fault_hook` lets tests fail tenant steps (see `activities.faults`)."""
    db = ControlDbActivities(
        settings.db_url,
        deadline_scale=settings.deadline_scale,
        backoff_base_s=settings.backoff_base_s,
        backoff_cap_s=settings.backoff_cap_s,
    )
    rollout = RolloutActivities(
        tracker_url=settings.tracker_url,
        db_url=settings.db_url,
        manifests=build_stores(data_dir=settings.data_dir).manifests,
    )
    return Worker(
        client,
        task_queue=settings.task_queue,
        workflows=WORKFLOWS,
        activities=[
            *db.all(),
            *agent.all(),
            *ReconcilerActivities(client, settings).all(),
            *LedgerActivities(settings.ledger_url).all(),
            *FabricActivities.from_settings(settings).all(),
            *TenantActivities(settings, client=client, fault_hook=fault_hook).all(),
            *TenantStorageActivities(open_tenant_store(settings), fault_hook=fault_hook).all(),
            *rollout.all(),
        ],
        activity_executor=executor,
        max_concurrent_activities=settings.worker_max_activities,
        max_concurrent_workflow_tasks=100,
    )


async def run_worker(settings: Settings, *, stop: asyncio.Event | None = None) -> None:
    from gpucloud.adapters.temporal import connect
    from gpucloud.services.schedules import ensure_billing_close_schedule, ensure_sweep_schedule
    from gpucloud.workers.recovery import resume_orphans

    migrate(settings.db_url)
    client = await connect(settings)
    agent = HostAgentActivities.from_settings(settings)
    with ThreadPoolExecutor(max_workers=settings.worker_max_activities, thread_name_prefix="activity") as executor:
        worker = build_worker(client, settings, executor=executor, agent=agent)
        async with worker:
            await ensure_sweep_schedule(client, settings)
            await ensure_billing_close_schedule(client, settings)
            resumed = await resume_orphans(client, settings)
            log.info("worker running on %s (resumed %s)", settings.task_queue, resumed)
            await (stop.wait() if stop else asyncio.Event().wait())
    await agent.aclose()
