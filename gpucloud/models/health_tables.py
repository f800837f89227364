"""Health tables: XID events, signal observations and counter readings as agents (or operators)
reported them, the quarantine pulls the circuit breaker counts (and its per-pool compare-and-swap
word), operator alerts, and what happened to an allocation (its event log).

The node's current judgement lives on the node itself (`Node.health`, `Node.health_conditions`);
these rows are the evidence and the history behind it. Workflow code never imports this module.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlmodel import Field, SQLModel

from gpucloud.models.tables import SYSTEM_ACTOR, UTCDateTime, json_field, timestamp_field


class XidEventRecord(SQLModel, table=True):
    """One XID as it happened; tenant and allocation are stamped from the node's record on ingest."""

    __tablename__ = "xid_event"

    seq: int | None = Field(default=None, primary_key=True)
    node_id: str = Field(index=True)
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    xid: int
    timestamp: datetime = Field(sa_type=UTCDateTime, index=True)
    message: str = ""
    tenant_id: str | None = None
    allocation_id: str | None = None
    source: str = "agent"  # agent | operator
    received_at: datetime = timestamp_field()


class SignalObservationRecord(SQLModel, table=True):
    """One observation of a signal beyond XIDs (`protocol.reports.SignalObservation`: kernel log,
    InfiniBand sysfs) as a node reported it; tenant and allocation are stamped from the node's
    record on ingest, as for XIDs. Pruned on ingest: past the lemon window all, past the trend
    window those of signals below drain level (`health.signals.SIGNAL_TABLE`)."""

    __tablename__ = "signal_observation"
    __table_args__ = (
        sa.Index("ix_signal_observation_node_time", "node_id", "at"),
        # The fleet's recent faults, for correlation (`services/fleet_incidents.py`).
        sa.Index("ix_signal_observation_at", "at"),
    )

    seq: int | None = Field(default=None, primary_key=True)
    node_id: str
    signal: str
    source: str = ""
    count: int = 1
    span_s: float | None = None  # a counter's growth over this many seconds, ending at `at`
    at: datetime = Field(sa_type=UTCDateTime)
    detail: str = ""
    tenant_id: str | None = None
    allocation_id: str | None = None
    reported_by: str = "agent"  # agent | the operator whose batch carried it
    received_at: datetime = timestamp_field()


class NodeReadingRecord(SQLModel, table=True):
    """One periodic probe reading (`protocol.reports.NodeReading`, as JSON) that the trend rules
    judge. Readings older than the trend window are pruned on ingest, except fatal ones (GPU
    lost, driver gone), which the lemon rule counts for its whole window."""

    __tablename__ = "node_reading"
    __table_args__ = (sa.Index("ix_node_reading_node_time", "node_id", "timestamp"),)

    seq: int | None = Field(default=None, primary_key=True)
    node_id: str
    timestamp: datetime = Field(sa_type=UTCDateTime)
    fatal: bool = False
    reading: dict = json_field(dict)
    received_at: datetime = timestamp_field()


class QuarantineBreaker(SQLModel, table=True):
    """The circuit breaker's compare-and-swap word, one row per pool.

    Every allowed pull moves `generation` on from the value read before the window was counted,
    so of two judgements that counted the same window only one can take its last allowed pull;
    the other counts again (on Postgres its update waits for the first to commit, then matches
    no row). SQLite's write transactions are serialized already (BEGIN IMMEDIATE).
    """

    __tablename__ = "quarantine_breaker"

    pool: str = Field(primary_key=True)
    generation: int = 0


class QuarantinePull(SQLModel, table=True):
    """An automatic pull the circuit breaker allowed: its window is rebuilt from these rows."""

    __tablename__ = "quarantine_pull"

    seq: int | None = Field(default=None, primary_key=True)
    pool: str = Field(index=True)
    node_id: str
    at: datetime = Field(sa_type=UTCDateTime, index=True)


class OperatorAlertPublic(SQLModel):
    seq: int
    kind: str
    pool: str | None
    node_id: str | None
    reason: str
    at: datetime


class OperatorAlertRecord(SQLModel, table=True):
    __tablename__ = "operator_alert"

    seq: int | None = Field(default=None, primary_key=True)
    kind: str
    pool: str | None = None
    node_id: str | None = None
    reason: str
    at: datetime = timestamp_field()


class FleetIncidentPublic(SQLModel):
    id: str
    component_kind: str
    component_id: str
    component_size: int
    node_ids: list[str]
    signals: list[str]
    first_at: datetime
    last_at: datetime
    reason: str
    status: str
    opened_at: datetime
    resolved_at: datetime | None
    resolved_by: str | None
    resolution: str


class FleetIncidentRecord(SQLModel, table=True):
    """Faults on several nodes behind one leaf switch, rack or PDU within the correlation window:
    one incident that suspects the shared component (`health.correlation.FleetIncident`). While
    it is open its nodes (`Node.fleet_incident_id`) are cordoned but not pulled, repaired or
    power-cycled; an operator resolves it, which returns them to normal judgement."""

    __tablename__ = "fleet_incident"
    __table_args__ = (sa.Index("ix_fleet_incident_component", "component_kind", "component_id", "status"),)

    id: str = Field(primary_key=True, max_length=64)
    component_kind: str  # health.correlation.ComponentKind
    component_id: str
    component_size: int  # nodes behind the component when it opened
    node_ids: list[str] = json_field()
    # The nodes the incident cordoned itself (uncordoned again when it is resolved).
    cordoned: list[str] = json_field()
    signals: list[str] = json_field()
    first_at: datetime = Field(sa_type=UTCDateTime)
    last_at: datetime = Field(sa_type=UTCDateTime)
    reason: str
    status: str = Field(default="open", index=True)  # open | resolved
    opened_at: datetime = timestamp_field()
    resolved_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    resolved_by: str | None = None
    resolution: str = ""


class AllocationEventPublic(SQLModel):
    seq: int
    kind: str
    node_id: str | None
    replacement_node_id: str | None
    reason: str
    actor: str
    at: datetime


class AllocationEvent(SQLModel, table=True):
    """What the tenant sees happen to an allocation: fault_notice, degraded, replaced, ready."""

    seq: int | None = Field(default=None, primary_key=True)
    allocation_id: str = Field(index=True)
    tenant_id: str = Field(index=True)
    kind: str
    node_id: str | None = None
    replacement_node_id: str | None = None
    reason: str = ""
    # Who caused it: `system` for the health loop's pulls and replacements, the caller
    # (`api.auth.Caller.actor`) for a create or cancel.
    actor: str = Field(default=SYSTEM_ACTOR, max_length=300)
    at: datetime = timestamp_field()


class IncidentPublic(SQLModel):
    """An incident as the API answers it (a tenant's view has other tenants' data removed)."""

    id: str
    kind: str
    trigger: str = "pull"
    fleet_incident_id: str | None = None
    pool: str | None = None
    status: str
    phase: str
    node_ids: list[str]
    suspected_component: str | None
    category: str
    summary: str
    detected_at: datetime
    pulled_at: datetime | None
    stabilized_at: datetime | None
    diagnosed_at: datetime | None
    repaired_at: datetime | None
    repaired_by: str | None
    gated_at: datetime | None
    closed_at: datetime | None
    tenant_ids: list[str]
    allocation_ids: list[str]
    replacement_node_ids: list[str]
    gpu_count: int
    gpu_hours_lost: float
    signals: list[dict]
    actions: list[dict]
    root_cause: str | None
    follow_ups: list[str] | None
    root_cause_by: str | None
    root_cause_at: datetime | None
    created_at: datetime
    updated_at: datetime


class Incident(SQLModel, table=True):
    """One incident (`docs/health.md`, "Incidents"): a health pull (kind `node`), a correlated
    burst or a circuit-breaker trip (kind `fleet`) followed from detection to its end by its
    workflow (`workflows/incident.py`), which writes each phase's timestamp as the history shows
    it, then the write-up. `workflow_id` is the idempotency key: a re-sent pull finds its row,
    a burst its fleet incident's, a trip its pool's window's."""

    __tablename__ = "incident"

    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(unique=True, index=True)
    workflow_id: str = Field(unique=True, max_length=300)
    kind: str = "node"  # node | fleet
    # What opened it: pull (kind node) | correlated_burst | breaker_trip (kind fleet).
    trigger: str = "pull"
    # A correlated burst's fleet incident (`FleetIncidentRecord`: its open/resolved is the truth).
    fleet_incident_id: str | None = Field(default=None, max_length=64, index=True)
    # A breaker trip's budget key (`services.health.budget_of`: the pool, or a tenant's share of it).
    pool: str | None = None
    # What the kind needs to read its history again (a trip: the pool's GPU type, region, owner
    # and the breaker's settings then; who resolved it, when, and the note).
    detail: dict = json_field(dict)
    # open | resolved | rma | abandoned
    status: str = Field(default="open", index=True)
    # The phase awaited next: stabilize, diagnose, repair, gate; write_up; closed.
    phase: str = "stabilize"
    node_id: str | None = Field(default=None, index=True)  # a node incident's node
    node_ids: list[str] = json_field()
    suspected_component: str | None = None
    category: str = "other"  # health.categories.FaultCategory
    summary: str = ""
    detected_at: datetime = Field(sa_type=UTCDateTime)
    pulled_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    stabilized_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    diagnosed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    repaired_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    repaired_by: str | None = None  # the rung that fixed it
    gated_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    closed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    # The tenant whose allocation held a node incident's node, and every tenant and allocation
    # touched (a tenant's listing filters on `IncidentTenant`, which holds both kinds').
    tenant_id: str | None = Field(default=None, index=True)
    tenant_ids: list[str] = json_field()
    allocation_ids: list[str] = json_field()
    replacement_node_ids: list[str] = json_field()
    gpu_count: int = 0
    gpu_hours_lost: float = 0.0
    signals: list[dict] = json_field()
    actions: list[dict] = json_field()
    # Written by an operator (`POST /v1/incidents/{id}/root-cause`).
    root_cause: str | None = None
    follow_ups: list[str] | None = Field(default=None, sa_column=sa.Column(sa.JSON, nullable=True))
    root_cause_by: str | None = None
    root_cause_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    write_up: str | None = Field(default=None, sa_column=sa.Column(sa.Text, nullable=True))
    created_at: datetime = timestamp_field()
    updated_at: datetime = timestamp_field()


class IncidentTenant(SQLModel, table=True):
    """An allocation (and its node) an incident touched, with the allocation's tenant: what a
    tenant's listing filters on (a fleet incident touches many tenants, a node incident one)."""

    __tablename__ = "incident_tenant"

    incident_id: str = Field(primary_key=True)
    allocation_id: str = Field(primary_key=True)
    node_id: str = Field(primary_key=True)
    tenant_id: str = Field(index=True)
