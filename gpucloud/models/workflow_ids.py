"""The workflows' names and ids, declared once: what the client side (`adapters.temporal_gateway`)
starts, signals, queries and updates, and what the workflows themselves use to reach each other
(`workflow.get_external_workflow_handle`, child workflows).

The names are the ones the workflow classes register (`@workflow.defn`, `@workflow.signal`, ...);
`tests/platform/test_workflow_ids.py` holds them equal, so the strings cannot drift from the code.
"""

from __future__ import annotations

import hashlib
from datetime import datetime

# Workflow types.
ALLOCATION_WORKFLOW = "AllocationWorkflow"
NODE_OPERATION_WORKFLOW = "NodeOperationWorkflow"
BRINGUP_BATCH_WORKFLOW = "BringupBatchWorkflow"
NODE_POWER_WORKFLOW = "NodePowerWorkflow"
VERSION_EVALUATION_WORKFLOW = "VersionEvaluationWorkflow"
TENANT_ONBOARDING_WORKFLOW = "TenantOnboardingWorkflow"
TENANT_OFFBOARDING_WORKFLOW = "TenantOffboardingWorkflow"
RECONCILE_SWEEP_WORKFLOW = "ReconcileSweepWorkflow"
BILLING_CATCH_UP_WORKFLOW = "BillingCatchUpWorkflow"
ROLLOUT_WORKFLOW = "RolloutWorkflow"
INCIDENT_WORKFLOW = "IncidentWorkflow"
POOL_SCHEDULER_WORKFLOW = "PoolSchedulerWorkflow"

# What a workflow id starts with, where the rest of it is the id of what the workflow is about
# (`observability.logs` reads them back out of a workflow's id).
ALLOCATION_WORKFLOW_PREFIX = "alloc-"
NODE_WORKFLOW_PREFIX = "node-"
ROLLOUT_WORKFLOW_PREFIX = "rollout-"

# Signals, queries and updates, by the workflow that takes them.
ALLOCATION_CANCEL_SIGNAL = "request_cancel"
ALLOCATION_REPLACE_NODE_SIGNAL = "replace_node"
# The pool's scheduler placed (or expired) a queued allocation: its workflow reads it again.
ALLOCATION_PLACED_SIGNAL = "placed"
# A preemptible allocation is taken back: stop it when its notice ends.
ALLOCATION_PREEMPT_SIGNAL = "preempt"
# Something changed in a pool's queue (a request queued or cancelled): plan it now.
POOL_SCHEDULER_POKE_SIGNAL = "poke"
ROLLOUT_PROGRESS_QUERY = "progress"
ROLLOUT_PAUSE_UPDATE = "pause"
ROLLOUT_RESUME_UPDATE = "resume"
ROLLOUT_ABORT_UPDATE = "abort"

# Schedules: one of each per task queue (each control plane sharing a namespace has its own).
SWEEP_SCHEDULE_ID = "reconciler-sweep"
BILLING_CLOSE_SCHEDULE_ID = "billing-close-schedule"


def allocation_workflow_id(allocation_id: str) -> str:
    return f"{ALLOCATION_WORKFLOW_PREFIX}{allocation_id}"


def pool_scheduler_workflow_id(gpu_type: str, region: str) -> str:
    """One scheduler per pool (GPU type and region)."""
    key = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{gpu_type}-{region}")
    return f"scheduler-{key}"


def node_workflow_id(node_id: str) -> str:
    return f"{NODE_WORKFLOW_PREFIX}{node_id}"


def bringup_workflow_id(node_ids: list[str], hold: str) -> str:
    """`bringup-<first node>-<count>-<digest of the nodes and the hold>`: one id per hold taken."""
    digest = hashlib.sha256("\n".join([hold, *sorted(node_ids)]).encode()).hexdigest()[:12]
    return f"bringup-{min(node_ids)}-{len(node_ids)}-{digest}"


def incident_workflow_id(node_id: str, fault_at: datetime) -> str:
    """`incident-<node>-<fault time in ms since the epoch>`: a pull sent again (by the API, then
    by the reconciler) names the same fault, so it finds the incident the first one opened."""
    return f"incident-{node_id}-{int(fault_at.timestamp() * 1000)}"


def fleet_incident_workflow_id(fleet_incident_id: str) -> str:
    """`incident-fleet-<fleet incident id>`: a correlated burst's one incident, however many
    nodes join it and whoever (the health loop, the reconciler's sweep) opens it."""
    return f"incident-fleet-{fleet_incident_id}"


def breaker_incident_workflow_id(pool: str, window_start: datetime) -> str:
    """`incident-breaker-<pool>-<first refusal in ms>`: one incident per pool's trip (the budget
    key, `gpu/region` or `gpu/region tenant t`, with `/` and spaces made `_`)."""
    key = "".join(c if c.isalnum() or c in "-_." else "_" for c in pool)
    return f"incident-breaker-{key}-{int(window_start.timestamp() * 1000)}"


def power_workflow_id(node_id: str, operation_id: str) -> str:
    return f"power-{node_id}-{operation_id}"


def evaluation_workflow_id(tenant_id: str, operation_id: str) -> str:
    return f"evaluate-{tenant_id}-{operation_id}"


def onboarding_workflow_id(tenant_id: str) -> str:
    return f"tenant-onboard-{tenant_id}"


def offboarding_workflow_id(tenant_id: str) -> str:
    return f"tenant-offboard-{tenant_id}"


def rollout_workflow_id(rollout_id: str) -> str:
    return rollout_id if rollout_id.startswith(ROLLOUT_WORKFLOW_PREFIX) else f"{ROLLOUT_WORKFLOW_PREFIX}{rollout_id}"


def close_workflow_id(task_queue: str, period_id: str) -> str:
    return f"billing-close-{task_queue}-{period_id}"


def billing_catch_up_workflow_id(task_queue: str) -> str:
    return f"billing-catch-up-{task_queue}"


def sweep_schedule_id(task_queue: str) -> str:
    return f"{SWEEP_SCHEDULE_ID}-{task_queue}"


def billing_schedule_id(task_queue: str) -> str:
    return f"{BILLING_CLOSE_SCHEDULE_ID}-{task_queue}"


def reconcile_now_workflow_id(node_ids: list[str]) -> str:
    """One node's nudge (`reconcile-<node>`), or a batch's, keyed by the nodes it names: the same
    batch gets the same id in every process (Python's `hash()` of strings differs between
    processes), so a batch already being reconciled is not started twice."""
    batch = hashlib.sha256("\n".join(sorted(set(node_ids))).encode()).hexdigest()[:16]
    key = node_ids[0] if len(node_ids) == 1 else f"batch-{batch}"
    return f"reconcile-{key}"
