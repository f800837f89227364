"""The steps an allocation's workflow takes on the world: its activities (the control-plane DB,
the fabric managers) and its nodes' child workflows, bound to one allocation.

Both halves of the allocation's life use them: `AllocationWorkflow` (provision, release) and its
`DrainAndReplace` (pull, drain, replace). They hold no state but the allocation's id, so which
of the two calls a step changes nothing in the workflow's history.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, WorkflowAlreadyStartedError
from temporalio.workflow import ChildWorkflowHandle, ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.control_db import ControlDbActivities
    from gpucloud.activities.fabric import FabricActivities
    from gpucloud.activities.scheduling import SchedulerActivities
    from gpucloud.models import search_attributes as sa
    from gpucloud.models.allocation_states import AllocationStatus
    from gpucloud.models.fabric_messages import FabricApplyInput, FabricReleaseInput, FabricRemoveInput
    from gpucloud.models.messages import (
        AllocationEventInput,
        AllocationInput,
        AllocationStatusInput,
        AllocationView,
        DetachNodeInput,
        DetachNodesInput,
        EnsureSchedulerInput,
        NodeOperationInput,
        NodeOperationKind,
        NodeOperationResult,
        ReplaceNodeRequest,
    )
    from gpucloud.models.workflow_ids import node_workflow_id
    from gpucloud.workflows.db_steps import db_step
    from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow

CHILD_START_RETRY = timedelta(seconds=1)

NodeOperation = ChildWorkflowHandle[NodeOperationWorkflow, NodeOperationResult]


class AllocationSteps:
    """One allocation's activities and node operations; `allocation_id` is set when the run starts."""

    def __init__(self) -> None:
        self.allocation_id = ""

    async def load(self) -> AllocationView:
        return await db_step(ControlDbActivities.load_allocation, AllocationInput(allocation_id=self.allocation_id))

    async def set_status(self, view: AllocationView, status: AllocationStatus, reason: str | None = None) -> None:
        await db_step(
            ControlDbActivities.set_allocation_status,
            AllocationStatusInput(allocation_id=view.allocation_id, status=status, failure_reason=reason),
        )

    async def ensure_scheduler(self, view: AllocationView, *, plan_now: bool) -> bool:
        """A queued allocation's pool has its scheduler running (`workflows/pool_scheduler.py`),
        asked to plan now where `plan_now`. False where Temporal could not be told in the
        activity's time (the caller asks again at its next recheck; the request stays queued)."""
        try:
            await workflow.execute_activity_method(
                SchedulerActivities.ensure_pool_scheduler,
                EnsureSchedulerInput(gpu_type=view.gpu_type, region=view.region, plan_now=plan_now),
                **options.SCHEDULER_POKE,
            )
        except ActivityError as error:
            workflow.logger.warning("pool scheduler not yet made sure of: %s", error.cause or error)
            return False
        return True

    async def note(self, kind: str, reason: str, node_id: str | None = None) -> None:
        await db_step(
            ControlDbActivities.record_allocation_event,
            AllocationEventInput(allocation_id=self.allocation_id, kind=kind, reason=reason, node_id=node_id),
        )

    async def detach_nodes(self, reqs: list[ReplaceNodeRequest]) -> list[str]:
        """The requests' nodes out of the allocation, in one activity; the ones it pulled."""
        nodes = [
            DetachNodeInput(allocation_id=self.allocation_id, node_id=r.node_id, reason=r.reason, fault_at=r.fault_at)
            for r in reqs
        ]
        result = await db_step(
            ControlDbActivities.detach_nodes, DetachNodesInput(allocation_id=self.allocation_id, nodes=nodes)
        )
        return result.pulled

    async def apply_fabric(self, *, joining: list[str] | None = None) -> str | None:
        """Apply the allocation's fabric membership (its nodes, and `joining`) and read it back;
        None once it holds, else why it could not be applied."""
        try:
            await workflow.execute_activity_method(
                FabricActivities.apply_allocation_fabric,
                FabricApplyInput(allocation_id=self.allocation_id, joining=joining or []),
                **options.FABRIC_APPLY,
            )
        except ActivityError as err:
            # The details may name other allocations' partitions: they go to the operator's log
            # (and the history), the tenant sees what kind of failure it was.
            workflow.logger.warning("fabric membership of %s not applied: %s", self.allocation_id, _failure_chain(err))
            return f"fabric isolation could not be applied and verified ({_failure_kind(err)}); nothing was kept"
        return None

    async def remove_fabric(self, node_ids: list[str]) -> None:
        if node_ids:
            await workflow.execute_activity_method(
                FabricActivities.remove_allocation_fabric_nodes,
                FabricRemoveInput(allocation_id=self.allocation_id, node_ids=node_ids),
                **options.FABRIC_REMOVE,
            )

    async def release_fabric(self) -> None:
        await workflow.execute_activity_method(
            FabricActivities.release_allocation_fabric,
            FabricReleaseInput(allocation_id=self.allocation_id),
            **options.FABRIC_REMOVE,
        )

    async def start_node_op(
        self,
        node_id: str,
        op: NodeOperationKind,
        view: AllocationView,
        *,
        parent_close_policy: ParentClosePolicy = ParentClosePolicy.TERMINATE,
    ) -> NodeOperation:
        # The node's previous workflow (say, bring-up) may still be closing: wait for it, since
        # one node runs one operation at a time.
        while True:
            try:
                return await workflow.start_child_workflow(
                    NodeOperationWorkflow.run,
                    NodeOperationInput(
                        node_id=node_id,
                        operation=op,
                        allocation_id=view.allocation_id,
                        tenant_id=view.tenant_id,
                        workload=view.workload
                        if op in (NodeOperationKind.PROVISION, NodeOperationKind.RESTORE)
                        else None,
                    ),
                    id=node_workflow_id(node_id),
                    parent_close_policy=parent_close_policy,
                    search_attributes=sa.typed(
                        (sa.NODE_ID, node_id), (sa.ALLOCATION_ID, view.allocation_id), (sa.TENANT_ID, view.tenant_id)
                    ),
                )
            except WorkflowAlreadyStartedError:
                await workflow.sleep(CHILD_START_RETRY)

    async def recycle_wiping(self, results: list[NodeOperationResult], view: AllocationView) -> None:
        for result in results:
            if result.state == "wiping":
                # Wipe and burn-in take long and are the node's business, not the tenant's:
                # they continue after this workflow ends.
                await self.start_node_op(
                    result.node_id, NodeOperationKind.RECYCLE, view, parent_close_policy=ParentClosePolicy.ABANDON
                )


def _failure_kind(err: ActivityError) -> str:
    kinds = {"FabricRefused": "a fabric manager refused", "FabricMismatch": "the read-back differed"}
    cause = err.__cause__
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__  # a timeout carries the last attempt's error, if it had one
    if cause is None:
        return "the fabric managers did not answer in time"
    return kinds.get(cause.type or "", "a fabric manager failed")


def _failure_chain(err: BaseException) -> str:
    """The messages of an activity failure's causes (a timeout names the last attempt's error)."""
    messages = []
    cause = err.__cause__
    while cause is not None:
        messages.append(getattr(cause, "message", None) or str(cause))
        cause = cause.__cause__
    return ": ".join(messages) or str(err)
