"""Request and response models of the ledger's HTTP API.

Money is integer micro-units of currency, time integer epoch milliseconds, usage
GPU-milliseconds. Usage samples are validated strictly for shape only (integers must be JSON
integers); whether a value makes sense is checked per sample by ingest, so one bad sample is
rejected on its own instead of failing its whole batch.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, with_config
from typing_extensions import TypedDict

from gpucloud.ledger.close import InvoiceLine
from gpucloud.ledger.problems import Problem
from gpucloud.models.billing_messages import InvoiceSummary

MAX_BATCH = 20_000
PAGE_SIZE_MAX = 1000


# Ingest rejects an id past its limit (128 characters, 64 for a GPU type) one sample at a time,
# so one mistaken sample does not hold back its batch. A string past this bound is no mistake but
# a node sending megabytes: its whole batch is refused (422) before ingest holds or echoes it.
MAX_SAMPLE_STRING = 1024
# The last millisecond of the year 9999: any later moment is a mistake, and it keeps every
# timestamp a caller sends inside the database's 64-bit integer columns (past them: a 500).
MAX_TIMESTAMP_MS = 253_402_300_799_999
SampleString = Annotated[str, Field(max_length=MAX_SAMPLE_STRING)]


# Usage samples are TypedDicts, not models: a batch of 8,000 validates about three times
# faster when pydantic does not build an object per sample, and ingest reads them as dicts.
@with_config(ConfigDict(strict=True))
class UsageSampleIn(TypedDict):
    node_id: SampleString
    seq: int
    tenant_id: SampleString
    allocation_id: SampleString
    gpu_type: SampleString
    gpu_count: int
    start_ms: int
    end_ms: int


@with_config(ConfigDict(strict=True))
class UsageBatchIn(TypedDict):
    samples: Annotated[list[UsageSampleIn], Field(max_length=MAX_BATCH)]


USAGE_BATCH = TypeAdapter(UsageBatchIn)


def usage_batch_schema() -> dict:
    """The batch's JSON schema with its definitions inlined, for the OpenAPI document."""
    schema = USAGE_BATCH.json_schema()
    definitions = schema.pop("$defs", {})
    items = schema["properties"]["samples"]["items"]
    schema["properties"]["samples"]["items"] = definitions[items["$ref"].rsplit("/", 1)[-1]]
    return schema


class SampleRejection(BaseModel):
    index: int
    node_id: str
    seq: int
    problem: Problem


class UsageBatchResult(BaseModel):
    accepted: int
    duplicates: int
    rejected: int
    rejections: list[SampleRejection]


PriceClass = Literal["on_demand", "reserved", "preemptible"]


class AllocationEventIn(BaseModel):
    event_id: str = Field(min_length=1, max_length=128)
    allocation_id: str = Field(min_length=1, max_length=128)
    tenant_id: str = Field(min_length=1, max_length=128)
    kind: Literal["start", "node_added", "node_removed", "end"]
    at_ms: int = Field(ge=0, le=MAX_TIMESTAMP_MS)
    node_id: str | None = Field(default=None, min_length=1, max_length=128)
    gpu_type: str | None = Field(default=None, min_length=1, max_length=64)
    gpu_count: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="GPUs of the node a node_added event adds, as the control plane knows it",
    )
    price_class: PriceClass | None = Field(
        default=None,
        description="what a start event says the allocation is billed as; None (and every older event) is on_demand",
    )


class AllocationEventOut(AllocationEventIn):
    id: int
    recorded_ms: int
    replayed: bool = False


class ReservationIn(BaseModel):
    """A capacity reservation the control plane sold: billed for its whole window at the
    reserved price, used or not (`ledger/reservations.py`)."""

    reservation_id: str = Field(min_length=1, max_length=128)
    tenant_id: str = Field(min_length=1, max_length=128)
    gpu_type: str = Field(min_length=1, max_length=64)
    node_count: int = Field(ge=1, le=1024)
    start_ms: int = Field(ge=0, le=MAX_TIMESTAMP_MS)
    end_ms: int = Field(ge=0, le=MAX_TIMESTAMP_MS, description="exclusive; after start_ms")


class ReservationOut(ReservationIn):
    id: int
    gpus_per_node: int
    recorded_ms: int
    replayed: bool = False


class PriceIn(BaseModel):
    gpu_type: str = Field(min_length=1, max_length=64)
    price_per_hour_micro: int = Field(ge=0, le=10**10)
    price_class: PriceClass = Field(
        default="on_demand",
        description="a version prices each GPU type once per class; a class it does not price for a "
        "GPU type is charged the on-demand price",
    )


class DiscountIn(BaseModel):
    tenant_id: str = Field(min_length=1, max_length=128)
    gpu_type: str = Field(min_length=1, max_length=64)
    percent: Decimal = Field(ge=0, le=100, decimal_places=2)


class PriceBookVersionIn(BaseModel):
    effective_from_ms: int = Field(ge=0, le=MAX_TIMESTAMP_MS)
    prices: list[PriceIn] = Field(min_length=1)
    discounts: list[DiscountIn] = []
    note: str = ""


class DiscountOut(BaseModel):
    tenant_id: str
    gpu_type: str
    discount_bp: int


class PriceBookVersionOut(BaseModel):
    id: int
    effective_from_ms: int
    note: str
    created_ms: int
    prices: list[PriceIn] = Field(description="the on-demand prices")
    class_prices: list[PriceIn] = Field(
        default_factory=list,
        description="prices of the other classes (reserved, preemptible) where the version has them",
    )
    discounts: list[DiscountOut]


class EntryLineOut(BaseModel):
    account: str
    side: Literal["debit", "credit"]
    amount_micro: int


class PostingOut(BaseModel):
    id: int
    kind: Literal["usage", "reversal"]
    source: Literal["meter", "held", "reserved"] = Field(
        description="meter: the nodes' samples; held: the close's true-up to the allocation's held time; "
        "reserved: a capacity reservation's window (its id in allocation_id)"
    )
    price_class: PriceClass | None = Field(
        default=None, description="the class a close's posting bills at; None on the meters' postings (on-demand)"
    )
    billing_period: str
    usage_period: str
    tenant_id: str
    allocation_id: str
    gpu_type: str
    price_version_id: int
    gpu_ms: int
    amount_micro: int
    sample_count: int
    reverses_posting_id: int | None
    reason: str
    created_ms: int
    lines: list[EntryLineOut]


class PostingPage(BaseModel):
    items: list[PostingOut]
    next_cursor: str | None


class ReversalIn(BaseModel):
    reason: str = Field(min_length=1, max_length=2000)


class AccountBalance(BaseModel):
    account: str
    debit_micro: int
    credit_micro: int
    balance_micro: int
    """Debits minus credits: positive on receivables, negative on revenue."""


class ConflictOut(BaseModel):
    id: int
    node_id: str
    seq: int
    existing_sample_id: int | None
    received: dict
    detected_ms: int


class Interval(BaseModel):
    start_ms: int
    end_ms: int


class NodeReconciliation(BaseModel):
    node_id: str
    allocated_ms: int
    metered_ms: int
    metered_gpu_ms: int
    held_gpu_ms: int = 0
    """Allocated time x the node's GPUs (its node_added event's count, else its samples'): billed."""
    gaps: list[Interval]
    """Allocated time no sample covers."""
    unallocated: list[Interval]
    """Metered time outside every allocated interval of the node."""
    pending_since_ms: int | None
    """Start of an uncovered stretch that runs up to now on a day still in progress: the
    meter reports each interval after it ends, so this is normally on its way, not lost."""
    edge_ms: int = 0
    """Gaps and unallocated time within the edge tolerance at the allocated intervals' edges
    (the agent's and the control plane's moments of provision and release differ a little)."""


class AllocationReconciliation(BaseModel):
    allocation_id: str
    price_class: str = "on_demand"
    held_gpu_ms: int = 0
    """What the invoice bills for the day (at the price class; a reserved one's is its reservation's)."""
    metered_gpu_ms: int = 0
    """What the nodes' agents reported for the day: corroboration, not billed."""
    metered_minus_held_gpu_ms: int = 0
    nodes: list[NodeReconciliation]


class ReconciliationReport(BaseModel):
    tenant_id: str
    day: str
    start_ms: int
    end_ms: int
    allocations: list[AllocationReconciliation]
    gap_count: int
    unallocated_count: int
    ok: bool


class PeriodCloseOut(BaseModel):
    period_id: str
    start_ms: int
    end_ms: int
    closed_ms: int
    invoices: list[InvoiceSummary]


class PeriodOut(BaseModel):
    period_id: str
    start_ms: int
    end_ms: int
    ended: bool
    """The period is over by the ledger's clock, so it can be closed."""
    closed_ms: int | None
    """When it was closed; None while it is open."""


class InvoicePeriod(BaseModel):
    id: str
    start_ms: int
    end_ms: int


class InvoiceDocument(BaseModel):
    """An invoice's body exactly as the ledger stored it (canonical JSON: sorted keys, integers
    only; `ledger/close.py` builds it); its SHA-256 is the answer's ETag."""

    schema_: str = Field(alias="schema")
    period: InvoicePeriod
    tenant_id: str
    amount_unit: str
    rounding: str
    lines: list[InvoiceLine]
    total_micro: int

    def totals_by_price_class(self) -> dict[str, int]:
        """The invoice's amount by price class (on_demand, reserved, preemptible), reversals
        included in the class they correct; the values add up to `total_micro`."""
        totals: dict[str, int] = {}
        for line in self.lines:
            totals[line.price_class] = totals.get(line.price_class, 0) + line.amount_micro
        return dict(sorted(totals.items()))
