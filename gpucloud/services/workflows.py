"""Starting the control plane's workflows: ids, search attributes and conflict policies, once.

Used by the API (on create and enroll) and by the worker's start-up recovery.
"""

from __future__ import annotations

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from gpucloud import search_attributes as sa
from gpucloud.config import Settings
from gpucloud.models.messages import (
    AllocationInput,
    CancelRequest,
    NodeOperationInput,
    NodeOperationKind,
    ReplaceNodeRequest,
)
from gpucloud.models.tables import Allocation
from gpucloud.services.allocations import workflow_id_for as allocation_workflow_id
from gpucloud.workflows.allocation import AllocationWorkflow
from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow
from gpucloud.workflows.node_lifecycle import workflow_id_for as node_workflow_id


async def start_allocation_workflow(client: Client, settings: Settings, alloc: Allocation, *,
                                    conflict: WorkflowIDConflictPolicy = WorkflowIDConflictPolicy.USE_EXISTING):
    return await client.start_workflow(
        AllocationWorkflow.run, AllocationInput(allocation_id=alloc.id),
        id=allocation_workflow_id(alloc.id), task_queue=settings.task_queue,
        id_conflict_policy=conflict,
        search_attributes=sa.typed((sa.ALLOCATION_ID, alloc.id), (sa.TENANT_ID, alloc.tenant_id)),
    )


async def signal_cancel(client: Client, allocation_id: str, operation_id: str | None) -> None:
    handle = client.get_workflow_handle(allocation_workflow_id(allocation_id))
    await handle.signal(AllocationWorkflow.request_cancel, CancelRequest(operation_id=operation_id))


async def signal_replace_node(client: Client, allocation_id: str, req: ReplaceNodeRequest) -> None:
    handle = client.get_workflow_handle(allocation_workflow_id(allocation_id))
    await handle.signal(AllocationWorkflow.replace_node, req)


async def start_bringup(client: Client, settings: Settings, node_id: str):
    return await client.start_workflow(
        NodeOperationWorkflow.run, NodeOperationInput(node_id=node_id, operation=NodeOperationKind.BRINGUP),
        id=node_workflow_id(node_id), task_queue=settings.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=sa.typed((sa.NODE_ID, node_id)),
    )
