"""Billing close (`gpucloud/workflows/billing_close.py`) with stand-in ledger activities: the
catch-up closes every ended, open period oldest first, one child each; a period closes once
(its child's id is the period's, reused only after a failure); a failed close stops the
catch-up there and the next run closes it and those after it.

(Named apart from tests/billing/test_billing_close.py: the test folders are not packages, so
two test modules may not share a name.)"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from gpucloud.activities.ledger import LedgerActivities as L
from gpucloud.models.billing_messages import (
    BillingCatchUpInput,
    BillingCatchUpResult,
    BillingCloseInput,
    BillingCloseResult,
    BillingPeriod,
    BillingPeriodsResult,
)
from gpucloud.models.workflow_ids import close_workflow_id
from gpucloud.workflows.billing_close import BillingCatchUpWorkflow, BillingCloseWorkflow
from support.workflow_runs import StandIns, in_turn, queue_name, refused, workers

pytestmark = pytest.mark.workflow


def _periods(*periods: tuple[str, bool, bool]) -> BillingPeriodsResult:
    return BillingPeriodsResult(
        periods=[BillingPeriod(period_id=p, ended=ended, closed=closed) for p, ended, closed in periods]
    )


def _closed(req: BillingCloseInput) -> BillingCloseResult:
    return BillingCloseResult(period_id=req.period_id, closed_ms=1, invoices=2, total_micro=3_000_000)


class Ledger:
    """The ledger's side, as the stand-ins see it: the listing each catch-up run gets, in turn."""

    def __init__(self, *listings: BillingPeriodsResult, close=_closed) -> None:
        self.stand_ins = StandIns({L.list_billing_periods: in_turn(*listings), L.close_billing_period: close})
        self.queue = queue_name("billing")

    @property
    def closes(self) -> list[str]:
        return [req.period_id for req in self.stand_ins.args(L.close_billing_period)]

    async def catch_up(self, client, *, runs: int = 1) -> list[BillingCatchUpResult]:
        """`runs` catch-up runs, one after the other, as the schedule starts them."""
        async with workers(
            client, [BillingCatchUpWorkflow, BillingCloseWorkflow], {self.queue: self.stand_ins.for_worker()}
        ):
            return [
                await client.execute_workflow(
                    BillingCatchUpWorkflow.run,
                    BillingCatchUpInput(),
                    id=f"billing-catch-up-{uuid.uuid4().hex}",
                    task_queue=self.queue,
                    execution_timeout=timedelta(seconds=60),
                )
                for _ in range(runs)
            ]


async def test_the_catch_up_closes_every_ended_open_period_oldest_first(temporal_env) -> None:
    ledger = Ledger(
        _periods(
            ("2026-11", True, False),
            ("2026-12", False, False),  # still running: not closed
            ("2026-09", True, True),  # closed already
            ("2026-10", True, False),
        )
    )
    [result] = await ledger.catch_up(temporal_env.client)
    assert ledger.stand_ins.names == ["list_billing_periods", "close_billing_period", "close_billing_period"]
    assert ledger.closes == ["2026-10", "2026-11"]
    assert result == BillingCatchUpResult(closed=["2026-10", "2026-11"])
    # Each period's close is its own workflow, named by the period.
    handle = temporal_env.client.get_workflow_handle(
        close_workflow_id(ledger.queue, "2026-10"), result_type=BillingCloseResult
    )
    assert (await handle.result()).period_id == "2026-10"


async def test_a_period_closes_once_even_when_the_ledger_still_lists_it_open(temporal_env) -> None:
    listing = _periods(("2026-10", True, False))
    ledger = Ledger(listing, listing)
    first, second = await ledger.catch_up(temporal_env.client, runs=2)
    assert ledger.closes == ["2026-10"]
    assert first.closed == ["2026-10"]
    assert (second.closed, second.already_run) == ([], ["2026-10"])


async def test_a_failed_close_stops_the_catch_up_and_the_next_run_takes_it_again(temporal_env) -> None:
    def close(req: BillingCloseInput):
        if req.period_id == "2026-10" and ledger.closes.count("2026-10") == 1:
            return refused("the ledger refused (HTTP 409): usage still arriving", "LedgerRefused")
        return _closed(req)

    ledger = Ledger(
        _periods(("2026-09", True, False), ("2026-10", True, False), ("2026-11", True, False)),
        _periods(("2026-09", True, True), ("2026-10", True, False), ("2026-11", True, False)),
        close=close,
    )
    first, second = await ledger.catch_up(temporal_env.client, runs=2)
    assert (first.closed, first.failed) == (["2026-09"], "2026-10")
    assert first.error == "the ledger refused (HTTP 409): usage still arriving"
    assert "2026-11" not in ledger.closes[:2], "periods close in order: a later one waits for the failed one"
    assert (second.closed, second.failed) == (["2026-10", "2026-11"], None)
    assert ledger.closes == ["2026-09", "2026-10", "2026-10", "2026-11"]


async def test_the_catch_up_keeps_why_a_close_failed(temporal_env) -> None:
    ledger = Ledger(
        _periods(("2026-10", True, False)),
        close=refused("the ledger refused (HTTP 409): usage still arriving", "LedgerRefused"),
    )
    [result] = await ledger.catch_up(temporal_env.client)
    assert result.failed == "2026-10"
    assert "usage still arriving" in (result.error or "")


async def test_no_period_to_close_closes_nothing(temporal_env) -> None:
    ledger = Ledger(_periods())  # also what the activity answers without a ledger configured
    [result] = await ledger.catch_up(temporal_env.client)
    assert ledger.stand_ins.names == ["list_billing_periods"]
    assert result == BillingCatchUpResult()
