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
    # What the allocation is billed as, on its `start` event (None: on_demand). A `reserved`
    # allocation runs inside a capacity reservation, which is billed instead of its held time.
    price_class: Literal["on_demand", "reserved", "preemptible"] | None = None


class LedgerEventsInput(BaseModel):
    allocation_id: str
    tenant_id: str
    events: list[LedgerAllocationEvent]


class LedgerEventsResult(BaseModel):
    recorded: int = 0
    # Why nothing was sent (no ledger configured), else None.
    skipped: str | None = None


# The ledger's answers about usage and invoices (`gpucloud.ledger.schemas`), which the control
# plane's API passes on to tenants (`gpucloud.models.api_schemas`): a contract of both.


class UsageByType(BaseModel):
    gpu_type: str
    sample_count: int
    gpu_ms: int
    amount_micro: int
    reversed_gpu_ms: int
    reversed_amount_micro: int


class UsageSummary(BaseModel):
    tenant_id: str
    allocation_id: str | None
    start_ms: int | None
    end_ms: int | None
    sample_count: int
    gpu_ms: int
    amount_micro: int
    reversed_gpu_ms: int
    reversed_amount_micro: int
    net_gpu_ms: int
    net_amount_micro: int
    by_gpu_type: list[UsageByType]


class InvoiceSummary(BaseModel):
    tenant_id: str
    total_micro: int
    line_count: int
    sha256: str


class InvoiceOut(InvoiceSummary):
    id: int
    period_id: str
    created_ms: int
