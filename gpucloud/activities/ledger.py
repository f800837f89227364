"""Activities that call the billing ledger over HTTP (its own service, its own database).

The ledger may be down while the control plane runs (and the other way round): an unreachable
ledger, or a failure it marks retryable, is a plain error that Temporal retries with backoff for
as long as it takes; a refusal (4xx, integrity failure) is final (non-retryable
`LedgerRefused`). Every call is idempotent on the ledger's side: allocation events by event id,
a period close by period, so a retried activity never bills twice.

Without a configured ledger (`LedgerSettings.url` unset) nothing is billed: events are skipped
and no period is listed.

Billed time comes from these events (`ledger/held.py`), so each carries what pricing needs from
the control plane's own records, never from the node: the allocation's GPU type, and for a node
added its GPU count as enrolled and inspected.
"""

from __future__ import annotations

import asyncio

from sqlmodel import select
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.activities.heartbeats import beats_while_awaited
from gpucloud.db import Database
from gpucloud.ledger.client import LedgerClient, LedgerRefused
from gpucloud.ledger.schemas import AllocationEventIn, ReservationIn
from gpucloud.models.billing_messages import (
    BillingCloseInput,
    BillingCloseResult,
    BillingPeriod,
    BillingPeriodsInput,
    BillingPeriodsResult,
    LedgerEventsInput,
    LedgerEventsResult,
)
from gpucloud.models.messages import PoolRef
from gpucloud.models.tables import Allocation, Node
from gpucloud.services import reservations


class LedgerActivities(ActivityGroup):
    def __init__(self, ledger: LedgerClient | None, db: Database | None = None) -> None:
        self.ledger = ledger
        self.db = db

    def _shapes(self, allocation_id: str, node_ids: list[str]) -> tuple[str | None, dict[str, tuple[str, int]]]:
        """The allocation's GPU type and each node's (GPU type, GPU count), from the fleet's records."""
        if self.db is None:
            return None, {}
        with self.db.session() as session:
            allocation = session.exec(select(Allocation).where(Allocation.id == allocation_id)).first()
            nodes = session.exec(select(Node).where(Node.id.in_(node_ids))).all() if node_ids else []  # type: ignore[attr-defined]
            return (
                allocation.gpu_type if allocation is not None else None,
                {node.id: (node.gpu_type, node.gpu_count) for node in nodes},
            )

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
        added = sorted({e.node_id for e in req.events if e.kind == "node_added" and e.node_id is not None})
        gpu_type, nodes = await asyncio.to_thread(self._shapes, req.allocation_id, added)
        for event in req.events:
            node_type, gpu_count = nodes.get(event.node_id or "", (gpu_type, None))
            await _refusal_is_final(
                ledger.record_allocation_event(
                    AllocationEventIn(
                        event_id=f"{req.allocation_id}/{event.kind}/{event.node_id or '-'}/{event.at_ms}",
                        allocation_id=req.allocation_id,
                        tenant_id=req.tenant_id,
                        kind=event.kind,
                        at_ms=event.at_ms,
                        node_id=event.node_id,
                        gpu_type=node_type if event.kind in ("start", "node_added") else None,
                        gpu_count=gpu_count if event.kind == "node_added" else None,
                        price_class=event.price_class if event.kind == "start" else None,
                    )
                )
            )
        return LedgerEventsResult(recorded=len(req.events))

    @activity.defn
    async def record_reservations(self, req: PoolRef) -> int:
        """Send the pool's capacity reservations whose window has begun and that the ledger has not
        recorded (idempotent on the reservation id there), marking each sent; how many. A
        reservation is billed for its window from its start, used or not; one cancelled before it
        is never sent.

        One the ledger refuses does not hold back the others: each is sent, and the refused ones
        are named in one final error at the end (they stay unsent, tried again at the next plan)."""
        if self.ledger is None or self.db is None:
            return 0
        due = await asyncio.to_thread(reservations.unbilled, self.db, req.gpu_type, req.region)
        ledger = self._client()
        refused: list[str] = []
        for r in due:
            try:
                await ledger.record_reservation(
                    ReservationIn(
                        reservation_id=r.id,
                        tenant_id=r.tenant_id,
                        gpu_type=r.gpu_type,
                        node_count=r.node_count,
                        start_ms=int(r.start_at.timestamp() * 1000),
                        end_ms=int(r.end_at.timestamp() * 1000),
                    )
                )
            except LedgerRefused as error:
                refused.append(f"{r.id} (HTTP {error.status}: {error})")
                continue
            await asyncio.to_thread(reservations.mark_billed, self.db, r.id)
        if refused:
            raise ApplicationError(
                f"the ledger refused {len(refused)} of {len(due)} reservations: {'; '.join(refused)}",
                type="LedgerRefused",
                non_retryable=True,
            )
        return len(due)

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
    @beats_while_awaited
    async def close_billing_period(self, req: BillingCloseInput) -> BillingCloseResult:
        closed = await _refusal_is_final(self._client().close_period(req.period_id))
        return BillingCloseResult(
            period_id=closed.period_id,
            closed_ms=closed.closed_ms,
            invoices=len(closed.invoices),
            total_micro=sum(invoice.total_micro for invoice in closed.invoices),
        )


async def _refusal_is_final(call):
    try:
        return await call
    except LedgerRefused as error:
        raise ApplicationError(
            f"the ledger refused (HTTP {error.status}): {error}", type="LedgerRefused", non_retryable=True
        ) from error
