"""What the pools' queues keep beyond the allocations themselves (`services/scheduling.py`)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlmodel import Field, SQLModel

from gpucloud.models.tables import UTCDateTime, new_id, timestamp_field


class TenantPoolShare(SQLModel, table=True):
    """A tenant's fair-share weight in one pool (GPU type and region); a tenant with no row has
    weight 1. Queued requests are ordered by the tenant's decayed usage against its weight."""

    __tablename__ = "tenant_pool_share"
    tenant_id: str = Field(primary_key=True, max_length=64)
    gpu_type: str = Field(primary_key=True, max_length=64)
    region: str = Field(primary_key=True, max_length=64)
    weight: float = Field(default=1.0, gt=0)
    updated_at: datetime = timestamp_field()


class ReservationStatus(StrEnum):
    # Accepted, its window not begun: its nodes are held for it from `scheduler.reservation_hold_s`
    # before the start, and taken back from preemptible work ahead of it.
    ACCEPTED = "accepted"
    # Its allocation is placed (provisioning or ready) for the window.
    ACTIVE = "active"
    ENDED = "ended"
    CANCELLED = "cancelled"


class CapacityReservation(SQLModel, table=True):
    """N whole nodes of a pool, inside one fabric domain, booked for [start_at, end_at): billed for
    the window at the reservation price, used or not (`services/reservations.py`)."""

    __tablename__ = "capacity_reservation"
    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(default_factory=lambda: new_id("res"), unique=True, index=True, max_length=64)
    tenant_id: str = Field(index=True, max_length=64)
    gpu_type: str = Field(max_length=64)
    region: str = Field(max_length=64)
    node_count: int
    start_at: datetime = Field(sa_type=UTCDateTime)
    end_at: datetime = Field(sa_type=UTCDateTime)
    status: str = Field(default=ReservationStatus.ACCEPTED, max_length=16, index=True)
    # The allocation the window runs as (tier `reserved`), once placed.
    allocation_id: str | None = Field(default=None, max_length=64)
    # When that allocation was first ready (on time: at or before start_at).
    ready_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    # When the billing ledger recorded the window (it bills it, used or not).
    billed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    idempotency_key: str | None = Field(default=None, max_length=300, unique=True)
    created_at: datetime = timestamp_field()
    updated_at: datetime = timestamp_field()
