"""The pools' scheduler's activities: plan a pool (one transaction, `services/scheduling.py`) and
carry out what only Temporal can (start a reservation's allocation workflow, cancel one whose
window ended), and make sure a pool's scheduler workflow runs (the gateway's signal-with-start)."""

from __future__ import annotations

import asyncio
import functools
import logging

from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError

from gpucloud.activities import ActivityGroup
from gpucloud.adapters.temporal_gateway import poke_pool_scheduler, signal_cancel, start_allocation_workflow
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.models.messages import EnsureSchedulerInput, PoolPlanResult, PoolRef, PreemptRequest, SweepInput
from gpucloud.models.tables import Allocation
from gpucloud.services import scheduling

log = logging.getLogger(__name__)


class SchedulerActivities(ActivityGroup):
    def __init__(self, client: Client, db: Database, settings: Settings) -> None:
        self.client = client
        self.db = db
        self.settings = settings

    @activity.defn
    async def plan_pool(self, req: PoolRef) -> PoolPlanResult:
        """Plan the pool (one transaction, on a worker thread), then start the workflows of the
        reservations' allocations it placed and cancel those whose window ended (both idempotent:
        a retry after a crash does them again)."""
        plan = await asyncio.to_thread(
            functools.partial(
                scheduling.plan_pool,
                self.db,
                req.gpu_type,
                req.region,
                settings=self.settings.scheduler,
                deadline_scale=self.settings.reconciler.deadline_scale,
            )
        )
        for allocation_id, tenant_id in plan.start:
            row = Allocation(
                id=allocation_id, tenant_id=tenant_id, gpu_type=req.gpu_type, region=req.region, node_count=1
            )
            await start_allocation_workflow(self.client, self.settings, row)
        for allocation_id in plan.cancel:
            try:
                await signal_cancel(self.client, allocation_id, None)
            except RPCError as exc:  # not found: it ended; its workflow reads its row at its next recheck anyway
                log.info("could not signal the end of %s's window: %s", allocation_id, exc)
        notices = [
            PreemptRequest(allocation_id=n.allocation_id, reason=n.reason, stop_at=n.stop_at) for n in plan.notices
        ]
        return PoolPlanResult(
            placed=plan.placed,
            expired=plan.expired,
            preempted=notices,
            queued=plan.queued,
            reservations=plan.reservations,
            unbilled=plan.unbilled,
            quiet_s=plan.quiet_s,
        )

    @activity.defn
    async def ensure_pool_scheduler(self, req: EnsureSchedulerInput) -> None:
        await poke_pool_scheduler(self.client, self.settings, req.gpu_type, req.region, plan_now=req.plan_now)

    @activity.defn
    async def ensure_pool_schedulers(self, _sweep: SweepInput) -> int:
        """Every pool with a queue or an open capacity reservation has its scheduler running (the
        sweep's safety net: one lost with a crash, or never started, is started again)."""
        pools = await asyncio.to_thread(functools.partial(scheduling.pools_needing_scheduler, self.db))
        for gpu_type, region in pools:  # started where none runs; one running keeps to its round
            await poke_pool_scheduler(self.client, self.settings, gpu_type, region, plan_now=False)
        return len(pools)
