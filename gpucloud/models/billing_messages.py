"""Inputs and results of the billing workflows and the ledger activities: one pydantic model each.

Workflow code imports these, so this module imports nothing heavier than pydantic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class BillingCatchUpInput(BaseModel):
    pass


class BillingCatchUpResult(BaseModel):
    closed: list[str] = Field(default_factory=list)
    # Periods whose close workflow had already run (or is running) under its id: not started again.
    already_run: list[str] = Field(default_factory=list)
    # The period whose close failed; the periods after it wait for the next scheduled run.
    failed: str | None = None
    error: str | None = None


class BillingPeriodsInput(BaseModel):
    pass


class BillingPeriod(BaseModel):
    period_id: str
    ended: bool
    closed: bool


class BillingPeriodsResult(BaseModel):
    periods: list[BillingPeriod] = Field(default_factory=list)


class BillingCloseInput(BaseModel):
    period_id: str


class BillingCloseResult(BaseModel):
    period_id: str
    closed_ms: int
    invoices: int
    total_micro: int


class LedgerAllocationEvent(BaseModel):
    kind: Literal["start", "node_added", "node_removed", "end"]
    at_ms: int
    node_id: str | None = None


class LedgerEventsInput(BaseModel):
    allocation_id: str
    tenant_id: str
    events: list[LedgerAllocationEvent]


class LedgerEventsResult(BaseModel):
    recorded: int = 0
    # Why nothing was sent (no ledger configured), else None.
    skipped: str | None = None
