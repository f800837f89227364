"""Starting the control plane's workflows: ids, search attributes and conflict policies, once.

Used by the API (on create and enroll) and by the worker's start-up recovery.
"""

from __future__ import annotations

import uuid
from typing import Any

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from gpucloud.config import Settings
from gpucloud.models import search_attributes as sa
from gpucloud.models.evaluation_messages import EvaluateVersionInput
from gpucloud.models.messages import (
    AllocationInput,
    BmcPowerInput,
    BringupInput,
    CancelRequest,
    ReplaceNodeRequest,
)
from gpucloud.models.tables import Allocation
from gpucloud.models.tenant_messages import TenantOffboardingInput, TenantOnboardingInput
from gpucloud.services.allocations import workflow_id_for as allocation_workflow_id
from gpucloud.services.tenants import offboarding_workflow_id, onboarding_workflow_id
from gpucloud.workflows.allocation import AllocationWorkflow
from gpucloud.workflows.bringup import BringupBatchWorkflow
from gpucloud.workflows.bringup import workflow_id_for as bringup_workflow_id
from gpucloud.workflows.evaluation import VersionEvaluationWorkflow, evaluation_workflow_id
from gpucloud.workflows.power import NodePowerWorkflow, power_workflow_id
from gpucloud.workflows.tenant import TenantOffboardingWorkflow, TenantOnboardingWorkflow


async def start_allocation_workflow(
    client: Client,
    settings: Settings,
    alloc: Allocation,
    *,
    conflict: WorkflowIDConflictPolicy = WorkflowIDConflictPolicy.USE_EXISTING,
):
    return await client.start_workflow(
        AllocationWorkflow.run,
        AllocationInput(
            allocation_id=alloc.id,
            provision_retries=settings.health.provision_retries,
            replacement_recheck_s=settings.health.replacement_recheck_s,
        ),
        id=allocation_workflow_id(alloc.id),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=conflict,
        search_attributes=sa.typed((sa.ALLOCATION_ID, alloc.id), (sa.TENANT_ID, alloc.tenant_id)),
    )


async def signal_cancel(client: Client, allocation_id: str, operation_id: str | None) -> None:
    handle = client.get_workflow_handle(allocation_workflow_id(allocation_id))
    await handle.signal(AllocationWorkflow.request_cancel, CancelRequest(operation_id=operation_id))


async def signal_replace_node(client: Client, allocation_id: str, req: ReplaceNodeRequest) -> None:
    handle = client.get_workflow_handle(allocation_workflow_id(allocation_id))
    await handle.signal(AllocationWorkflow.replace_node, req)


# Node operations running now (each one node's workflow); with the nodes bring-up batches hold,
# what counts against `reconciler.max_concurrent_node_ops`.
RUNNING_NODE_OPS = "WorkflowType = 'NodeOperationWorkflow' AND ExecutionStatus = 'Running'"


async def running_node_operations(client: Client, task_queue: str) -> int:
    """This control plane's node operations running now: those on its task queue (another
    control plane in the same namespace has its own queue, and its own limit)."""
    query = f"{RUNNING_NODE_OPS} AND TaskQueue = '{task_queue}'"
    return (await client.count_workflows(query)).count


async def start_bringup_batches(client: Client, settings: Settings, node_ids: list[str]) -> int:
    """Bring-up for nodes the caller has leased (`nodes.lease_for_bringup`), in batches of
    `bringup_batch_size`. Returns the number of batches started."""
    size = max(1, settings.reconciler.bringup_batch_size)
    batches = [node_ids[i : i + size] for i in range(0, len(node_ids), size)]
    hold = uuid.uuid4().hex
    for batch in batches:
        await client.start_workflow(
            BringupBatchWorkflow.run,
            BringupInput(node_ids=batch),
            id=bringup_workflow_id(batch, hold),
            task_queue=settings.temporal.task_queue,
        )
    return len(batches)


async def _start_once(client: Client, settings: Settings, run: Any, arg: Any, workflow_id: str) -> str:
    """Start `run(arg)` as `workflow_id`, joining the one running under that id (a retry)."""
    await client.start_workflow(
        run,
        arg,
        id=workflow_id,
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    return workflow_id


async def start_version_evaluation(client: Client, settings: Settings, req: EvaluateVersionInput) -> str:
    """A platform evaluation of a version, for the tenant's operation; the workflow id."""
    workflow_id = evaluation_workflow_id(req.tenant_id, req.operation_id or uuid.uuid4().hex[:12])
    return await _start_once(client, settings, VersionEvaluationWorkflow.run, req, workflow_id)


async def start_node_power(client: Client, settings: Settings, req: BmcPowerInput) -> str:
    """An operator's (or a retire's) power action on a node, through its BMC; the workflow id."""
    workflow_id = power_workflow_id(req.node_id, req.operation_id or uuid.uuid4().hex[:12])
    return await _start_once(client, settings, NodePowerWorkflow.run, req, workflow_id)


async def start_tenant_onboarding(client: Client, settings: Settings, tenant_id: str, operation_id: str) -> None:
    await client.start_workflow(
        TenantOnboardingWorkflow.run,
        TenantOnboardingInput(
            tenant_id=tenant_id, operation_id=operation_id, deadline_s=settings.tenants.onboarding_deadline_s
        ),
        id=onboarding_workflow_id(tenant_id),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=sa.typed((sa.TENANT_ID, tenant_id)),
    )


async def start_tenant_offboarding(client: Client, settings: Settings, tenant_id: str, operation_id: str) -> None:
    inp = TenantOffboardingInput(
        tenant_id=tenant_id,
        operation_id=operation_id,
        poll_s=settings.tenants.offboarding_poll_s,
        retention_s=settings.tenants.storage_retention_s,
    )
    await client.start_workflow(
        TenantOffboardingWorkflow.run,
        inp,
        id=offboarding_workflow_id(tenant_id),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=sa.typed((sa.TENANT_ID, tenant_id)),
    )
