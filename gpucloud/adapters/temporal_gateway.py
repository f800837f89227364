"""The one module on the client side that speaks to Temporal about workflows: it starts, signals,
queries, updates, describes and lists them, and creates, updates and triggers the schedules.

The API, the CLI, the worker's recovery and the activities call it; none of them holds a
`Client` call of its own. It sits below the workflows (floor 1) and never imports them: a
workflow is started by its type's name with its typed input model, a signal, query or update is
sent by its name, and every name and id comes from `models.workflow_ids`, which the workflows
use too (`tests/platform/test_workflow_ids.py` keeps the names equal to the registered ones).
Search attributes, ids and conflict policies are decided here, once.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
    WorkflowExecution,
    WorkflowExecutionDescription,
    WorkflowHandle,
    WorkflowUpdateStage,
)
from temporalio.common import SearchAttributeKey, WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from gpucloud.config import Settings
from gpucloud.models import search_attributes as sa
from gpucloud.models import workflow_ids as ids
from gpucloud.models.billing_messages import BillingCatchUpInput
from gpucloud.models.evaluation_messages import EvaluateVersionInput
from gpucloud.models.incident_messages import IncidentInput
from gpucloud.models.messages import (
    AllocationInput,
    BmcPowerInput,
    BringupInput,
    CancelRequest,
    NodeOperationInput,
    PoolSchedulerInput,
    ReplaceNodeRequest,
    SweepInput,
)
from gpucloud.models.rollout_messages import ReasonInput, RolloutInput, RolloutProgress
from gpucloud.models.tables import Allocation
from gpucloud.models.tenant_messages import TenantOffboardingInput, TenantOnboardingInput

# ------------------------------------------------------------------ allocations


async def start_allocation_workflow(
    client: Client,
    settings: Settings,
    alloc: Allocation,
    *,
    conflict: WorkflowIDConflictPolicy = WorkflowIDConflictPolicy.USE_EXISTING,
) -> WorkflowHandle[Any, Any]:
    return await client.start_workflow(
        ids.ALLOCATION_WORKFLOW,
        AllocationInput(
            allocation_id=alloc.id,
            provision_retries=settings.health.provision_retries,
            replacement_recheck_s=settings.health.replacement_recheck_s,
            queue_recheck_s=settings.scheduler.queue_recheck_s,
        ),
        id=ids.allocation_workflow_id(alloc.id),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=conflict,
        search_attributes=sa.typed((sa.ALLOCATION_ID, alloc.id), (sa.TENANT_ID, alloc.tenant_id)),
    )


async def signal_cancel(client: Client, allocation_id: str, operation_id: str | None) -> None:
    handle = client.get_workflow_handle(ids.allocation_workflow_id(allocation_id))
    await handle.signal(ids.ALLOCATION_CANCEL_SIGNAL, CancelRequest(operation_id=operation_id))


async def signal_replace_node(client: Client, allocation_id: str, req: ReplaceNodeRequest) -> None:
    handle = client.get_workflow_handle(ids.allocation_workflow_id(allocation_id))
    await handle.signal(ids.ALLOCATION_REPLACE_NODE_SIGNAL, req)


async def poke_pool_scheduler(
    client: Client, settings: Settings, gpu_type: str, region: str, *, plan_now: bool = True
) -> None:
    """Make sure the pool's scheduler runs, and have it plan the pool now (signal-with-start);
    `plan_now=False` only starts it where none runs (a running one keeps to its own round)."""
    how: dict[str, Any] = (
        {"start_signal": ids.POOL_SCHEDULER_POKE_SIGNAL}
        if plan_now
        else {"id_conflict_policy": WorkflowIDConflictPolicy.USE_EXISTING}
    )
    await client.start_workflow(
        ids.POOL_SCHEDULER_WORKFLOW,
        PoolSchedulerInput(gpu_type=gpu_type, region=region, poll_s=settings.scheduler.poll_s),
        id=ids.pool_scheduler_workflow_id(gpu_type, region),
        task_queue=settings.temporal.task_queue,
        **how,
    )


# ------------------------------------------------------------------ nodes

# Node operations running now (each one node's workflow); with the nodes bring-up batches hold,
# what counts against `reconciler.max_concurrent_node_ops`.
RUNNING_NODE_OPS = f"WorkflowType = '{ids.NODE_OPERATION_WORKFLOW}' AND ExecutionStatus = 'Running'"


async def count_workflows(client: Client, query: str | None = None) -> int:
    """How many workflows match a visibility query (every one without a query): also the
    cheapest call that proves the engine answers."""
    return (await client.count_workflows(query)).count


async def running_node_operations(client: Client, task_queue: str) -> int:
    """This control plane's node operations running now: those on its task queue (another
    control plane in the same namespace has its own queue, and its own limit)."""
    return await count_workflows(client, f"{RUNNING_NODE_OPS} AND TaskQueue = '{task_queue}'")


async def start_node_operation(client: Client, settings: Settings, inp: NodeOperationInput) -> None:
    """One node's operation under its single-flight id: raises `WorkflowAlreadyStartedError`
    while another operation runs on the node."""
    await client.start_workflow(
        ids.NODE_OPERATION_WORKFLOW,
        inp,
        id=ids.node_workflow_id(inp.node_id),
        task_queue=settings.temporal.task_queue,
        search_attributes=sa.typed((sa.NODE_ID, inp.node_id)),
    )


async def start_bringup_batches(client: Client, settings: Settings, node_ids: list[str]) -> int:
    """Bring-up for nodes the caller has leased (`nodes.lease_for_bringup`), in batches of
    `bringup_batch_size`. Returns the number of batches started."""
    size = max(1, settings.reconciler.bringup_batch_size)
    batches = [node_ids[i : i + size] for i in range(0, len(node_ids), size)]
    hold = uuid.uuid4().hex
    for batch in batches:
        await client.start_workflow(
            ids.BRINGUP_BATCH_WORKFLOW,
            BringupInput(node_ids=batch),
            id=ids.bringup_workflow_id(batch, hold),
            task_queue=settings.temporal.task_queue,
        )
    return len(batches)


async def _start_once(client: Client, settings: Settings, workflow: str, arg: Any, workflow_id: str) -> str:
    """Start `workflow(arg)` as `workflow_id`, joining the one running under that id (a retry)."""
    await client.start_workflow(
        workflow,
        arg,
        id=workflow_id,
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    return workflow_id


async def start_node_power(client: Client, settings: Settings, req: BmcPowerInput) -> str:
    """An operator's (or a retire's) power action on a node, through its BMC; the workflow id."""
    workflow_id = ids.power_workflow_id(req.node_id, req.operation_id or uuid.uuid4().hex[:12])
    return await _start_once(client, settings, ids.NODE_POWER_WORKFLOW, req, workflow_id)


# ------------------------------------------------------------------ incidents


async def start_incident(client: Client, settings: Settings, inp: IncidentInput) -> str:
    """The incident of a pull, under its id (`incident-<node>-<fault ms>`), or a fleet-kind
    incident under the id its row has (`inp.workflow_id`): a start sent again joins the one
    running, and one that ended is not opened again (a failed or terminated one is); the
    workflow id."""
    workflow_id = inp.workflow_id or ids.incident_workflow_id(inp.node_id, inp.key_at or inp.detected_at)
    with contextlib.suppress(WorkflowAlreadyStartedError):  # it ran and ended: written already
        await client.start_workflow(
            ids.INCIDENT_WORKFLOW,
            inp,
            id=workflow_id,
            task_queue=settings.temporal.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
            search_attributes=sa.typed((sa.NODE_ID, inp.node_id)),
        )
    return workflow_id


# ------------------------------------------------------------------ registry


async def start_version_evaluation(client: Client, settings: Settings, req: EvaluateVersionInput) -> str:
    """A platform evaluation of a version, for the tenant's operation; the workflow id."""
    workflow_id = ids.evaluation_workflow_id(req.tenant_id, req.operation_id or uuid.uuid4().hex[:12])
    return await _start_once(client, settings, ids.VERSION_EVALUATION_WORKFLOW, req, workflow_id)


# ------------------------------------------------------------------ tenants


async def start_tenant_onboarding(client: Client, settings: Settings, tenant_id: str, operation_id: str) -> None:
    await client.start_workflow(
        ids.TENANT_ONBOARDING_WORKFLOW,
        TenantOnboardingInput(
            tenant_id=tenant_id, operation_id=operation_id, deadline_s=settings.tenants.onboarding_deadline_s
        ),
        id=ids.onboarding_workflow_id(tenant_id),
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
        ids.TENANT_OFFBOARDING_WORKFLOW,
        inp,
        id=ids.offboarding_workflow_id(tenant_id),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=sa.typed((sa.TENANT_ID, tenant_id)),
    )


# ------------------------------------------------------------------ rollouts


async def start_rollout(
    client: Client, settings: Settings, inp: RolloutInput, *, allocation_id: str | None = None
) -> None:
    """The rollout under its id (a retry joins the one running), findable by version, tenant
    and, when it targets one, allocation."""
    attributes: list[tuple[SearchAttributeKey, str]] = [
        (sa.MODEL_VERSION, inp.model_version),
        (sa.TENANT_ID, inp.tenant_id),
    ]
    if allocation_id:
        attributes.append((sa.ALLOCATION_ID, allocation_id))
    await client.start_workflow(
        ids.ROLLOUT_WORKFLOW,
        inp,
        id=ids.rollout_workflow_id(inp.rollout_id),
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        task_queue=settings.temporal.task_queue,
        search_attributes=sa.typed(*attributes),
    )


async def describe_workflow(client: Client, workflow_id: str) -> WorkflowExecutionDescription:
    return await client.get_workflow_handle(workflow_id).describe()


async def rollout_progress(client: Client, rollout_id: str) -> RolloutProgress:
    handle = client.get_workflow_handle(ids.rollout_workflow_id(rollout_id))
    return await handle.query(ids.ROLLOUT_PROGRESS_QUERY, result_type=RolloutProgress)


async def update_rollout(
    client: Client, rollout_id: str, update: str, arg: ReasonInput, *, until_accepted: bool = False
) -> RolloutProgress:
    """Send the rollout an update (`ROLLOUT_PAUSE_UPDATE`, ...) and answer its progress: the
    update's own answer, or (`until_accepted`, for one that may take a while) the progress
    queried once the workflow has accepted it."""
    handle = client.get_workflow_handle(ids.rollout_workflow_id(rollout_id))
    if until_accepted:
        await handle.start_update(update, arg, wait_for_stage=WorkflowUpdateStage.ACCEPTED, result_type=RolloutProgress)
        return await handle.query(ids.ROLLOUT_PROGRESS_QUERY, result_type=RolloutProgress)
    return await handle.execute_update(update, arg, result_type=RolloutProgress)


async def list_rollouts(
    client: Client, *, tenant_id: str | None, page_size: int, next_page_token: bytes | None
) -> tuple[Sequence[WorkflowExecution], bytes | None]:
    """One page of rollouts (a tenant's, or every tenant's), as the engine's index orders them,
    and the engine's token for the next page."""
    query = f"WorkflowType = '{ids.ROLLOUT_WORKFLOW}'"
    if tenant_id is not None:
        query += f" AND {sa.TENANT_ID.name} = '{_quoted(tenant_id)}'"
    listing = client.list_workflows(query, page_size=page_size, next_page_token=next_page_token)
    await listing.fetch_next_page()
    return listing.current_page or [], listing.next_page_token


def _quoted(value: str) -> str:
    """A value inside a visibility query's single quotes."""
    return value.replace("\\", "\\\\").replace("'", "\\'")


# ------------------------------------------------------------------ recovery


async def running_workflow_ids(client: Client, workflow_types: Sequence[str]) -> set[str]:
    """The ids of the running workflows of these types: one visibility query."""
    types = ", ".join(f"'{t}'" for t in workflow_types)
    query = f"ExecutionStatus = 'Running' AND WorkflowType IN ({types})"
    return {w.id async for w in client.list_workflows(query)}


# ------------------------------------------------------------------ reconciler and schedules


def schedule_id(settings: Settings) -> str:
    return ids.sweep_schedule_id(settings.temporal.task_queue)


def sweep_schedule(settings: Settings) -> Schedule:
    return Schedule(
        action=ScheduleActionStartWorkflow(
            ids.RECONCILE_SWEEP_WORKFLOW,
            SweepInput(),
            id=f"{schedule_id(settings)}-run",
            task_queue=settings.temporal.task_queue,
            execution_timeout=timedelta(minutes=10),
        ),
        spec=ScheduleSpec(
            intervals=[ScheduleIntervalSpec(every=timedelta(seconds=settings.reconciler.sweep_interval_s))]
        ),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )


async def _ensure(client: Client, schedule_id_: str, schedule: Schedule) -> None:
    """Create the schedule, or bring an existing one up to date (a worker start after a config change)."""
    try:
        await client.create_schedule(schedule_id_, schedule)
    except ScheduleAlreadyRunningError:

        async def update(_: ScheduleUpdateInput) -> ScheduleUpdate:
            return ScheduleUpdate(schedule=schedule)

        await client.get_schedule_handle(schedule_id_).update(update)


async def ensure_sweep_schedule(client: Client, settings: Settings) -> None:
    await _ensure(client, schedule_id(settings), sweep_schedule(settings))


async def reconcile_now(client: Client, settings: Settings, node_ids: list[str]) -> None:
    """An event (operator action, agent report) asks for these nodes to be reconciled now."""
    await client.start_workflow(
        ids.RECONCILE_SWEEP_WORKFLOW,
        SweepInput(node_ids=node_ids),
        id=ids.reconcile_now_workflow_id(node_ids),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


def billing_schedule_id(settings: Settings) -> str:
    return ids.billing_schedule_id(settings.temporal.task_queue)


def billing_close_schedule(settings: Settings) -> Schedule:
    # SKIP: one catch-up at a time. A run missed while Temporal was down is run when it is back
    # (the schedule's catch-up window, a year by default), and it closes every period that ended.
    # The offset (an hour past midnight UTC, daily) lets the agents ship a month's last samples
    # before the month closes; whatever comes later is billed as an adjustment next month.
    every = timedelta(seconds=settings.ledger.close_interval_s)
    return Schedule(
        action=ScheduleActionStartWorkflow(
            ids.BILLING_CATCH_UP_WORKFLOW,
            BillingCatchUpInput(),
            id=ids.billing_catch_up_workflow_id(settings.temporal.task_queue),
            task_queue=settings.temporal.task_queue,
            execution_timeout=timedelta(hours=6),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every, offset=min(timedelta(hours=1), every / 2))]),
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
    )


async def ensure_billing_close_schedule(client: Client, settings: Settings) -> bool:
    """Create or update the billing-close schedule; False (and nothing done) without a ledger."""
    if settings.ledger.url is None:
        return False
    await _ensure(client, billing_schedule_id(settings), billing_close_schedule(settings))
    return True
