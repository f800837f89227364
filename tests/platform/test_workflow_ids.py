"""The names the gateway starts, signals, queries and updates by are the ones the workflow classes
register, and the ids it builds are the very functions the workflows and services use: a renamed
workflow or handler, or an id built a second way, fails here instead of in production."""

from __future__ import annotations

import subprocess
import sys

import pytest
from temporalio import workflow

from gpucloud.adapters import temporal_gateway
from gpucloud.models import workflow_ids as ids
from gpucloud.services import allocations, pulls, recovery, tenants
from gpucloud.workflows import allocation_steps, billing_close, pool_scheduler
from gpucloud.workflows import tenant as tenant_workflows
from gpucloud.workflows.allocation import AllocationWorkflow
from gpucloud.workflows.bringup import BringupBatchWorkflow
from gpucloud.workflows.evaluation import VersionEvaluationWorkflow
from gpucloud.workflows.incident import IncidentWorkflow
from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow
from gpucloud.workflows.power import NodePowerWorkflow
from gpucloud.workflows.reconciler import ReconcileSweepWorkflow
from gpucloud.workflows.rollout import RolloutWorkflow

pytestmark = pytest.mark.unit


def _registered(cls: type) -> workflow._Definition:
    return workflow._Definition.must_from_class(cls)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        (ids.ALLOCATION_WORKFLOW, AllocationWorkflow),
        (ids.NODE_OPERATION_WORKFLOW, NodeOperationWorkflow),
        (ids.BRINGUP_BATCH_WORKFLOW, BringupBatchWorkflow),
        (ids.NODE_POWER_WORKFLOW, NodePowerWorkflow),
        (ids.VERSION_EVALUATION_WORKFLOW, VersionEvaluationWorkflow),
        (ids.TENANT_ONBOARDING_WORKFLOW, tenant_workflows.TenantOnboardingWorkflow),
        (ids.TENANT_OFFBOARDING_WORKFLOW, tenant_workflows.TenantOffboardingWorkflow),
        (ids.RECONCILE_SWEEP_WORKFLOW, ReconcileSweepWorkflow),
        (ids.BILLING_CATCH_UP_WORKFLOW, billing_close.BillingCatchUpWorkflow),
        (ids.ROLLOUT_WORKFLOW, RolloutWorkflow),
        (ids.INCIDENT_WORKFLOW, IncidentWorkflow),
        (ids.POOL_SCHEDULER_WORKFLOW, pool_scheduler.PoolSchedulerWorkflow),
    ],
)
def test_each_workflow_name_is_the_registered_one(name: str, cls: type) -> None:
    assert _registered(cls).name == name


def test_each_signal_query_and_update_name_is_a_registered_handler() -> None:
    allocation, rollout = _registered(AllocationWorkflow), _registered(RolloutWorkflow)
    assert allocation.signals[ids.ALLOCATION_CANCEL_SIGNAL].fn.__name__ == AllocationWorkflow.request_cancel.__name__
    assert (
        allocation.signals[ids.ALLOCATION_REPLACE_NODE_SIGNAL].fn.__name__ == AllocationWorkflow.replace_node.__name__
    )
    assert allocation.signals[ids.ALLOCATION_PLACED_SIGNAL].fn.__name__ == AllocationWorkflow.placed.__name__
    assert allocation.signals[ids.ALLOCATION_PREEMPT_SIGNAL].fn.__name__ == AllocationWorkflow.preempt.__name__
    scheduler = _registered(pool_scheduler.PoolSchedulerWorkflow)
    assert scheduler.signals[ids.POOL_SCHEDULER_POKE_SIGNAL].fn.__name__ == "poke"
    assert ids.ROLLOUT_PROGRESS_QUERY in rollout.queries
    for update in (ids.ROLLOUT_PAUSE_UPDATE, ids.ROLLOUT_RESUME_UPDATE, ids.ROLLOUT_ABORT_UPDATE):
        assert update in rollout.updates


def test_every_name_constant_is_checked_above() -> None:
    """A name added to `workflow_ids` is added to the checks here too."""
    workflow_names = {v for k, v in vars(ids).items() if k.endswith("_WORKFLOW")}
    handler_names = {k for k in vars(ids) if k.endswith(("_SIGNAL", "_QUERY", "_UPDATE"))}
    assert len(workflow_names) == 12
    assert handler_names == {
        "ALLOCATION_CANCEL_SIGNAL",
        "ALLOCATION_PLACED_SIGNAL",
        "ALLOCATION_PREEMPT_SIGNAL",
        "POOL_SCHEDULER_POKE_SIGNAL",
        "ALLOCATION_REPLACE_NODE_SIGNAL",
        "ROLLOUT_PROGRESS_QUERY",
        "ROLLOUT_PAUSE_UPDATE",
        "ROLLOUT_RESUME_UPDATE",
        "ROLLOUT_ABORT_UPDATE",
    }


def test_the_ids_are_built_in_one_place() -> None:
    assert temporal_gateway.ids is ids
    assert allocation_steps.node_workflow_id is ids.node_workflow_id
    assert billing_close.close_workflow_id is ids.close_workflow_id
    assert tenant_workflows.allocation_workflow_id is ids.allocation_workflow_id  # offboarding's cancels
    assert tenant_workflows.ALLOCATION_CANCEL_SIGNAL is ids.ALLOCATION_CANCEL_SIGNAL
    assert allocations.allocation_workflow_id is ids.allocation_workflow_id
    assert tenants.onboarding_workflow_id is ids.onboarding_workflow_id
    assert tenants.offboarding_workflow_id is ids.offboarding_workflow_id
    assert recovery.evaluation_workflow_id is ids.evaluation_workflow_id
    assert pulls.incident_workflow_id is ids.incident_workflow_id
    assert pool_scheduler.allocation_workflow_id is ids.allocation_workflow_id
    assert ids.pool_scheduler_workflow_id("H100", "us-east-1") == "scheduler-H100-us-east-1"


def test_a_batch_nudge_has_the_same_id_in_every_process() -> None:
    """`hash()` of a string is salted per process; the id must not be."""
    ids_of = ids.reconcile_now_workflow_id
    code = "from gpucloud.models.workflow_ids import reconcile_now_workflow_id as f; print(f(['n2', 'n1', 'n3']))"
    seen = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(3)
    }
    assert len(seen) == 1
    assert seen.pop().strip() == ids_of(["n3", "n1", "n2"])
    assert ids_of(["n1"]) == "reconcile-n1"
    assert ids_of(["n1", "n2"]) != ids_of(["n1", "n3"])


def test_an_incident_id_names_the_node_and_the_fault_to_the_millisecond() -> None:
    from datetime import UTC, datetime

    at = datetime(2026, 1, 2, 3, 4, 5, 678_901, tzinfo=UTC)
    assert ids.incident_workflow_id("n1", at) == f"incident-n1-{int(at.timestamp() * 1000)}"
    assert ids.incident_workflow_id("n1", at) == ids.incident_workflow_id("n1", at.replace(microsecond=678_000))
    assert ids.incident_workflow_id("n1", at) != ids.incident_workflow_id("n2", at)


def test_a_fleet_incidents_id_names_its_fleet_incident_and_a_trips_its_pool_and_window() -> None:
    from datetime import UTC, datetime

    at = datetime(2026, 1, 2, 3, 4, 5, 678_901, tzinfo=UTC)
    assert ids.fleet_incident_workflow_id("fi-0123abcd") == "incident-fleet-fi-0123abcd"
    ms = int(at.timestamp() * 1000)
    assert ids.breaker_incident_workflow_id("H100/us-east", at) == f"incident-breaker-H100_us-east-{ms}"
    assert (
        ids.breaker_incident_workflow_id("H100/us-east tenant t1", at)
        == f"incident-breaker-H100_us-east_tenant_t1-{ms}"
    )
    assert ids.breaker_incident_workflow_id("H100/r1", at) != ids.breaker_incident_workflow_id("H200/r1", at)
