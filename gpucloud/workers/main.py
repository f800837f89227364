"""The Temporal workers: the control plane's (every workflow and activity on one task queue) and
the evaluation worker (the one activity that runs tenants' evaluation code, on a queue of its
own).

Sync activities (DB transactions) run in a thread pool; agent calls are async. On start the
control plane's worker also resumes what a crash may have orphaned (see `recovery`). The
evaluation worker is its own process (`gpucloud worker --role evaluation`) with settings that
hold no platform secret (`Settings.for_evaluation_worker`): code a tenant wrote never runs in a
process that holds one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

from gpucloud import bootstrap
from gpucloud.activities.bmc import BmcActivities
from gpucloud.activities.control_db import ControlDbActivities
from gpucloud.activities.evaluation import EvaluationActivities
from gpucloud.activities.fabric import FabricActivities
from gpucloud.activities.faults import FaultHook
from gpucloud.activities.host_agent import HostAgentActivities
from gpucloud.activities.incidents import IncidentActivities
from gpucloud.activities.ledger import LedgerActivities
from gpucloud.activities.reconciler import ReconcilerActivities
from gpucloud.activities.rollout import RolloutActivities
from gpucloud.activities.scheduling import SchedulerActivities
from gpucloud.activities.storage import TenantStorageActivities
from gpucloud.activities.tenant import TenantActivities
from gpucloud.bootstrap import ControlPlane
from gpucloud.config import Settings
from gpucloud.observability import tracing
from gpucloud.services.agent_enrollment import CONFIG_DRIVE_PATH
from gpucloud.web.metrics import TemporalMetrics, install_metrics
from gpucloud.workflows.allocation import AllocationWorkflow
from gpucloud.workflows.billing_close import BillingCatchUpWorkflow, BillingCloseWorkflow
from gpucloud.workflows.bringup import BringupBatchWorkflow
from gpucloud.workflows.evaluation import VersionEvaluationWorkflow
from gpucloud.workflows.incident import IncidentWorkflow
from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow
from gpucloud.workflows.pool_scheduler import PoolSchedulerWorkflow
from gpucloud.workflows.power import NodePowerWorkflow
from gpucloud.workflows.reconciler import ReconcileSweepWorkflow
from gpucloud.workflows.rollout import RolloutWorkflow
from gpucloud.workflows.tenant import TenantOffboardingWorkflow, TenantOnboardingWorkflow

log = logging.getLogger(__name__)

WORKFLOWS = [
    AllocationWorkflow,
    BringupBatchWorkflow,
    NodeOperationWorkflow,
    NodePowerWorkflow,
    ReconcileSweepWorkflow,
    BillingCloseWorkflow,
    BillingCatchUpWorkflow,
    TenantOnboardingWorkflow,
    TenantOffboardingWorkflow,
    RolloutWorkflow,
    VersionEvaluationWorkflow,
    IncidentWorkflow,
    PoolSchedulerWorkflow,
]


def build_worker(
    client: Client, cp: ControlPlane, *, executor: ThreadPoolExecutor, fault_hook: FaultHook | None = None
) -> Worker:
    """Every workflow and activity on the task queue, the activities over `cp`'s adapters.
    `fault_hook` lets tests fail tenant steps (see `activities.faults`)."""
    settings = cp.settings
    db = ControlDbActivities(
        cp.db,
        deadline_scale=settings.reconciler.deadline_scale,
        backoff_base_s=settings.reconciler.backoff_base_s,
        backoff_cap_s=settings.reconciler.backoff_cap_s,
    )
    agent = HostAgentActivities(
        cp.agents,
        db=cp.db,
        rotation=bootstrap.wipe_rotation(cp),
        batch_attempts=settings.agent.batch_attempts,
        batch_retry_base_s=settings.agent.batch_retry_base_s,
    )
    rollout = RolloutActivities(
        tracker_url=settings.tracker.url,
        db=cp.db,
        manifests=cp.registry.manifests,
        agents=cp.agents,
        issuer=bootstrap.token_issuer(settings),
    )
    tenant = TenantActivities(cp.db, fabric=cp.fabric, ledger=cp.ledger, fault_hook=fault_hook)
    return Worker(
        client,
        task_queue=settings.temporal.task_queue,
        workflows=WORKFLOWS,
        activities=[
            *db.all(),
            *agent.all(),
            *ReconcilerActivities(client, cp.db, settings, fabric=cp.fabric).all(),
            *SchedulerActivities(client, cp.db, settings).all(),
            *LedgerActivities(cp.ledger, cp.db).all(),
            *BmcActivities(
                cp.db,
                cp.bmcs,
                boot_wait_s=settings.bmc.boot_wait_s,
                firmware_image_uri=settings.bmc.firmware_image_uri,
                clean_image=(settings.bmc.clean_image_url, settings.bmc.clean_image_sha256),
                enrollment=bootstrap.enrollment_tokens(cp),
                config_drive_url=f"{settings.api_url}{CONFIG_DRIVE_PATH}",
            ).all(),
            *FabricActivities(cp.db, cp.fabric).all(),
            *IncidentActivities(cp.db).all(),
            *tenant.all(),
            *TenantStorageActivities(cp.tenant_store, fault_hook=fault_hook).all(),
            *rollout.all(),
            *EvaluationActivities(
                cp.db,
                cp.registry,
                bootstrap.evaluator_signer(settings),
                issuer=bootstrap.token_issuer(settings),
                api_url=settings.api_url,
                token_ttl_s=settings.registry.evaluation_token_ttl_s,
            ).all(),
        ],
        activity_executor=executor,
        max_concurrent_activities=settings.temporal.worker_max_activities,
        max_concurrent_workflow_tasks=100,
        graceful_shutdown_timeout=timedelta(seconds=settings.temporal.worker_drain_s),
    )


async def run_worker(settings: Settings, *, stop: asyncio.Event | None = None) -> None:
    from gpucloud.adapters.temporal_gateway import ensure_billing_close_schedule, ensure_sweep_schedule
    from gpucloud.services.recovery import resume_orphans

    cp = bootstrap.control_plane(settings)
    cp.db.prepare(migrate_on_start=settings.migrates_on_start)
    for missing in bootstrap.unconfigured(settings):
        log.warning("running with %s", missing)
    tracing.configure(settings, "worker")
    sdk_metrics = TemporalMetrics().start()
    client = await bootstrap.temporal_client(settings, runtime=sdk_metrics.runtime)
    http = None
    if settings.telemetry.worker_port is not None:
        http = serve_worker_http(settings, cp, client, before_scrape=sdk_metrics.drain)
    try:
        with ThreadPoolExecutor(
            max_workers=settings.temporal.worker_max_activities, thread_name_prefix="activity"
        ) as executor:
            worker = build_worker(client, cp, executor=executor)
            async with worker:
                await ensure_sweep_schedule(client, settings)
                await ensure_billing_close_schedule(client, settings)
                resumed = await resume_orphans(client, cp.db, settings)
                log.info("worker running on %s (resumed %s)", settings.temporal.task_queue, resumed)
                await (stop.wait() if stop else asyncio.Event().wait())
    finally:
        if http is not None:
            server, serving = http
            server.should_exit = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(serving, 5)
        sdk_metrics.stop()
        await cp.aclose()


def serve_worker_http(
    settings: Settings, cp: bootstrap.ControlPlane, client: Client, *, before_scrape: Callable[[], None]
) -> tuple[Any, asyncio.Task]:
    """`/healthz`, `/readyz` (the database, Temporal, the object store its tenant storage and
    registry activities use) and `/metrics` of the worker, served on
    `telemetry.worker_port` from the worker's own event loop: the uvicorn server (set
    `should_exit` to stop it) and the task serving."""
    import uvicorn
    from fastapi import FastAPI

    from gpucloud.web import tls
    from gpucloud.web.readiness import database_check, install_readiness, object_store_check, temporal_check

    app = FastAPI(title="gpucloud worker", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    checks = {
        "database": database_check(cp.db.engine),
        "temporal": temporal_check(lambda: client),
        "object store": object_store_check(cp.tenant_store.backend),
    }
    install_readiness(app, checks)
    install_metrics(app, lambda: (settings.metrics_token, settings.operator_token), before_scrape=before_scrape)
    host, port = settings.telemetry.worker_host, settings.telemetry.worker_port or 0
    secure = tls.serve_options(host, settings.tls.server, insecure=settings.tls.insecure, what="worker metrics")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **secure))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # the worker handles them
    return server, asyncio.get_running_loop().create_task(server.serve())
