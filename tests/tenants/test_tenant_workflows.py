"""Tenant onboarding and offboarding (`gpucloud/workflows/tenant.py`) with stand-in activities:
the onboarding's steps in order, a step refused or still failing at the deadline undone in
reverse after the keys are revoked, a cancel that lets the step in flight end before the undo,
the deadline an operator extends, and offboarding's steps in order up to the storage purge
after its retention, signalling each allocation's workflow (one that is gone is no matter)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from gpucloud.activities.storage import TenantStorageActivities as Storage
from gpucloud.activities.tenant import TenantActivities as T
from gpucloud.models.messages import CancelRequest
from gpucloud.models.tenant_messages import (
    AllocationCancel,
    CancelledAllocations,
    RevokedKeys,
    StorageDeletion,
    TenantBilling,
    TenantOffboardingInput,
    TenantOnboardingInput,
    TenantReleaseProgress,
    TenantStorageResult,
    TenantView,
    TenantVni,
)
from gpucloud.models.workflow_ids import ALLOCATION_CANCEL_SIGNAL, ALLOCATION_WORKFLOW, allocation_workflow_id
from gpucloud.workflows.tenant import TenantOffboardingWorkflow, TenantOnboardingWorkflow
from support.workflow_runs import StandIns, in_turn, queue_name, refused, workers

pytestmark = pytest.mark.workflow

TENANT = "ten_a"
ONBOARDING = ["load_tenant", "allocate_tenant_vni", "provision_tenant_storage", "activate_tenant"]


def _onboarding_answers(**overrides) -> dict:
    answers = {
        T.load_tenant: TenantView(tenant_id=TENANT, name="a", status="onboarding"),
        T.allocate_tenant_vni: TenantVni(tenant_id=TENANT, vni=4242, source="sdn"),
        Storage.provision_tenant_storage: TenantStorageResult(
            tenant_id=TENANT, prefix="tenants/ten_a", data_key_version=1
        ),
        T.activate_tenant: TenantView(tenant_id=TENANT, name="a", status="active"),
        T.revoke_tenant_keys: RevokedKeys(revoked=1),
        T.release_tenant_vni: TenantVni(tenant_id=TENANT),
        Storage.delete_tenant_storage: StorageDeletion(tenant_id=TENANT),
        T.fail_tenant: TenantView(tenant_id=TENANT, name="a", status="failed"),
    }
    return {**answers, **{getattr(T, k, None) or getattr(Storage, k): v for k, v in overrides.items()}}


async def _start_onboarding(client, queue: str, *, deadline_s: float = 3600.0) -> WorkflowHandle:
    return await client.start_workflow(
        TenantOnboardingWorkflow.run,
        TenantOnboardingInput(tenant_id=TENANT, operation_id="op_1", deadline_s=deadline_s),
        id=f"tenant-onboard-{uuid.uuid4().hex}",
        task_queue=queue,
        execution_timeout=timedelta(seconds=60),
    )


async def _onboard(temporal_env, stand_ins: StandIns, **options):
    client, queue = temporal_env.client, queue_name("tenant")
    async with workers(client, [TenantOnboardingWorkflow], {queue: stand_ins.for_worker()}):
        return await (await _start_onboarding(client, queue, **options)).result()


async def test_onboarding_allocates_the_vni_then_the_storage_then_activates(temporal_env) -> None:
    stand_ins = StandIns(_onboarding_answers())
    result = await _onboard(temporal_env, stand_ins)
    assert stand_ins.names == ONBOARDING
    assert (result.status, result.vni, result.storage_prefix, result.error) == ("active", 4242, "tenants/ten_a", None)
    [activate] = stand_ins.args(T.activate_tenant)
    assert (activate.operation_id, activate.storage_prefix) == ("op_1", "tenants/ten_a")


async def test_a_tenant_past_onboarding_is_left_as_it_is(temporal_env) -> None:
    stand_ins = StandIns(
        _onboarding_answers(
            load_tenant=TenantView(tenant_id=TENANT, name="a", status="active", vni=7, storage_prefix="p")
        )
    )
    result = await _onboard(temporal_env, stand_ins)
    assert stand_ins.names == ["load_tenant"]
    assert (result.status, result.vni, result.storage_prefix) == ("active", 7, "p")


async def test_a_refused_step_revokes_the_keys_then_undoes_every_started_step_in_reverse(temporal_env) -> None:
    stand_ins = StandIns(
        _onboarding_answers(provision_tenant_storage=refused("the prefix is taken", "TenantStateConflict"))
    )
    result = await _onboard(temporal_env, stand_ins)
    assert stand_ins.names == [
        "load_tenant",
        "allocate_tenant_vni",
        "provision_tenant_storage",  # refused: no retry
        "revoke_tenant_keys",
        "delete_tenant_storage",  # the failed step is undone too: it may have failed halfway
        "release_tenant_vni",
        "fail_tenant",
    ]
    assert result.status == "failed"
    assert result.error == "provision_tenant_storage failed: the prefix is taken"
    [failed] = stand_ins.args(T.fail_tenant)
    assert (failed.operation_id, failed.error) == ("op_1", result.error)


async def test_a_refused_first_step_undoes_only_itself(temporal_env) -> None:
    stand_ins = StandIns(_onboarding_answers(allocate_tenant_vni=refused("no VNI left", "FabricRefused")))
    result = await _onboard(temporal_env, stand_ins)
    assert stand_ins.names == [
        "load_tenant",
        "allocate_tenant_vni",
        "revoke_tenant_keys",
        "release_tenant_vni",
        "fail_tenant",
    ]
    assert result.status == "failed" and "no VNI left" in (result.error or "")


async def test_an_undo_is_retried_until_it_succeeds(temporal_env) -> None:
    stand_ins = StandIns(
        _onboarding_answers(
            allocate_tenant_vni=refused("no VNI left", "FabricRefused"),
            release_tenant_vni=in_turn(RuntimeError("the SDN controller is down"), TenantVni(tenant_id=TENANT)),
        )
    )
    result = await _onboard(temporal_env, stand_ins)
    assert stand_ins.names[-3:] == ["release_tenant_vni", "release_tenant_vni", "fail_tenant"]
    assert result.status == "failed"


async def test_a_step_still_failing_at_the_deadline_is_undone(temporal_env) -> None:
    stand_ins = StandIns(_onboarding_answers(provision_tenant_storage=RuntimeError("the object store is down")))
    result = await _onboard(temporal_env, stand_ins, deadline_s=1.0)
    tries = stand_ins.names.count("provision_tenant_storage")
    assert stand_ins.names[2 + tries :] == [
        "revoke_tenant_keys",
        "delete_tenant_storage",
        "release_tenant_vni",
        "fail_tenant",
    ]
    # Not taken as a refusal: the outage was waited out until the deadline.
    assert result.status == "failed"
    assert "provision_tenant_storage did not succeed before the onboarding deadline" in (result.error or "")


async def test_an_extended_deadline_lets_a_slow_step_finish(temporal_env) -> None:
    let_go = asyncio.Event()

    async def slow_storage(_req):
        await let_go.wait()
        return TenantStorageResult(tenant_id=TENANT, prefix="tenants/ten_a", data_key_version=1)

    stand_ins = StandIns(_onboarding_answers(provision_tenant_storage=slow_storage))
    client, queue = temporal_env.client, queue_name("tenant")
    async with workers(client, [TenantOnboardingWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start_onboarding(client, queue, deadline_s=2.0)
        await stand_ins.started(Storage.provision_tenant_storage)
        before = datetime.fromisoformat(await handle.query(TenantOnboardingWorkflow.deadline))
        await handle.signal(TenantOnboardingWorkflow.extend_deadline, 3600.0)
        after = datetime.fromisoformat(await handle.query(TenantOnboardingWorkflow.deadline))
        await asyncio.sleep(max(0.0, (before - datetime.now(UTC)).total_seconds()) + 0.5)  # past the first one
        let_go.set()
        result = await handle.result()
        history = [event.event_type async for event in handle.fetch_history_events()]
    # The step was never asked to stop (a step that is, and still succeeds, would also end `active`).
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED not in history
    assert after - before == timedelta(seconds=3600)
    assert stand_ins.names == ONBOARDING
    assert result.status == "active"


async def test_a_cancel_lets_the_step_in_flight_end_then_undoes_it(temporal_env) -> None:
    let_go = asyncio.Event()
    finished: list[str] = []

    async def slow_storage(_req):
        await let_go.wait()
        finished.append("provision_tenant_storage")
        return TenantStorageResult(tenant_id=TENANT, prefix="tenants/ten_a", data_key_version=1)

    stand_ins = StandIns(_onboarding_answers(provision_tenant_storage=slow_storage))
    client, queue = temporal_env.client, queue_name("tenant")
    async with workers(client, [TenantOnboardingWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start_onboarding(client, queue)
        await stand_ins.started(Storage.provision_tenant_storage)
        await handle.cancel()
        await asyncio.sleep(0.5)
        assert stand_ins.names[-1] == "provision_tenant_storage", "nothing is undone while the step runs"
        let_go.set()
        result = await handle.result()
    assert finished == ["provision_tenant_storage"]
    assert stand_ins.names == [
        "load_tenant",
        "allocate_tenant_vni",
        "provision_tenant_storage",
        "revoke_tenant_keys",
        "delete_tenant_storage",
        "release_tenant_vni",
        "fail_tenant",
    ]
    assert (result.status, result.error) == ("failed", "onboarding was cancelled")


# ---------------------------------------------------------------- offboarding


def _cancelled(*allocation_ids: str) -> CancelledAllocations:
    return CancelledAllocations(
        cancels=[AllocationCancel(allocation_id=a, operation_id=f"op_cancel_{a}") for a in allocation_ids]
    )


@workflow.defn(name=ALLOCATION_WORKFLOW, sandboxed=False)  # a test module does not re-import in the sandbox
class AllocationStandIn:
    """Takes the allocation workflow's cancel signal and ends with the operations it named."""

    def __init__(self) -> None:
        self._cancels: list[str | None] = []

    @workflow.signal(name=ALLOCATION_CANCEL_SIGNAL)
    def request_cancel(self, req: CancelRequest) -> None:
        self._cancels.append(req.operation_id)

    @workflow.run
    async def run(self) -> list[str | None]:
        await workflow.wait_condition(lambda: bool(self._cancels))
        return self._cancels


def _offboarding_answers(*, due_at: datetime | None, **overrides) -> dict:
    answers = {
        T.cancel_tenant_allocations: _cancelled("alloc_1", "alloc_2"),
        T.tenant_release_progress: in_turn(
            # The allocations are over, a node is still on its way to a wipe.
            TenantReleaseProgress(open_allocations=0, nodes_in_flight=1, nodes_parked=1),
            TenantReleaseProgress(open_allocations=0, nodes_in_flight=0, nodes_parked=1),
        ),
        T.revoke_tenant_keys: RevokedKeys(revoked=3),
        T.release_tenant_vni: TenantVni(tenant_id=TENANT),
        Storage.schedule_tenant_storage_deletion: StorageDeletion(tenant_id=TENANT, due_at=due_at),
        T.close_tenant_billing: TenantBilling(tenant_id=TENANT, final_period_id="2026-12", usage_gpu_ms=60_000),
        T.finish_offboarding: TenantView(tenant_id=TENANT, name="a", status="offboarded"),
        Storage.purge_tenant_storage: StorageDeletion(tenant_id=TENANT, objects_deleted=9),
    }
    return {**answers, **{getattr(T, k, None) or getattr(Storage, k): v for k, v in overrides.items()}}


async def _start_offboarding(client, queue: str) -> WorkflowHandle:
    return await client.start_workflow(
        TenantOffboardingWorkflow.run,
        TenantOffboardingInput(tenant_id=TENANT, operation_id="op_2", poll_s=0.1, retention_s=1.0),
        id=f"tenant-offboard-{uuid.uuid4().hex}",
        task_queue=queue,
        execution_timeout=timedelta(seconds=60),
    )


async def _offboard(temporal_env, stand_ins: StandIns):
    client, queue = temporal_env.client, queue_name("tenant")
    async with workers(client, [TenantOffboardingWorkflow], {queue: stand_ins.for_worker()}):
        return await (await _start_offboarding(client, queue)).result()


async def test_offboarding_waits_for_the_release_then_removes_the_tenant_and_purges_after_retention(
    temporal_env,
) -> None:
    due = datetime.now(UTC) + timedelta(seconds=1)
    purged_at: list[datetime] = []

    def purge(_req):
        purged_at.append(datetime.now(UTC))
        return StorageDeletion(tenant_id=TENANT, objects_deleted=9)

    stand_ins = StandIns(_offboarding_answers(due_at=due, purge_tenant_storage=purge))
    result = await _offboard(temporal_env, stand_ins)
    assert stand_ins.names == [
        "cancel_tenant_allocations",
        "tenant_release_progress",  # a node still on its way to a wipe
        "tenant_release_progress",  # done (a parked node is wiped by its repair)
        "revoke_tenant_keys",
        "release_tenant_vni",
        "schedule_tenant_storage_deletion",
        "close_tenant_billing",
        "finish_offboarding",
        "purge_tenant_storage",
    ]
    assert purged_at[0] >= due, "the storage is kept until its retention is over"
    [deletion] = stand_ins.args(Storage.schedule_tenant_storage_deletion)
    assert deletion.retention_s == 1.0
    assert stand_ins.args(T.finish_offboarding)[0].operation_id == "op_2"
    assert result.status == "offboarded" and result.storage_deleted
    assert result.cancelled_allocations == ["alloc_1", "alloc_2"]
    assert (result.nodes_awaiting_repair, result.keys_revoked) == (1, 3)
    assert result.billing is not None and result.billing.final_period_id == "2026-12"


async def test_offboarding_retries_a_failing_step_until_it_succeeds(temporal_env) -> None:
    stand_ins = StandIns(
        _offboarding_answers(
            due_at=None,
            tenant_release_progress=TenantReleaseProgress(open_allocations=0, nodes_in_flight=0, nodes_parked=0),
            revoke_tenant_keys=in_turn(RuntimeError("database is locked"), RevokedKeys(revoked=1)),
        )
    )
    result = await _offboard(temporal_env, stand_ins)
    assert stand_ins.names.count("revoke_tenant_keys") == 2
    assert stand_ins.names[-2:] == ["finish_offboarding", "purge_tenant_storage"]
    assert result.status == "offboarded" and result.keys_revoked == 1


async def test_a_ledger_refusal_does_not_leave_the_tenant_half_removed(temporal_env) -> None:
    stand_ins = StandIns(
        _offboarding_answers(due_at=None, close_tenant_billing=refused("ledger answered HTTP 403", "LedgerRefused"))
    )
    result = await _offboard(temporal_env, stand_ins)
    assert stand_ins.names[-2:] == ["finish_offboarding", "purge_tenant_storage"]
    assert result.status == "offboarded" and result.storage_deleted
    assert result.billing == TenantBilling(
        tenant_id=TENANT, skipped="close_tenant_billing failed: ledger answered HTTP 403"
    )


async def test_a_cancel_past_the_point_of_no_return_is_ignored(temporal_env) -> None:
    let_go = asyncio.Event()

    async def slow_activation(_req):
        await let_go.wait()
        return TenantView(tenant_id=TENANT, name="a", status="active")

    stand_ins = StandIns(_onboarding_answers(activate_tenant=slow_activation))
    client, queue = temporal_env.client, queue_name("tenant")
    async with workers(client, [TenantOnboardingWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start_onboarding(client, queue)
        await stand_ins.started(T.activate_tenant)
        await handle.cancel()
        let_go.set()
        result = await handle.result()
    assert stand_ins.names == ONBOARDING
    assert result.status == "active"


async def test_a_cancel_does_not_stop_offboarding(temporal_env) -> None:
    let_go = asyncio.Event()

    async def slow_cancels(_req):
        await let_go.wait()
        return _cancelled("alloc_1")

    stand_ins = StandIns(_offboarding_answers(due_at=None, cancel_tenant_allocations=slow_cancels))
    client, queue = temporal_env.client, queue_name("tenant")
    async with workers(client, [TenantOffboardingWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start_offboarding(client, queue)
        await stand_ins.started(T.cancel_tenant_allocations)
        await handle.cancel()
        let_go.set()
        result = await handle.result()
    assert stand_ins.names[-3:] == ["close_tenant_billing", "finish_offboarding", "purge_tenant_storage"]
    assert result.status == "offboarded" and result.storage_deleted


async def test_offboarding_signals_each_allocation_workflow_and_one_that_is_gone_is_no_matter(temporal_env) -> None:
    live, gone = f"alloc_{uuid.uuid4().hex[:8]}", f"alloc_{uuid.uuid4().hex[:8]}"
    stand_ins = StandIns(_offboarding_answers(due_at=None, cancel_tenant_allocations=_cancelled(live, gone)))
    client, queue = temporal_env.client, queue_name("tenant")
    async with workers(client, [TenantOffboardingWorkflow, AllocationStandIn], {queue: stand_ins.for_worker()}):
        allocation = await client.start_workflow(
            AllocationStandIn.run,
            id=allocation_workflow_id(live),
            task_queue=queue,
            execution_timeout=timedelta(seconds=60),
        )
        result = await (await _start_offboarding(client, queue)).result()
        assert await allocation.result() == [f"op_cancel_{live}"]
    assert result.status == "offboarded" and result.cancelled_allocations == [live, gone]
