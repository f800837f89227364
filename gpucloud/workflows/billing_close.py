"""Billing close: every billing period closes once, on a Temporal Schedule that catches up.

`BillingCloseWorkflow` closes one period through the ledger's idempotent close. Its id is
derived from the period (`billing-close-<task queue>-<YYYY-MM>`) and started with the reuse
policy "failed only", so a period that closed is never closed again while a failed close can be
retried. `BillingCatchUpWorkflow` is what the schedule (`billing-close-schedule-<task queue>`,
daily by default, overlap SKIP; see adapters/temporal_gateway.py) starts: it asks the ledger which
periods ended by its clock and are still open, and closes them oldest first, one child each.
A control plane that was down over one or more period ends thus closes all of them on its first
run back, and the schedule's catch-up window makes that run happen as soon as Temporal is up.

Both live in one module because the catch-up only exists to start the close.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ChildWorkflowError, FailureError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.ledger import LedgerActivities
    from gpucloud.models.billing_messages import (
        BillingCatchUpInput,
        BillingCatchUpResult,
        BillingCloseInput,
        BillingCloseResult,
        BillingPeriodsInput,
    )
    from gpucloud.models.workflow_ids import close_workflow_id


@workflow.defn
class BillingCloseWorkflow:
    @workflow.run
    async def run(self, inp: BillingCloseInput) -> BillingCloseResult:
        return await workflow.execute_activity_method(
            LedgerActivities.close_billing_period, inp, **options.LEDGER_CLOSE
        )


@workflow.defn
class BillingCatchUpWorkflow:
    @workflow.run
    async def run(self, inp: BillingCatchUpInput) -> BillingCatchUpResult:
        listed = await workflow.execute_activity_method(
            LedgerActivities.list_billing_periods, BillingPeriodsInput(), **options.LEDGER
        )
        result = BillingCatchUpResult()
        for period in sorted((p for p in listed.periods if p.ended and not p.closed), key=lambda p: p.period_id):
            try:
                await workflow.execute_child_workflow(
                    BillingCloseWorkflow.run,
                    BillingCloseInput(period_id=period.period_id),
                    id=close_workflow_id(workflow.info().task_queue, period.period_id),
                    id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                    execution_timeout=timedelta(hours=1),
                )
            except WorkflowAlreadyStartedError:
                result.already_run.append(period.period_id)
                continue
            except ChildWorkflowError as error:
                # Periods close in order: the later ones wait for the next scheduled run.
                result.failed, result.error = period.period_id, _innermost(error)
                workflow.logger.error("closing %s failed: %s", period.period_id, result.error)
                break
            result.closed.append(period.period_id)
        return result


def _innermost(error: FailureError) -> str:
    """Why a close failed: the child's failure wraps the activity's, which wraps the ledger's
    answer; the outer ones say only that a child or an activity failed."""
    while isinstance(error.cause, FailureError):
        error = error.cause
    return error.message or str(error)
