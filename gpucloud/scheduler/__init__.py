"""What the fleet does when it is full: the pure scheduling policy (issue 43).

`decide(SchedulerState) -> Decision` is the whole policy; see `gpucloud.scheduler.policy` for the
rules. Floor 0: no I/O, no database, no Temporal; the workflows carry out what it decides.
"""

from gpucloud.scheduler.policy import (
    Allocation,
    CapacityReservation,
    Decision,
    Expiry,
    HeadReservation,
    Node,
    Placement,
    PolicySettings,
    Pool,
    Preemption,
    QueuedRequest,
    QueueEntry,
    ReservationStatus,
    SchedulerState,
    TenantShare,
    Tier,
    decayed_usage,
    decide,
    fair_share_factor,
)

__all__ = [
    "Allocation",
    "CapacityReservation",
    "Decision",
    "Expiry",
    "HeadReservation",
    "Node",
    "Placement",
    "PolicySettings",
    "Pool",
    "Preemption",
    "QueueEntry",
    "QueuedRequest",
    "ReservationStatus",
    "SchedulerState",
    "TenantShare",
    "Tier",
    "decayed_usage",
    "decide",
    "fair_share_factor",
]
