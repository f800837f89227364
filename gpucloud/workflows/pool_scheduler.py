"""One pool's scheduler (id `scheduler-<gpu type>-<region>`): while the pool's queue is not
empty, plan the pool (`services/scheduling.py`: place, expire, rank) every `poll_s`, and at once
when poked (a request queued or cancelled), then tell each allocation it placed or expired (all at once), so
its workflow goes on. While only capacity reservations are open, and each one's hold is still
ahead, it sleeps until the first hold begins (at most `MAX_QUIET_S`), not planning every `poll_s`
for weeks. It ends when the queue is empty and no reservation is open; the next queued request
starts it again (the gateway's signal-with-start, made by the queued allocation's workflow; its
rechecks, and the reconciler's sweep, start it where none runs, so a scheduler lost with a crash
is back within `scheduler.queue_recheck_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.ledger import LedgerActivities
    from gpucloud.activities.scheduling import SchedulerActivities
    from gpucloud.models.messages import PoolPlanResult, PoolRef, PoolSchedulerInput, PreemptRequest
    from gpucloud.models.workflow_ids import (
        ALLOCATION_PLACED_SIGNAL,
        ALLOCATION_PREEMPT_SIGNAL,
        allocation_workflow_id,
    )
    from gpucloud.workflows.db_steps import db_step

# Plans per run before it continues as new (a bounded history).
PLANS_PER_RUN = 500
# The longest it sleeps while reservations wait for their holds: what a lost poke can delay.
MAX_QUIET_S = 300.0


@workflow.defn
class PoolSchedulerWorkflow:
    def __init__(self) -> None:
        self._poked = False
        self._plans = 0

    @workflow.signal
    def poke(self) -> None:
        self._poked = True

    @workflow.query
    def plans(self) -> int:
        return self._plans

    @workflow.run
    async def run(self, inp: PoolSchedulerInput) -> int:
        pool = PoolRef(gpu_type=inp.gpu_type, region=inp.region)
        for _ in range(PLANS_PER_RUN):
            self._poked = False
            result: PoolPlanResult = await db_step(SchedulerActivities.plan_pool, pool)
            self._plans += 1
            tells = [self._tell(a, ALLOCATION_PLACED_SIGNAL) for a in [*result.placed, *result.expired]]
            tells += [self._tell(n.allocation_id, ALLOCATION_PREEMPT_SIGNAL, n) for n in result.preempted]
            # All in one workflow task: one after the other, each waited a workflow task's round
            # trip, and a plan that placed 64 requests held the next plan back for minutes on a
            # busy worker (benchmarks/scheduling.py --stack) while nodes sat free.
            await asyncio.gather(*tells)
            if result.unbilled:
                await self._bill(pool)
            idle = result.queued == 0 and not result.preempted and not self._poked
            if idle and result.reservations == 0:
                return self._plans
            # Reservations whose holds are all still ahead: nothing to do until the first begins
            # (a poke, for a new request or reservation, wakes it sooner).
            wait_s = max(inp.poll_s, min(result.quiet_s, MAX_QUIET_S)) if idle and not result.unbilled else inp.poll_s
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._poked, timeout=timedelta(seconds=wait_s))
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(inp)

    async def _bill(self, pool: PoolRef) -> None:
        """Reservations whose window began go to the ledger; a ledger that is down is tried again
        at the next plan (the scheduler does not wait on it)."""
        try:
            await workflow.execute_activity_method(LedgerActivities.record_reservations, pool, **options.LEDGER_BRIEF)
        except ActivityError as error:
            workflow.logger.warning("reservations not yet recorded by the ledger: %s", error.cause or error)

    async def _tell(self, allocation_id: str, signal: str, arg: PreemptRequest | None = None) -> None:
        """Signal the allocation's workflow; one that is gone reads its row at its next recheck."""
        handle = workflow.get_external_workflow_handle(allocation_workflow_id(allocation_id))
        try:
            if arg is None:
                await handle.signal(signal)
            else:
                await handle.signal(signal, arg)
        except Exception:
            workflow.logger.info("allocation %s has no running workflow to tell", allocation_id)
