"""The control plane's Temporal Schedules, created (or updated) idempotently at worker start-up:
the reconciler's sweep, and the billing close (when a ledger is configured)."""

from __future__ import annotations

from datetime import timedelta

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
)
from temporalio.common import WorkflowIDConflictPolicy

from gpucloud.config import Settings
from gpucloud.models.billing_messages import BillingCatchUpInput
from gpucloud.models.messages import SweepInput
from gpucloud.workflows import billing_close
from gpucloud.workflows.reconciler import SCHEDULE_ID, ReconcileSweepWorkflow


def schedule_id(settings: Settings) -> str:
    # One schedule per task queue: each control plane sharing a Temporal namespace has its own.
    return f"{SCHEDULE_ID}-{settings.temporal.task_queue}"


def sweep_schedule(settings: Settings) -> Schedule:
    return Schedule(
        action=ScheduleActionStartWorkflow(
            ReconcileSweepWorkflow.run,
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
    key = node_ids[0] if len(node_ids) == 1 else f"batch-{abs(hash(tuple(sorted(node_ids))))}"
    await client.start_workflow(
        ReconcileSweepWorkflow.run,
        SweepInput(node_ids=node_ids),
        id=f"reconcile-{key}",
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


def billing_schedule_id(settings: Settings) -> str:
    return f"{billing_close.SCHEDULE_ID}-{settings.temporal.task_queue}"


def billing_close_schedule(settings: Settings) -> Schedule:
    # SKIP: one catch-up at a time. A run missed while Temporal was down is run when it is back
    # (the schedule's catch-up window, a year by default), and it closes every period that ended.
    # The offset (an hour past midnight UTC, daily) lets the agents ship a month's last samples
    # before the month closes; whatever comes later is billed as an adjustment next month.
    every = timedelta(seconds=settings.ledger.close_interval_s)
    return Schedule(
        action=ScheduleActionStartWorkflow(
            billing_close.BillingCatchUpWorkflow.run,
            BillingCatchUpInput(),
            id=f"billing-catch-up-{settings.temporal.task_queue}",
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
