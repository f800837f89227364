"""The public API's wire schemas: what its routes take and answer, beside the tables' public
views in `gpucloud.models`. A contract: the API's routers, the services and the typed client
(`gpucloud.client`) share it, so it lives on the bottom floor and imports only what is there."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gpucloud.models.billing_messages import InvoiceOut, UsageByType, UsageSummary
from gpucloud.models.catalog import (
    GPU_TYPES,
    MAX_NODES_PER_ALLOCATION,
    NVL72_GPU_TYPES,
    NVL72_TRAYS_PER_RACK,
    known_gpu_type,
)
from gpucloud.models.health_tables import (
    AllocationEventPublic,
    FleetIncidentPublic,
    IncidentPublic,
    OperatorAlertPublic,
)
from gpucloud.models.operator_roles import Role
from gpucloud.models.rollout_messages import (
    RolloutProgress,
    Thresholds,
    WaveSpec,
)
from gpucloud.models.tables import (
    MAX_OPERATOR_TOKEN_LIFETIME,
    MAX_ROTATION_GRACE,
    QUOTA_ANY,
    AllocationPublic,
    ApiKeyPublic,
    NodeEnroll,
    NodePublic,
    OperationPublic,
    OperatorPublic,
    OperatorTokenPublic,
    TenantPublic,
    TenantQuotaBase,
)
from gpucloud.protocol.actions import Workload
from gpucloud.protocol.reports import NodeReading, WorkloadStatus

# ---------------------------------------------------------------- allocations


def region_name(v: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", v):
        raise ValueError("must be a region name like 'us-east-1'")
    return v


def gpu_type_name(v: str) -> str:
    if (name := known_gpu_type(v)) is None:
        raise ValueError(f"unknown GPU type {v!r}; known: {', '.join(sorted(GPU_TYPES))}")
    return name


# A pool as a request names it: a GPU type the catalog sells (spelt as the catalog spells it), a
# region name.
GpuTypeName = Annotated[str, AfterValidator(gpu_type_name)]
RegionName = Annotated[str, AfterValidator(region_name)]


class CapacityRequest(BaseModel):
    """What a create does when no fabric domain has room for the gang now (docs/scheduling.md)."""

    model_config = ConfigDict(extra="forbid")

    wait: Literal["fail", "queue"] = Field(
        default="fail",
        description="`fail` (the default): answer 409 insufficient-capacity at once; `queue`: wait in the"
        " pool's queue (status `queued`) and be placed as a whole gang when a fabric domain has room",
    )
    max_wait_s: int | None = Field(
        default=None,
        ge=1,
        le=30 * 86_400,
        description="with `queue`: fail the request if it is not placed within this many seconds (none: wait)",
    )

    @model_validator(mode="after")
    def _wait_bounds(self) -> CapacityRequest:
        if self.wait == "fail" and self.max_wait_s is not None:
            raise ValueError("max_wait_s applies only to wait = 'queue'")
        return self


class AllocationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu_type: str
    # A slice of one NVL72 rack: this many trays, one NVLink partition; node_count may be left out.
    nvl72_trays: int | None = None
    node_count: int | None = Field(default=None, validate_default=True)
    region: str
    workload: Workload | None = Field(
        default=None, description="what each node runs once provisioned, in a process tree its agent owns"
    )
    capacity: CapacityRequest = Field(default_factory=CapacityRequest)
    tier: Literal["on_demand", "preemptible"] = Field(
        default="on_demand",
        description="`preemptible`: runs only on capacity nobody else asked for, at the preemptible price, and is"
        " taken back with notice (an event, then the workload's SIGTERM and grace period) when an on-demand"
        " request needs its nodes",
    )
    expected_duration_s: int | None = Field(
        default=None,
        ge=1,
        le=365 * 86_400,
        description="how long the allocation is expected to run: lets a queued request backfill ahead of a"
        " larger one, and gives the queue its estimated starts",
    )

    @model_validator(mode="after")
    def _queue_is_for_gangs(self) -> AllocationRequest:
        if self.capacity.wait == "queue" and self.nvl72_trays is not None:
            raise ValueError("capacity.wait = 'queue' is for whole-node gangs; an nvl72_trays slice uses 'fail'")
        return self

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        return gpu_type_name(v)

    @field_validator("nvl72_trays")
    @classmethod
    def _slice(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is None:
            return v
        if not 1 <= v <= NVL72_TRAYS_PER_RACK:
            raise ValueError(f"must be between 1 and {NVL72_TRAYS_PER_RACK} (the compute trays of one NVL72 rack)")
        gpu_type = info.data.get("gpu_type")
        if gpu_type is not None and gpu_type not in NVL72_GPU_TYPES:
            raise ValueError(
                f"{gpu_type} does not come in NVL72 racks; slices are of {', '.join(sorted(NVL72_GPU_TYPES))}"
            )
        return v

    @field_validator("node_count")
    @classmethod
    def _count(cls, v: int | None, info: ValidationInfo) -> int | None:
        trays = info.data.get("nvl72_trays")
        if v is None:
            if trays is None and "nvl72_trays" in info.data:
                raise ValueError("Field required (or nvl72_trays, for a slice of an NVL72 rack)")
            return trays
        if not 1 <= v <= MAX_NODES_PER_ALLOCATION:
            raise ValueError(f"must be between 1 and {MAX_NODES_PER_ALLOCATION}")
        if trays is not None and v != trays:
            raise ValueError(f"must equal nvl72_trays ({trays}) or be left out")
        return v

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        return region_name(v)


class AllocationAccepted(BaseModel):
    allocation: AllocationPublic
    operation: OperationPublic | None


class AllocationPage(BaseModel):
    items: list[AllocationPublic]
    next_page_token: str


class AllocationEventPage(BaseModel):
    items: list[AllocationEventPublic]
    next_page_token: str


# ---------------------------------------------------------------- API keys


class ApiKeyCreated(BaseModel):
    id: str
    tenant_id: str
    key: str | None = Field(description="`gpc_<id>.<secret>`, shown in this response only (null on a replay)")
    created_at: datetime
    replaces: str | None = Field(default=None, description="the rotated key")
    replaced_key_expires_at: datetime | None = Field(default=None, description="when the rotated key stops working")


class ApiKeyList(BaseModel):
    items: list[ApiKeyPublic]


class RotateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Required: neither default is safe. Zero cuts off every process still holding the old key;
    # any grace keeps a leaked key alive. The caller says which it means.
    grace_period_s: int = Field(
        ge=0,
        le=int(MAX_ROTATION_GRACE.total_seconds()),
        description="seconds the old key keeps working (required; 0: it stops now)",
    )


# ---------------------------------------------------------------- tenants and quotas

MAX_QUOTA_GPUS = 10_000_000


class QuotaRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu_type: str = Field(description="a GPU type, or `*` for every type")
    region: str = Field(description="a region, or `*` for every region")
    max_gpus: int = Field(ge=0, le=MAX_QUOTA_GPUS)

    @field_validator("gpu_type")
    @classmethod
    def _gpu(cls, v: str) -> str:
        if v == QUOTA_ANY:
            return v
        if (name := known_gpu_type(v)) is None:
            raise ValueError(f"unknown GPU type {v!r}; known: {', '.join(sorted(GPU_TYPES))}, or '*'")
        return name

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        if v != QUOTA_ANY and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", v):
            raise ValueError("must be a region name like 'us-east-1', or '*'")
        return v


def _unique(quotas: list[QuotaRequest]) -> list[QuotaRequest]:
    seen = set()
    for q in quotas:
        if (q.gpu_type, q.region) in seen:
            raise ValueError(f"quota for {q.gpu_type}/{q.region} given twice")
        seen.add((q.gpu_type, q.region))
    return quotas


class TenantRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[a-z0-9][a-z0-9-]*$")
    quotas: list[QuotaRequest] = Field(
        default_factory=list,
        max_length=200,
        description="the GPUs it may hold per GPU type and region; none given: it may allocate nothing until an "
        "operator grants some (`PUT /v1/tenants/{id}/quotas`)",
    )

    @model_validator(mode="after")
    def _distinct(self) -> TenantRequest:
        _unique(self.quotas)
        return self


class QuotasRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    quotas: list[QuotaRequest] = Field(max_length=200)

    @model_validator(mode="after")
    def _distinct(self) -> QuotasRequest:
        _unique(self.quotas)
        return self


class TenantAccepted(TenantPublic):
    """The tenant being onboarded, with its quotas, its first API key and the operation."""

    quotas: list[TenantQuotaBase]
    api_key: ApiKeyCreated
    operation: OperationPublic


class TenantOperation(BaseModel):
    tenant: TenantPublic
    operation: OperationPublic


class TenantPage(BaseModel):
    items: list[TenantPublic]
    next_page_token: str


class QuotaUsage(BaseModel):
    gpu_type: str
    region: str
    usage_gpus: int
    usage_nodes: int
    max_gpus: int = Field(description="what the quota that applies allows (0 where none is granted)")
    quota: TenantQuotaBase | None = Field(
        description="the granted quota that applies; null where none does (GPUs held before one was removed)"
    )


class QuotaReport(BaseModel):
    tenant_id: str
    quotas: list[TenantQuotaBase] = Field(
        description="exactly what an operator granted: a type and region no row matches may not be allocated"
    )
    usage: list[QuotaUsage]


# ---------------------------------------------------------------- catalog and whoami


class CatalogEntry(BaseModel):
    gpu_type: str
    region: str
    nodes: int = Field(description="nodes of the type in the region in the fleet (retired and RMA'd ones not)")
    available_nodes: int = Field(description="of them, nodes an allocation could take now")
    gpus_per_node: int
    price_per_gpu_hour_micro: int | None = Field(
        description="the price book's price in force now, micro-units per GPU-hour (2490000 = 2.49); null where "
        "the book does not price the type or billing is not configured (`prices_note`)"
    )
    discount_bp: int = Field(0, description="the calling tenant's committed-use discount, basis points")


class Catalog(BaseModel):
    """What the fleet offers: one entry per GPU type and region it has nodes of."""

    items: list[CatalogEntry]
    gpu_types: list[str] = Field(description="the GPU types on offer")
    regions: list[str] = Field(description="the regions on offer")
    price_book_version: int | None = Field(description="the ledger's price book version the prices come from")
    prices_note: str | None = Field(None, description="why prices are missing, when they are")


class PeriodUsage(BaseModel):
    """What the ledger has metered for the tenant in the open billing period so far."""

    period: str = Field(description="YYYY-MM (UTC)")
    net_gpu_ms: int
    net_amount_micro: int
    by_gpu_type: list[UsageByType]


class WhoamiKey(BaseModel):
    id: str
    prefix: str = Field(description="how the key begins (`gpc_<id>.`); the secret is never shown again")
    created_at: datetime
    expires_at: datetime | None


class Whoami(BaseModel):
    """Who the credential in use is. A tenant's key: the tenant, the key, its quotas and what it
    holds; an operator's token: the operator's name, role and scopes."""

    kind: Literal["tenant", "operator"]
    tenant: TenantPublic | None = None
    api_key: WhoamiKey | None = None
    quotas: QuotaReport | None = None
    usage_this_period: PeriodUsage | None = None
    usage_note: str | None = Field(None, description="why `usage_this_period` is missing, when it is")
    operator: str | None = None
    role: str | None = None
    scopes: list[str] = []


# ---------------------------------------------------------------- weight rollouts

MAX_TARGET_NODES = 10_000


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_version: str = Field(
        min_length=1,
        max_length=300,
        description="the version: its manifest digest, MODEL@ALIAS (e.g. `minilm@production`) or MODEL@DIGEST "
        "(a unique prefix of 8+ hex digits will do); recorded as the digest it names at create",
    )
    node_ids: list[str] | None = Field(default=None, min_length=1, max_length=MAX_TARGET_NODES)
    allocation_id: str | None = None
    serving_fleet: bool = False
    waves: list[WaveSpec] | None = Field(default=None, min_length=1, max_length=20)
    bake_s: float = Field(default=300.0, ge=0, le=7 * 86400)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    prefetch_ahead: bool = True


class RolloutAccepted(BaseModel):
    rollout_id: str
    progress: RolloutProgress
    warnings: list[str] = Field(
        default=[], description="what the rollout was started despite, e.g. a version not promoted to production"
    )


class RolloutSummary(BaseModel):
    """One rollout in a listing, as the workflow engine's index has it (its phase and nodes are
    in `GET /v1/rollouts/{id}`)."""

    rollout_id: str
    tenant_id: str | None
    model_version: str | None = Field(description="the digest the rollout records")
    allocation_id: str | None = Field(description="the allocation it targets, when it named one")
    status: str = Field(description="its workflow's: running, completed, failed, terminated, ...")
    started_at: datetime
    closed_at: datetime | None


class RolloutPage(BaseModel):
    items: list[RolloutSummary]
    next_page_token: str


class RolloutCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="", max_length=500)


# ---------------------------------------------------------------- nodes (operators and agents)


class FleetSummary(BaseModel):
    """Node counts across the fleet."""

    total: int
    by_state: dict[str, int]
    by_health: dict[str, int]
    by_gpu_type: dict[str, int]
    by_region: dict[str, int]
    cordoned: int
    agent_unreachable: int


RateSource = Literal["measured", "llama3_default"]


class PoolSpares(BaseModel):
    """One pool's (GPU type and region) spare nodes: what it needs so that a pulled node's
    replacement starts within the target at `probability`, beside what it holds now
    (`services/spares.py`, `health/spares.py` for the model)."""

    pool: str  # `gpu_type/region`, as the circuit breaker names it
    gpu_type: str
    region: str
    nodes: int  # in the fleet (not retired, not RMA)
    spares_held: int  # available now: healthy, neither reserved, cordoned nor in maintenance
    spares_needed: int
    shortfall: int  # needed less held, at least 0
    failures: int  # node incidents detected in the window (not abandoned unpulled)
    node_hours: float  # the pool's nodes' hours in the fleet within the window
    measured_per_node_hour: float | None  # failures / node_hours (None: no hours observed)
    failures_per_node_hour: float  # the rate planned on: see rate_source
    # measured: the Garwood upper bound on the pool's own record (enough node-hours seen);
    # llama3_default: the Llama 3 405B run's rate, until then.
    rate_source: RateSource
    repair_hours: float  # a pulled node's mean turnaround
    replacement_target_hours: float  # how long after a pull its replacement may start
    probability: float
    expected_out: float  # mean nodes out beyond the target's reach (Poisson mean)
    coverage_held: float  # P(the spares held cover every node out), at a random moment
    spare_on_failure: float  # P(a failing node finds a spare on hand)


class FleetSpares(BaseModel):
    """Spare capacity per pool, computed at `at` over the `window_s` before it."""

    at: datetime
    window_s: float
    pools: list[PoolSpares]


MAX_ENROLL_BATCH = 1000


class EnrollRequest(BaseModel):
    nodes: list[NodeEnroll] = Field(min_length=1, max_length=MAX_ENROLL_BATCH)


class EnrollResult(BaseModel):
    enrolled: int
    already_known: int
    bringups_started: int
    batches: int = 0
    deferred: int = Field(
        default=0, description="nodes over the limit on concurrent node operations: the sweep brings them up later"
    )


class NodePage(BaseModel):
    items: list[NodePublic]
    next_page_token: str


class NodeActionResult(BaseModel):
    node: NodePublic
    operation: OperationPublic


class MaintenanceRequest(BaseModel):
    enabled: bool
    reason: str = Field("", max_length=500)


class OperatorActionRequest(BaseModel):
    """Why an operator acts on a node (recorded with the event)."""

    reason: str = Field("", max_length=500)


class PowerRequest(BaseModel):
    action: Literal["on", "off", "cycle"] = Field(description="cycle: off, then on, each waited for")
    reason: str = Field("", max_length=500)


class NodeEventPublic(BaseModel):
    seq: int
    from_state: str
    to_state: str
    event: str
    cause: str
    actor: str
    at: datetime


class NodeEventPage(BaseModel):
    items: list[NodeEventPublic]
    next_page_token: str


class SshEndpoint(BaseModel):
    """Where the tenant logs in to a node of its allocation, with a key its workload named."""

    host: str = Field(description="the node's address on the tenants' network")
    port: int
    user: str = Field(description="the login user of the node's image, whose authorized_keys hold the workload's keys")
    command: str = Field(description="the ssh command line that connects")


class AllocationNode(BaseModel):
    """One node of an allocation, as its tenant sees it."""

    node_id: str
    state: str
    health: str
    last_heartbeat_at: datetime | None
    workload: WorkloadStatus | None = Field(None, description="what its agent last reported of the workload")
    ssh: SshEndpoint | None = Field(
        None, description="where to log in while the node is the allocation's (None: the node takes no SSH)"
    )


class AllocationNodes(BaseModel):
    allocation_id: str
    items: list[AllocationNode]


class HeartbeatResult(BaseModel):
    accepted: int
    drifted: list[str]


class LedgerToken(BaseModel):
    token: str = Field(description="a bearer token for the billing ledger: a node's agent posts its own usage with it")
    expires_at: float = Field(description="when it expires (Unix seconds): ask for a new one a minute before")


class AgentCredentialIssued(BaseModel):
    node_id: str
    token: str = Field(description="shown once: give it to the node's agent (`gpucloud agent --token`)")


# ---------------------------------------------------------------- node health

# An agent clock this far ahead would put its reading after every later one: it is refused.
MAX_READING_CLOCK_SKEW = timedelta(minutes=5)


class XidInjection(BaseModel):
    xid: int = Field(ge=0, le=100_000)
    gpu_index: int | None = Field(None, ge=0, le=63)
    message: str = Field("", max_length=1000)


class HealthDecision(BaseModel):
    node_id: str
    health: str
    action: str
    pull: str | None
    alert: str | None


class XidIngestResult(BaseModel):
    accepted: int
    unknown_nodes: list[str]
    decisions: list[HealthDecision]


class SignalIngestResult(BaseModel):
    accepted: int = Field(description="observations stored (those of unknown nodes are not)")
    unknown_nodes: list[str]
    decisions: list[HealthDecision]


class ReadingIngestResult(BaseModel):
    accepted: int
    decisions: list[HealthDecision]


class XidRecordPublic(BaseModel):
    xid: int
    gpu_index: int | None
    timestamp: datetime
    message: str
    source: str


class SignalRecordPublic(BaseModel):
    signal: str
    source: str
    count: int
    span_s: float | None
    at: datetime
    detail: str
    reported_by: str


class NodeHealth(BaseModel):
    node_id: str
    state: str
    health: str
    conditions: list[dict]
    xid_history: list[XidRecordPublic]
    # The newest stored signal observations beyond XIDs (kernel log, InfiniBand), newest first.
    signal_history: list[SignalRecordPublic] = []
    # The newest stored readings, newest first (the trend window's, and fatal ones).
    readings: list[NodeReading]


class AlertPage(BaseModel):
    items: list[OperatorAlertPublic]
    next_page_token: str


IncidentStatusName = Literal["open", "resolved", "rma", "abandoned"]


class IncidentPage(BaseModel):
    items: list[IncidentPublic]
    next_page_token: str


class RootCauseRequest(BaseModel):
    """An operator's root cause of an incident and its follow-ups (None: the ones written stay)."""

    model_config = ConfigDict(extra="forbid")

    root_cause: str = Field(min_length=1, max_length=10_000, description="what caused the incident")
    follow_ups: list[Annotated[str, Field(min_length=1, max_length=500)]] | None = Field(
        None, max_length=50, description="what is to be done so it does not happen again"
    )


class FleetIncidentPage(BaseModel):
    items: list[FleetIncidentPublic]
    next_page_token: str


class FleetIncidentResolve(BaseModel):
    """What the operator found and fixed (recorded with the incident and in its nodes' history)."""

    note: str = Field("", max_length=1000)


class FleetIncidentResolved(BaseModel):
    incident: FleetIncidentPublic
    # The nodes it held, judged again: their decisions on what came after it.
    decisions: list[HealthDecision]


# ---------------------------------------------------------------- billing


class UsageReport(UsageSummary):
    period: str | None


class InvoiceList(BaseModel):
    items: list[InvoiceOut]


# ---------------------------------------------------------------- operator accounts

_MAX_LIFETIME_S = int(MAX_OPERATOR_TOKEN_LIFETIME.total_seconds())


class OperatorRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    role: Role
    expires_in_s: int | None = Field(
        default=None, ge=60, le=_MAX_LIFETIME_S, description="the token's lifetime (default: the API's setting)"
    )


class OperatorRotateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace_period_s: int = Field(
        default=0,
        ge=0,
        le=int(MAX_ROTATION_GRACE.total_seconds()),
        description="how long the old token keeps working (0: it stops now)",
    )
    expires_in_s: int | None = Field(
        default=None, ge=60, le=_MAX_LIFETIME_S, description="the new token's lifetime (default: the API's setting)"
    )


class OperatorView(OperatorPublic):
    tokens: list[OperatorTokenPublic] = Field(description="every token the account had, oldest first")


class OperatorList(BaseModel):
    items: list[OperatorView]


class OperatorTokenIssued(BaseModel):
    operator: OperatorPublic
    token_id: str
    token: str | None = Field(description="`gpo_<id>.<secret>`, shown in this response only (null on a replay)")
    expires_at: datetime
    replaces: str | None = Field(default=None, description="the rotated token")
    replaced_token_expires_at: datetime | None = Field(default=None, description="when the rotated token stops")


class QueueEntryPublic(BaseModel):
    """A queued allocation, as its pool's last plan ranked it (`services/scheduling.py`)."""

    allocation_id: str
    tenant_id: str
    gpu_type: str
    region: str
    node_count: int
    position: int | None
    estimated_start_at: datetime | None
    queued_at: datetime
    max_wait_s: int | None
    expected_duration_s: int | None


class QueuePage(BaseModel):
    items: list[QueueEntryPublic]


class _PoolShare(BaseModel):
    gpu_type: str = Field(min_length=1, max_length=64)
    region: str = Field(min_length=1, max_length=64)
    weight: float = Field(gt=0, le=1000)


class PoolShareRequest(_PoolShare):
    """A tenant's fair-share weight in one pool (default 1): its queued requests are ordered by
    its decayed usage against this weight (docs/scheduling.md). The pool is named as the queue
    names it (`h100` is `H100`), so a share always meets the requests it orders."""

    model_config = ConfigDict(extra="forbid")

    gpu_type: GpuTypeName
    region: RegionName


class PoolSharePublic(_PoolShare):
    tenant_id: str
    updated_at: datetime


class PoolShares(BaseModel):
    items: list[PoolSharePublic]


class ReservationRequest(BaseModel):
    """Book `node_count` whole nodes of a pool, inside one fabric domain, for [start_at, end_at)."""

    model_config = ConfigDict(extra="forbid")

    gpu_type: GpuTypeName
    region: RegionName
    node_count: int = Field(ge=1, le=MAX_NODES_PER_ALLOCATION)
    start_at: datetime = Field(description="when the window begins (UTC); its allocation is ready by then")
    end_at: datetime = Field(description="when it ends: the workload is stopped with its grace period")

    @field_validator("start_at", "end_at")
    @classmethod
    def _aware(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError("must carry its time zone (e.g. 2027-01-01T08:00:00Z)")
        return v


class ReservationPublic(BaseModel):
    id: str
    tenant_id: str
    gpu_type: str
    region: str
    node_count: int
    start_at: datetime
    end_at: datetime
    status: str
    allocation_id: str | None
    ready_at: datetime | None
    created_at: datetime


class ReservationPage(BaseModel):
    items: list[ReservationPublic]
    next_page_token: str
