"""Control-plane tables (SQLModel). The DB is the source of truth for resources.

Families follow `XBase -> XCreate / XPublic -> X(table=True)`. Public ids are random and
prefixed (`alloc_…`, `ten_…`) so they cannot be guessed; lists page on the integer `seq`, which
only grows, so a keyset cursor never skips or repeats a row.

Workflow code never imports this module (the sandbox must not load SQLAlchemy).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from pydantic import field_validator
from sqlalchemy.types import TypeDecorator
from sqlmodel import Column, Field, SQLModel

from gpucloud.models.allocation_states import (
    TERMINAL_ALLOCATION as TERMINAL_ALLOCATION,  # the tables' users read it here
)
from gpucloud.models.allocation_states import AllocationStatus
from gpucloud.models.catalog import known_gpu_type
from gpucloud.models.node_states import NodeState
from gpucloud.protocol.actions import Workload


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC on both SQLite (which drops the zone) and Postgres."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC) if value is not None else None


def timestamp_field(**kw: Any) -> Any:
    return Field(default_factory=utcnow, sa_type=UTCDateTime, **kw)


def json_field(default: Callable[[], Any] = list) -> Any:
    return Field(default_factory=default, sa_column=Column(sa.JSON, nullable=False))


# ---------------------------------------------------------------- nodes


class NodeBase(SQLModel):
    id: str = Field(primary_key=True, min_length=1, max_length=128)
    hostname: str = Field(min_length=1, max_length=253)
    region: str = Field(index=True, min_length=1, max_length=64)
    pod: str = Field(
        min_length=1, max_length=128, description="Fabric domain: the InfiniBand pod the node's ports sit in"
    )
    rack: str = Field(min_length=1, max_length=128)
    # Where else the node sits, from the operator's inventory (the simulated fleet reports its
    # own): the leaf switch its fabric ports hang off and the PDU that feeds it. Fleet incidents
    # (`services/fleet_incidents.py`) suspect what several faulting nodes share. None: not known.
    leaf_switch: str | None = Field(default=None, max_length=128, description="the leaf switch its ports hang off")
    pdu: str | None = Field(default=None, max_length=128, description="the power distribution unit that feeds it")
    gpu_type: str = Field(min_length=1, max_length=64)
    gpu_count: int = Field(ge=1, le=72)
    nvlink_domain: str | None = Field(default=None, max_length=128)
    # Out-of-band management (`adapters/bmc.py`): the node's Redfish service, its system there,
    # and a reference to the credential in the control plane's secrets, never the secret.
    bmc_url: str | None = Field(default=None, max_length=500, description="the BMC's Redfish service")
    bmc_system_id: str | None = Field(default=None, max_length=200, description="the node's system on the BMC")
    bmc_credential_ref: str | None = Field(
        default=None, max_length=128, description="the name of the BMC credential in the control plane's secrets"
    )
    # Where a tenant reaches the node: its address on the tenants' network, as the network side
    # (its IPAM) assigned it, and the port its sshd listens on. None: the node takes no SSH.
    ssh_host: str | None = Field(
        default=None,
        max_length=253,
        schema_extra={"pattern": r"^[A-Za-z0-9:][A-Za-z0-9.:-]*$"},
        description="the node's address on the tenants' network (an IP or a DNS name): where ssh connects",
    )
    ssh_port: int = Field(default=22, ge=1, le=65535, description="the port the node's sshd listens on")


class NodeEnroll(NodeBase):
    agent_url: str = Field(min_length=1, max_length=500)
    ib_port_guids: list[str] = Field(default_factory=list, max_length=64)
    # The GPUs' UIDs, as NVML reports them: the members of NVLink partitions (NVL72 trays).
    gpu_uids: list[str] = Field(default_factory=list, max_length=72)

    @field_validator("gpu_type")
    @classmethod
    def _catalogue_spelling(cls, v: str) -> str:
        """A known type in the catalogue's spelling (`h100` enrolls as `H100`): requests, quotas
        and the catalogue compare that one spelling."""
        return known_gpu_type(v) or v


class NodePublic(NodeBase):
    ib_port_guids: list[str]
    gpu_uids: list[str]
    state: NodeState
    generation: int
    health: str
    health_conditions: list[dict]
    cordoned: bool
    maintenance: bool
    allocation_id: str | None
    tenant_id: str | None
    state_entered_at: datetime
    deadline_at: datetime | None
    drain_requested: bool
    last_heartbeat_at: datetime | None
    agent_reachable: bool
    observed: dict
    power_state: str | None
    bmc_last: dict
    hardware: dict
    fleet_incident_id: str | None
    created_at: datetime
    updated_at: datetime


class Node(NodeBase, table=True):
    __table_args__ = (sa.Index("ix_node_pool", "gpu_type", "region", "state", "cordoned"),)

    agent_url: str
    ib_port_guids: list[str] = json_field()
    gpu_uids: list[str] = json_field()
    state: str = Field(default=NodeState.ENROLLED, index=True)
    generation: int = 0
    health: str = "ok"
    health_conditions: list[dict] = json_field()
    cordoned: bool = False
    maintenance: bool = False
    allocation_id: str | None = Field(default=None, index=True)
    # Whose data may be on the node's disks: set at provision, cleared only by a wipe.
    tenant_id: str | None = None
    state_entered_at: datetime = timestamp_field()
    # When the current transient state is overdue (None in stable states): the reconciler's
    # indexed query for stuck nodes.
    deadline_at: datetime | None = Field(default=None, sa_type=UTCDateTime, index=True)
    # Operator intent, acted on by the reconciler.
    drain_requested: bool = Field(default=False, index=True)
    # Observed state, from the agent's heartbeats.
    last_heartbeat_at: datetime | None = Field(default=None, sa_type=UTCDateTime, index=True)
    agent_reachable: bool = Field(default=True, index=True)
    observed: dict = json_field(dict)
    # What the BMC said last: the power state, and its answer to the last call (action, ok, answer).
    power_state: str | None = None
    bmc_last: dict = json_field(dict)
    # What the BMC's Systems resource reports (serial number, model, CPUs, memory, BIOS).
    hardware: dict = json_field(dict)
    # The agent's report disagrees with the record (e.g. an active node that was wiped).
    drifted: bool = Field(default=False, index=True)
    # The open fleet incident that holds the node (`services/fleet_incidents.py`): a shared
    # component is suspected, so it is cordoned but neither pulled, repaired nor power-cycled.
    fleet_incident_id: str | None = Field(default=None, max_length=64, index=True)
    # Per-node backoff of the reconciler's attempts.
    reconcile_attempts: int = 0
    next_reconcile_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    # Scheduled diagnostics of an idle node (`services/diagnostics.py`): when the last one
    # ended, and the lease a running one holds (its id, and when it lapses on its own). No
    # reservation takes a node whose lease has not lapsed.
    last_diag_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    diag_lease: str | None = Field(default=None, max_length=64)
    diag_lease_until: datetime | None = Field(default=None, sa_type=UTCDateTime, index=True)
    created_at: datetime = timestamp_field()
    updated_at: datetime = timestamp_field()

    def bmc_endpoint(self) -> tuple[str, str, str] | None:
        """The BMC's URL, the node's system on it and the credential's name, when enrolled with all
        three (what a power action through the BMC needs); None otherwise."""
        if self.bmc_url and self.bmc_system_id and self.bmc_credential_ref:
            return self.bmc_url, self.bmc_system_id, self.bmc_credential_ref
        return None

    @property
    def has_bmc(self) -> bool:
        return self.bmc_endpoint() is not None


class NodeTransition(SQLModel, table=True):
    """Every state change, recorded in the same transaction as the change itself."""

    seq: int | None = Field(default=None, primary_key=True)
    node_id: str = Field(index=True)
    from_state: str
    to_state: str
    event: str
    cause: str = ""
    actor: str = "system"
    op_id: str | None = None
    generation: int
    at: datetime = timestamp_field()

    @classmethod
    def noted(cls, node: Node, event: str, *, cause: str, actor: str, at: datetime) -> NodeTransition:
        """An event in the node's history that leaves its state as it is (a cordon, a drain
        requested, an operator's flag): the workflows record the moves themselves."""
        return cls(
            node_id=node.id,
            from_state=node.state,
            to_state=node.state,
            event=event,
            cause=cause[:500],
            actor=actor,
            generation=node.generation,
            at=at,
        )


# ---------------------------------------------------------------- tenants and keys


class TenantStatus(StrEnum):
    """`onboarding` ends `active`, or `failed` with every step undone; `offboarding` ends
    `offboarded`. Only an `active` tenant may allocate."""

    ONBOARDING = "onboarding"
    ACTIVE = "active"
    FAILED = "failed"
    OFFBOARDING = "offboarding"
    OFFBOARDED = "offboarded"


class TenantCreate(SQLModel):
    name: str = Field(min_length=1, max_length=100, schema_extra={"pattern": r"^[a-z0-9][a-z0-9-]*$"})


class Outcome(SQLModel):
    """What a tenant's or an allocation's answer says of its course: why it failed, when it was
    made and last changed."""

    failure_reason: str | None
    created_at: datetime
    updated_at: datetime


class OutcomeRow(SQLModel):
    """`Outcome`'s columns, as a table keeps them."""

    failure_reason: str | None = None
    created_at: datetime = timestamp_field()
    updated_at: datetime = timestamp_field()


class TenantPublic(Outcome, TenantCreate):
    id: str
    status: TenantStatus
    vni: int | None
    storage_prefix: str | None


class Tenant(OutcomeRow, TenantCreate, table=True):
    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(default_factory=lambda: new_id("ten"), unique=True, index=True)
    # Names are never reused, not even after offboarding: a name always means one tenant.
    name: str = Field(unique=True)
    status: str = Field(default=TenantStatus.ONBOARDING, index=True)
    # The tenant's VPC: unique while held, cleared when the VPC is released.
    vni: int | None = Field(default=None, unique=True, index=True)
    storage_prefix: str | None = None


# A quota row's `gpu_type` or `region` that stands for every one.
QUOTA_ANY = "*"


class TenantQuotaBase(SQLModel):
    """At most `max_gpus` GPUs of `gpu_type` in `region` in the tenant's live allocations.

    `*` stands for every GPU type or every region (each one counted on its own); the most
    specific row wins, and with no row the control plane's default applies.
    """

    gpu_type: str
    region: str
    max_gpus: int


class TenantQuota(TenantQuotaBase, table=True):
    __table_args__ = (sa.UniqueConstraint("tenant_id", "gpu_type", "region", name="uq_tenant_quota"),)

    seq: int | None = Field(default=None, primary_key=True)
    tenant_id: str = Field(index=True)


# The longest a rotated key or operator token keeps working beside its replacement.
MAX_ROTATION_GRACE = timedelta(days=30)


class ApiKeyPublic(SQLModel):
    id: str
    tenant_id: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    replaced_by: str | None


class ApiKey(SQLModel, table=True):
    """A tenant's API key: only a hash of the secret is kept.

    Valid until revoked (`revoked_at`, at once) or, after a rotation, until `expires_at` (the
    grace period in which the old key and its replacement `replaced_by` both work).
    """

    id: str = Field(primary_key=True)
    tenant_id: str = Field(index=True)
    secret_hash: str
    created_at: datetime = timestamp_field()
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    replaced_by: str | None = None


class OperatorPublic(SQLModel):
    name: str
    role: str
    created_at: datetime
    created_by: str
    revoked_at: datetime | None


# The longest an operator token lives.
MAX_OPERATOR_TOKEN_LIFETIME = timedelta(days=366)


class Operator(SQLModel, table=True):
    """A named operator account (`services.operators`): its role says what its tokens may do,
    and every action taken with them is recorded as `operator:<name>`. Names are never reused,
    so a name in an event always means one person."""

    __tablename__ = "operator_account"
    name: str = Field(primary_key=True)
    role: str
    created_at: datetime = timestamp_field()
    created_by: str
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class OperatorTokenPublic(SQLModel):
    id: str
    operator: str
    created_at: datetime
    expires_at: datetime
    revoked_at: datetime | None
    replaced_by: str | None


class OperatorToken(SQLModel, table=True):
    """An operator's bearer token (`gpo_<id>.<secret>`): only a hash of the secret is kept. It
    always expires; a rotation shortens the old one's life to the grace period."""

    __tablename__ = "operator_token"
    id: str = Field(primary_key=True)
    operator: str = Field(index=True)
    secret_hash: str
    created_at: datetime = timestamp_field()
    expires_at: datetime = Field(sa_type=UTCDateTime)
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    replaced_by: str | None = None


class AgentCredential(SQLModel, table=True):
    """A node's host-agent credential (`gpa_<node id>.<secret>`): only a hash of the secret is
    kept, and issuing another replaces it. It lets the agent report for its own node and nothing
    else: a tenant with root on the node finds no operator power there. Revoked (`revoked_at`)
    the moment a tenant's allocation lets go of the node; the next wipe's credential replaces it."""

    __tablename__ = "agent_credential"
    node_id: str = Field(primary_key=True)
    secret_hash: str
    created_at: datetime = timestamp_field()
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class AgentEnrollment(SQLModel, table=True):
    """A node's one-time enrollment token (`gpe_<node id>.<secret>`, `services.agent_enrollment`):
    handed to the image a re-image booted through its BMC's virtual media (the config drive),
    never to the agent that answered before. Only its hash is kept. Redeemed once
    (`redeemed_at`) for the node's new agent credential, and worthless after `expires_at`."""

    __tablename__ = "agent_enrollment"
    node_id: str = Field(primary_key=True)
    secret_hash: str
    request_id: str  # the re-image step it was handed out for: a retry hands out the same token
    issued_at: datetime = timestamp_field()
    expires_at: datetime = Field(sa_type=UTCDateTime)
    redeemed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


# ---------------------------------------------------------------- allocations and operations


class AllocationCreate(SQLModel):
    gpu_type: str = Field(min_length=1, max_length=64)
    node_count: int = Field(ge=1, le=100_000)
    region: str = Field(min_length=1, max_length=64)
    # A slice of one NVL72 rack: this many trays (node_count of them), one NVLink domain.
    nvl72_trays: int | None = Field(default=None, ge=1, le=18)


class AllocationPublic(Outcome, AllocationCreate):
    workload: Workload | None = None
    id: str
    tenant_id: str
    status: AllocationStatus
    desired: str
    fabric_domain: str | None
    nvlink_domain: str | None
    node_ids: list[str]
    expected_duration_s: int | None = None
    tier: str = "on_demand"
    # A preemptible allocation taken back for another request: when its notice began.
    preempted_at: datetime | None = None
    reservation_id: str | None = None
    # Queued requests (`capacity.wait = queue`): how long it may wait, its place in its pool's
    # queue and when it is expected to start (None: unknown), as of the pool's last plan.
    max_wait_s: int | None = None
    queue_position: int | None = None
    estimated_start_at: datetime | None = None
    placed_at: datetime | None = None


class Allocation(OutcomeRow, AllocationCreate, table=True):
    # A pool's queue and running allocations, read by each plan (`services/scheduling.py`).
    __table_args__ = (sa.Index("ix_allocation_pool_status", "gpu_type", "region", "status"),)
    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(default_factory=lambda: new_id("alloc"), unique=True, index=True)
    tenant_id: str = Field(index=True)
    status: str = AllocationStatus.PROVISIONING
    # Intent: what the tenant wants (`running` or `cancelled`); status is what is.
    desired: str = "running"
    fabric_domain: str | None = None
    # The NVL72 rack of an `nvl72_trays` slice (replacements come from it too).
    nvlink_domain: str | None = None
    node_ids: list[str] = json_field()
    # What provision starts on each node (`protocol.actions.Workload` as JSON; None: nothing).
    workload: dict | None = Field(default=None, sa_column=Column(sa.JSON, nullable=True))
    # `<caller>:<Idempotency-Key>` of the create that made it: a create re-run after its first
    # try died mid-request finds the allocation that try committed instead of making another.
    idempotency_key: str | None = Field(default=None, max_length=300, unique=True, index=True)
    # The rollout that last claimed the allocation (a compare-and-swap at its create): a second
    # create waits its turn while that rollout's workflow runs, and takes it over once it closed.
    active_rollout_id: str | None = Field(default=None, max_length=64)
    # When it claimed it: a claim whose workflow is not found is still starting within
    # `ROLLOUT_START_GRACE_S` of this, and a lost create's (its process died) after it.
    active_rollout_claimed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    # How long the tenant expects it to run (backfill and estimates, `scheduler/policy.py`).
    expected_duration_s: int | None = None
    # `on_demand`, or `preemptible`: runs on capacity nobody else asked for, at a lower price,
    # and is taken back (with notice) when a request that may preempt needs its nodes.
    tier: str = Field(default="on_demand", max_length=16)
    # Preempted: when its notice began, and the request it made room for.
    preempted_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    preempted_for: str | None = Field(default=None, max_length=64)
    # The capacity reservation it runs the window of (tier `reserved`).
    reservation_id: str | None = Field(default=None, max_length=64)
    # A queued request: its longest wait (None: no limit), position and estimated start in its
    # pool's queue (written by each plan), and when nodes were reserved for it.
    max_wait_s: int | None = None
    queue_position: int | None = None
    estimated_start_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    placed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class OperationStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


SYSTEM_ACTOR = "system"
"""The actor of what no request asked for: the reconciler, the health loop, a workflow's own steps."""


class OperationPublic(SQLModel):
    id: str
    kind: str
    resource_id: str
    status: OperationStatus
    error: str | None
    workflow_id: str | None
    actor: str
    created_at: datetime
    updated_at: datetime


class Operation(SQLModel, table=True):
    """A mutation and who asked for it. Changes that finish within their request (quotas, API
    keys, a node's flags) are operations too, recorded already settled: the one audit trail of
    who changed what is this table, read by id like any operation."""

    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(default_factory=lambda: new_id("op"), unique=True, index=True)
    tenant_id: str | None = Field(default=None, index=True)
    kind: str
    # `operator:<name>`, `tenant:<id>/key:<key id>` or `system` (`api.auth.Caller.actor`); no
    # default, so no place that makes an operation can forget to say who asked.
    actor: str = Field(max_length=300)
    resource_id: str = Field(index=True)
    status: str = OperationStatus.RUNNING
    error: str | None = None
    workflow_id: str | None = None
    created_at: datetime = timestamp_field()
    updated_at: datetime = timestamp_field()


class IdempotencyRecord(SQLModel, table=True):
    """A claimed Idempotency-Key: bound to caller, method, path and body hash."""

    __table_args__ = (sa.UniqueConstraint("caller", "key", name="uq_idempotency_caller_key"),)

    seq: int | None = Field(default=None, primary_key=True)
    caller: str
    key: str = Field(max_length=255)
    method: str
    path: str
    body_hash: str
    status_code: int | None = None
    response_body: str | None = None
    created_at: datetime = timestamp_field()
    expires_at: datetime = Field(sa_type=UTCDateTime, index=True)
    # While the request runs, its claim: renewed as it goes; a lapsed one with no response
    # means the request died, and a retry with the key takes the claim over and runs again.
    lease_until: datetime | None = Field(default=None, sa_type=UTCDateTime)


# ---------------------------------------------------------------- console sessions


class ConsoleSession(SQLModel, table=True):
    """A person signed in to the web console (`gpucloud/console/`). The browser holds only a
    random session id (a cookie); the row is found by its SHA-256, so a copy of this table opens
    no session. The credential signed in with is named (`credential_id`: an API key's id, an
    operator token's id, or `bootstrap`) with the hash of its secret, and checked again on every
    request: revoking or rotating it ends the session."""

    __tablename__ = "console_session"

    id_hash: str = Field(primary_key=True, max_length=64)
    role: str = Field(max_length=16)  # "operator" | "tenant"
    credential_id: str = Field(max_length=128)
    credential_hash: str = Field(max_length=64)
    tenant_id: str | None = Field(default=None, max_length=64)
    csrf_token: str = Field(max_length=64)
    created_at: datetime = timestamp_field()
    expires_at: datetime = Field(sa_type=UTCDateTime, index=True)
