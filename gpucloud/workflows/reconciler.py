"""The reconciler's sweep as a workflow: started every few seconds by a Temporal Schedule
(`reconciler-sweep`, overlap SKIP, so sweeps never pile up), or at once for a few nodes when an
event calls for it (`reconcile-<node id>`). The work is one activity; see activities/reconciler.py.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from gpucloud.models.messages import SweepInput, SweepResult

SCHEDULE_ID = "reconciler-sweep"


@workflow.defn
class ReconcileSweepWorkflow:
    @workflow.run
    async def run(self, inp: SweepInput) -> SweepResult:
        return await workflow.execute_activity(
            "sweep",
            inp,
            result_type=SweepResult,
            start_to_close_timeout=timedelta(minutes=5),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3),
        )
