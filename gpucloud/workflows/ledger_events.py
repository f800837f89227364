"""What an allocation workflow tells the billing ledger: when it and its nodes started and ended.

They are what the tenant is billed for (`ledger/held.py`): a node counts from the moment the
allocation becomes ready (a replacement from its attach) until its release or pull begins. The
ledger also uses them to refuse usage for allocations it never heard of (such usage waits in the
agents' spools until the event arrives) and to reconcile the nodes' meters against held time.

Sends are started where the event happens and not awaited there: a ledger that is down must
not hold up provisioning or a cancel. They are awaited before the run ends or continues as new,
so none is lost; Temporal retries each until the ledger takes it (`options.LEDGER`). A refusal
is logged, not raised: billing must never fail an allocation.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Literal

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.ledger import LedgerActivities
    from gpucloud.models.billing_messages import LedgerAllocationEvent, LedgerEventsInput
    from gpucloud.models.messages import AllocationView


def _price_class(view: AllocationView) -> Literal["reserved", "preemptible"] | None:
    """The class the ledger prices the allocation's held time at (None: on demand)."""
    if view.tier == "reserved":
        return "reserved"
    if view.tier == "preemptible":
        return "preemptible"
    return None


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


class LedgerEvents:
    """Workflow-side: one per allocation workflow run."""

    def __init__(self) -> None:
        self._sends: list[asyncio.Future] = []
        self._release_started_ms: int | None = None

    def started(self, view: AllocationView, node_ids: list[str]) -> None:
        at_ms = _ms(workflow.now())
        self._send(
            view,
            [LedgerAllocationEvent(kind="start", at_ms=at_ms, price_class=_price_class(view))]
            + [LedgerAllocationEvent(kind="node_added", at_ms=at_ms, node_id=n) for n in node_ids],
        )

    def node_removed(self, view: AllocationView, node_id: str) -> None:
        """A node pulled out of the allocation (drain-and-replace): it stops counting now."""
        self._send(view, [LedgerAllocationEvent(kind="node_removed", at_ms=_ms(workflow.now()), node_id=node_id)])

    def node_added(self, view: AllocationView, node_id: str) -> None:
        """A replacement attached (provisioned): it counts from now."""
        self._send(view, [LedgerAllocationEvent(kind="node_added", at_ms=_ms(workflow.now()), node_id=node_id)])

    def releasing(self) -> None:
        """The release begins: the moment the nodes stop counting as allocated."""
        self._release_started_ms = _ms(workflow.now())

    def ended(self, view: AllocationView) -> None:
        at_ms = self._release_started_ms if self._release_started_ms is not None else _ms(workflow.now())
        self._send(
            view,
            [LedgerAllocationEvent(kind="node_removed", at_ms=at_ms, node_id=n) for n in view.node_ids]
            + [LedgerAllocationEvent(kind="end", at_ms=at_ms)],
        )

    async def flushed(self) -> None:
        """Every event sent so far is in the ledger (or was refused and logged)."""
        if self._sends:
            await asyncio.gather(*self._sends)

    def _send(self, view: AllocationView, events: list[LedgerAllocationEvent]) -> None:
        req = LedgerEventsInput(allocation_id=view.allocation_id, tenant_id=view.tenant_id, events=events)
        self._sends.append(asyncio.ensure_future(self._deliver(req)))

    @staticmethod
    async def _deliver(req: LedgerEventsInput) -> None:
        try:
            await workflow.execute_activity_method(LedgerActivities.record_ledger_events, req, **options.LEDGER)
        except ActivityError as error:
            workflow.logger.error("the ledger refused the events of %s: %s", req.allocation_id, error.cause or error)
