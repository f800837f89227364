"""The reconciler's sweep as a workflow: started every few seconds by a Temporal Schedule
(`reconciler-sweep`, overlap SKIP, so sweeps never pile up), or at once for a few nodes when an
event calls for it (`reconcile-<node id>`). The work is one activity; see activities/reconciler.py.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from gpucloud.activities.reconciler import ReconcilerActivities
    from gpucloud.models.messages import SweepInput, SweepResult
    from gpucloud.workflows import options


@workflow.defn
class ReconcileSweepWorkflow:
    @workflow.run
    async def run(self, inp: SweepInput) -> SweepResult:
        return await workflow.execute_activity_method(ReconcilerActivities.sweep, inp, **options.SWEEP)
