"""An operator's power action on a node (`POST /v1/nodes/{id}/power`, `retire`): one BMC call,
durable and retried within bounds, recorded on the node and finishing the operator's operation.
The node's state is not touched: a node powered off in the pool is found by the reconciler
(its agent falls silent) like any other."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.bmc import BmcActivities
    from gpucloud.models.messages import BmcPowerInput, BmcPowerResult


@workflow.defn
class NodePowerWorkflow:
    @workflow.run
    async def run(self, req: BmcPowerInput) -> BmcPowerResult:
        return await workflow.execute_activity_method(BmcActivities.bmc_power, req, **options.BMC)
