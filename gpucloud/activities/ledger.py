"""Activities that call the billing ledger over HTTP (its own service, its own database).

The ledger may be down while the control plane runs (and the other way round): an unreachable
ledger, or a failure it marks retryable, is a plain error that Temporal retries with backoff for
as long as it takes; a refusal (4xx, integrity failure) is final (non-retryable
`LedgerRefused`). Every call is idempotent on the ledger's side: allocation events by event id,
a period close by period, so a retried activity never bills twice.

Without a configured ledger (`LedgerSettings.url` unset) nothing is billed: events are skipped
and no period is listed.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.ledger.client import LedgerClient, LedgerRefused
from gpucloud.ledger.schemas import AllocationEventIn
from gpucloud.models.billing_messages import (
    BillingCloseInput,
    BillingCloseResult,
    BillingPeriod,
    BillingPeriodsInput,
    BillingPeriodsResult,
    LedgerEventsInput,
    LedgerEventsResult,
)


class LedgerActivities:
    def __init__(self, ledger: LedgerClient | None) -> None:
        self.ledger = ledger

    def _client(self) -> LedgerClient:
        if self.ledger is None:
            raise ApplicationError(
                "no ledger is configured (GPUCLOUD_LEDGER__URL)", type="LedgerNotConfigured", non_retryable=True
            )
        return self.ledger

    @activity.defn
    async def record_ledger_events(self, req: LedgerEventsInput) -> LedgerEventsResult:
        """Send an allocation's lifecycle events; ids derive from their content, so a resend is a no-op."""
        if self.ledger is None:
            return LedgerEventsResult(skipped="no ledger configured")
        ledger = self._client()
        for event in req.events:
            await _refusal_is_final(
                ledger.record_allocation_event(
                    AllocationEventIn(
                        event_id=f"{req.allocation_id}/{event.kind}/{event.node_id or '-'}/{event.at_ms}",
                        allocation_id=req.allocation_id,
                        tenant_id=req.tenant_id,
                        kind=event.kind,
                        at_ms=event.at_ms,
                        node_id=event.node_id,
                    )
                )
            )
        return LedgerEventsResult(recorded=len(req.events))

    @activity.defn
    async def list_billing_periods(self, _req: BillingPeriodsInput) -> BillingPeriodsResult:
        if self.ledger is None:
            return BillingPeriodsResult()
        periods = await _refusal_is_final(self._client().periods())
        return BillingPeriodsResult(
            periods=[
                BillingPeriod(period_id=p.period_id, ended=p.ended, closed=p.closed_ms is not None) for p in periods
            ]
        )

    @activity.defn
    async def close_billing_period(self, req: BillingCloseInput) -> BillingCloseResult:
        closed = await _refusal_is_final(self._client().close_period(req.period_id))
        return BillingCloseResult(
            period_id=closed.period_id,
            closed_ms=closed.closed_ms,
            invoices=len(closed.invoices),
            total_micro=sum(invoice.total_micro for invoice in closed.invoices),
        )

    def all(self) -> list:
        return [self.record_ledger_events, self.list_billing_periods, self.close_billing_period]


async def _refusal_is_final(call):
    try:
        return await call
    except LedgerRefused as error:
        raise ApplicationError(
            f"the ledger refused (HTTP {error.status}): {error}", type="LedgerRefused", non_retryable=True
        ) from error
