"""A platform evaluation of a version (`POST /v1/models/{name}/versions/{ref}/evaluate`): one
activity in the worker pulls and verifies the version, runs the evaluator, signs and keeps its
results, and settles the tenant's operation (its id names the tenant and the operation)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from gpucloud.activities.evaluation import EvaluationActivities
    from gpucloud.models.evaluation_messages import EvaluateVersionInput, EvaluateVersionResult
    from gpucloud.workflows import options


def evaluation_workflow_id(tenant_id: str, operation_id: str) -> str:
    return f"evaluate-{tenant_id}-{operation_id}"


@workflow.defn
class VersionEvaluationWorkflow:
    @workflow.run
    async def run(self, req: EvaluateVersionInput) -> EvaluateVersionResult:
        return await workflow.execute_activity_method(EvaluationActivities.evaluate_version, req, **options.EVALUATION)
