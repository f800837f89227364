"""A tenant's onboarding and offboarding, each a workflow: a saga and its inverse, sharing the
steps that undo what onboarding made (one module for the two, so those stay in one place).

Onboarding (`tenant-onboard-<tenant id>`, started by `POST /v1/tenants`). The API has already
written, in one transaction, the tenant (`onboarding`), its quotas, its first API key and the
operation; the workflow allocates the tenant's VNI (its VPC), gives it storage (prefix and data
key), and then activates it. A step's transient errors (a fabric manager or the object store
down or slow) are retried for as long as the onboarding's deadline allows (`deadline_s`, hours;
the `deadline` query shows it and the `extend_deadline` signal moves it); a step that is refused
for good, or still failing when the deadline passes, undoes everything: the keys are revoked
first (so nothing can use the tenant while it is taken apart), then every step that was started
is undone in reverse order, and only then does the tenant show `failed`. Each undo also runs for
a step that failed halfway, which is safe because every step and every undo is idempotent.
Activation is the point of no return: once VNI and storage exist, only the DB record is left,
and it is retried until it is written. A re-run on a tenant that is no longer `onboarding`
changes nothing.

Cancelling the onboarding workflow (say, from the Web UI) undoes it like a failed step, but only
once the attempt in flight has ended: no activity of these workflows is ever abandoned halfway
(`_to_the_end`; a step is asked to stop only between attempts), since an undo racing the step it
undoes could leave that step's effect behind. Past the point of no return a cancel is ignored,
and so it is during offboarding, which must end with nothing of the tenant left.

Offboarding (`tenant-offboard-<tenant id>`, started by `DELETE /v1/tenants/{id}`; the API has
moved the tenant to `offboarding`, which stops new allocations): cancel every live allocation
(the DB intent, then a signal to its workflow, as the cancel endpoint does; an allocation whose
workflow has closed already reads the intent from the DB), wait until no allocation is live and
no node holding the tenant's data is on its way to a wipe, revoke the keys, release the VNI,
mark the storage for deletion after the retention period, look up the final billing period when
a ledger is configured (a ledger that refuses is noted in the result), and mark the tenant
`offboarded`. The workflow then sleeps until the
deletion is due (a durable timer) and purges the storage. Every step is retried until it
succeeds: a tenant half-removed would keep a path open."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.storage import TenantStorageActivities
    from gpucloud.activities.tenant import TenantActivities
    from gpucloud.models.messages import CancelRequest
    from gpucloud.models.tables import TenantStatus
    from gpucloud.models.tenant_messages import (
        ActivateTenantInput,
        SettleTenantInput,
        StorageDeletionInput,
        TenantBilling,
        TenantOffboardingInput,
        TenantOffboardingResult,
        TenantOnboardingInput,
        TenantOnboardingResult,
        TenantRef,
        TenantReleaseProgress,
    )
    from gpucloud.models.workflow_ids import ALLOCATION_CANCEL_SIGNAL, allocation_workflow_id
    from gpucloud.workflows.db_steps import db_step

T, Storage = TenantActivities, TenantStorageActivities
# What undoes each onboarding step.
UNDO = {T.allocate_tenant_vni: T.release_tenant_vni, Storage.provision_tenant_storage: Storage.delete_tenant_storage}


class _Cancelled(Exception):
    """The onboarding workflow was asked to stop; what it made is undone."""


class _DeadlinePassed(Exception):
    """A step was still failing when the onboarding's deadline passed; what it made is undone."""


async def _to_the_end(awaitable):
    """Await to the end even when the workflow is cancelled meanwhile: the cancel reaches the
    workflow (see `workflow.cancellation_reason`), never the activity or timer underneath."""
    task = asyncio.ensure_future(awaitable)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise


async def _run(activity, arg, opts: options.ActivityOptions):
    return await _to_the_end(workflow.execute_activity_method(activity, arg, **opts))


def _reason(error: BaseException) -> str:
    if isinstance(error, _DeadlinePassed):
        return str(error)
    if isinstance(error, ActivityError):
        cause = error.cause
        return f"{error.activity_type} failed: {getattr(cause, 'message', None) or cause or error}"
    return "onboarding was cancelled"


@workflow.defn
class TenantOnboardingWorkflow:
    def __init__(self) -> None:
        self._started: list = []
        self._deadline: datetime | None = None
        self._moved = False

    @workflow.query
    def deadline(self) -> str | None:
        """When the steps stop waiting out outages and the onboarding is undone (ISO 8601)."""
        return self._deadline.isoformat() if self._deadline else None

    @workflow.signal
    def extend_deadline(self, seconds: float) -> None:
        """Give the steps `seconds` more to wait out an outage (an operator's call)."""
        if self._deadline is not None and seconds > 0:
            self._deadline += timedelta(seconds=seconds)
            self._moved = True

    @workflow.run
    async def run(self, inp: TenantOnboardingInput) -> TenantOnboardingResult:
        ref = TenantRef(tenant_id=inp.tenant_id)
        self._deadline = workflow.now() + timedelta(seconds=inp.deadline_s)
        try:
            tenant = await _to_the_end(db_step(T.load_tenant, ref))
            if tenant.status != TenantStatus.ONBOARDING:
                return TenantOnboardingResult(
                    tenant_id=tenant.tenant_id,
                    status=tenant.status,
                    vni=tenant.vni,
                    storage_prefix=tenant.storage_prefix,
                )
            vni = await self._step(T.allocate_tenant_vni, ref)
            storage = await self._step(Storage.provision_tenant_storage, ref)
        except (ActivityError, _Cancelled, _DeadlinePassed) as error:
            reason = _reason(error)
            await self._undo(ref)
            failed = SettleTenantInput(tenant_id=inp.tenant_id, operation_id=inp.operation_id, error=reason)
            await _run(T.fail_tenant, failed, options.TENANT_UNTIL_DONE)
            return TenantOnboardingResult(tenant_id=inp.tenant_id, status=TenantStatus.FAILED, error=reason)
        activate = ActivateTenantInput(
            tenant_id=inp.tenant_id, operation_id=inp.operation_id, storage_prefix=storage.prefix
        )
        await _run(T.activate_tenant, activate, options.TENANT_UNTIL_DONE)
        return TenantOnboardingResult(
            tenant_id=inp.tenant_id, status=TenantStatus.ACTIVE, vni=vni.vni, storage_prefix=storage.prefix
        )

    async def _step(self, activity, ref: TenantRef):
        if workflow.cancellation_reason() is not None:
            raise _Cancelled()
        # Recorded before it runs: a step that fails halfway is undone too.
        self._started.append(activity)
        handle = workflow.start_activity_method(
            activity,
            ref,
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            **options.TENANT_STEP,
        )
        passed = await self._until_done_or_deadline(handle)
        try:
            # A step stopped by the deadline or a cancel ends its attempt in flight first: an
            # undo racing the step it undoes could leave the step's effect behind.
            result = await _to_the_end(handle)
        except ActivityError:
            if passed:
                raise _DeadlinePassed(
                    f"{activity.__name__} did not succeed before the onboarding deadline "
                    f"({self.deadline()}); an outside system stayed unavailable"
                ) from None
            raise
        if workflow.cancellation_reason() is not None:
            raise _Cancelled()
        return result

    async def _until_done_or_deadline(self, handle) -> bool:
        """Wait for the step; past the deadline (or on a cancel) ask it to stop. True when the
        deadline passed."""
        assert self._deadline is not None
        while not handle.done():
            left = (self._deadline - workflow.now()).total_seconds()
            if left <= 0:
                handle.cancel()
                return True
            self._moved = False
            try:
                await workflow.wait_condition(lambda: handle.done() or self._moved, timeout=left)
            except TimeoutError:
                pass
            except asyncio.CancelledError:
                handle.cancel()
                return False
        return False

    async def _undo(self, ref: TenantRef) -> None:
        await _run(T.revoke_tenant_keys, ref, options.TENANT_UNTIL_DONE)
        for step in reversed(self._started):
            await _run(UNDO[step], ref, options.TENANT_UNTIL_DONE)


async def _signal_cancel(allocation_id: str, operation_id: str | None) -> None:
    """Tell the allocation's workflow its cancel intent is recorded. A workflow that has closed
    (or is not found) needs no signal: it, or its restart, reads the intent from the DB."""
    handle = workflow.get_external_workflow_handle(allocation_workflow_id(allocation_id))
    try:
        await _to_the_end(handle.signal(ALLOCATION_CANCEL_SIGNAL, CancelRequest(operation_id=operation_id)))
    except ApplicationError as error:
        workflow.logger.info("allocation %s not signalled (%s); its cancel intent is in the DB", allocation_id, error)


@workflow.defn
class TenantOffboardingWorkflow:
    @workflow.run
    async def run(self, inp: TenantOffboardingInput) -> TenantOffboardingResult:
        ref = TenantRef(tenant_id=inp.tenant_id)
        cancelled = await _run(T.cancel_tenant_allocations, ref, options.TENANT_UNTIL_DONE)
        await asyncio.gather(*(_signal_cancel(c.allocation_id, c.operation_id) for c in cancelled.cancels))
        progress = await self._released(ref, poll=timedelta(seconds=inp.poll_s))
        if progress is None:
            workflow.continue_as_new(inp)
        revoked = await _run(T.revoke_tenant_keys, ref, options.TENANT_UNTIL_DONE)
        await _run(T.release_tenant_vni, ref, options.TENANT_UNTIL_DONE)
        deletion = await _run(
            Storage.schedule_tenant_storage_deletion,
            StorageDeletionInput(tenant_id=inp.tenant_id, retention_s=inp.retention_s),
            options.TENANT_UNTIL_DONE,
        )
        billing = await self._billing(ref)
        await _run(
            T.finish_offboarding,
            SettleTenantInput(tenant_id=inp.tenant_id, operation_id=inp.operation_id),
            options.TENANT_UNTIL_DONE,
        )
        result = TenantOffboardingResult(
            tenant_id=inp.tenant_id,
            status=TenantStatus.OFFBOARDED,
            cancelled_allocations=cancelled.allocation_ids,
            nodes_awaiting_repair=progress.nodes_parked,
            keys_revoked=revoked.revoked,
            storage_deletion_due=deletion.due_at,
            billing=billing,
        )
        if deletion.due_at is not None and deletion.due_at > workflow.now():
            await _to_the_end(workflow.sleep(deletion.due_at - workflow.now()))
        await _run(Storage.purge_tenant_storage, ref, options.TENANT_UNTIL_DONE)
        result.storage_deleted = True
        return result

    async def _billing(self, ref: TenantRef) -> TenantBilling:
        """The tenant's final billing period, as far as the ledger tells. It only reads (the
        scheduled close issues the final invoice), so a ledger that refuses for good is noted in
        the result and offboarding goes on: stopping here would leave the tenant half-removed,
        its storage never purged."""
        try:
            return await _run(T.close_tenant_billing, ref, options.LEDGER)
        except ActivityError as error:
            workflow.logger.warning("tenant %s's final billing not looked up: %s", ref.tenant_id, _reason(error))
            return TenantBilling(tenant_id=ref.tenant_id, skipped=_reason(error))

    async def _released(self, ref: TenantRef, *, poll: timedelta) -> TenantReleaseProgress | None:
        """Wait until the tenant's allocations are over and its nodes wiped (or parked for repair,
        which wipes them); None when the history is long enough to continue as new."""
        while True:
            progress = await _to_the_end(db_step(T.tenant_release_progress, ref))
            if progress.done:
                return progress
            if workflow.info().is_continue_as_new_suggested():
                return None
            await _to_the_end(workflow.sleep(poll))
