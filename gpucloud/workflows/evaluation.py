"""A platform evaluation of a version (`POST /v1/models/{name}/versions/{ref}/evaluate`): the
control plane's worker hands the tenant's public keys, and a token that reads only this version
and its parent through the API, to the evaluation worker (its own task queue and process,
holding no platform secret and no store credentials), which pulls, verifies and evaluates the
version; the control plane's worker then signs and keeps what it found, and settles the
tenant's operation (the workflow id names the tenant and the operation)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.evaluation import EvaluationActivities
    from gpucloud.activities.evaluation_runner import EvaluationRunner
    from gpucloud.config import evaluation_task_queue
    from gpucloud.models.evaluation_messages import (
        EvaluateVersionInput,
        EvaluateVersionResult,
        EvaluationRefusal,
        RecordEvaluationInput,
        RunEvaluationInput,
    )


@workflow.defn
class VersionEvaluationWorkflow:
    @workflow.run
    async def run(self, req: EvaluateVersionInput) -> EvaluateVersionResult:
        # The run's token lives `registry.evaluation_token_ttl_s`; the run's retries (an API
        # that does not answer for hours) can outlast it. A token the API refuses is minted
        # once more, then the refusal stands (the version or its tenant is gone).
        for _ in range(2):
            keys = await workflow.execute_activity_method(
                EvaluationActivities.evaluation_keys, req, **options.EVALUATION_RECORD
            )
            found = await workflow.execute_activity_method(
                EvaluationRunner.run_evaluation,
                RunEvaluationInput(request=req, keys=keys),
                task_queue=evaluation_task_queue(workflow.info().task_queue),
                **options.EVALUATION,
            )
            if found.refusal != EvaluationRefusal.ACCESS_REFUSED:
                break
        return await workflow.execute_activity_method(
            EvaluationActivities.record_evaluation,
            RecordEvaluationInput(request=req, run=found),
            **options.EVALUATION_RECORD,
        )
