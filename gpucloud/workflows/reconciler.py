"""The reconciler's sweep as a workflow: started every few seconds by a Temporal Schedule
(`reconciler-sweep`, overlap SKIP, so sweeps never pile up), or at once for a few nodes when an
event calls for it (`reconcile-<node id>`). The work is one activity; see activities/reconciler.py.
The periodic sweep also makes sure every pool with a queue or an open capacity reservation has its
scheduler running (`workflows/pool_scheduler.py`).
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.reconciler import ReconcilerActivities
    from gpucloud.activities.scheduling import SchedulerActivities
    from gpucloud.models.messages import SweepInput, SweepResult


@workflow.defn
class ReconcileSweepWorkflow:
    @workflow.run
    async def run(self, inp: SweepInput) -> SweepResult:
        if inp.node_ids is None:  # the periodic sweep: every pool with a queue has its scheduler
            await workflow.execute_activity_method(
                SchedulerActivities.ensure_pool_schedulers, inp, **options.SCHEDULER_POKE
            )
        return await workflow.execute_activity_method(ReconcilerActivities.sweep, inp, **options.SWEEP)
