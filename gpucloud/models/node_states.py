"""The node provision state machine: one transition table, enforced in one place.

Provision state is one field, separate from health (`ok | suspect | failed`) and from the
operator's `cordoned` / `maintenance` flags. Every transient state has a deadline and a failure
target, so no node can be stuck: `FAIL` and `DEADLINE` from a transient state always lead to its
failure target.

The wipe is a state on every way into the pool: `burn_in` is entered only from `wiping`, and
`available` only from `burn_in` (or from `reserved`: unreserve, or the reservation's deadline,
safe because a reservation never touches the node). A node's first bring-up is wiped too, as
Ironic cleans a node before it is first available: a new node, or one back from RMA, may carry
anything, and a repaired node may still hold the data of the tenant it was pulled from.

Pure code: no I/O, no clock. Callers pass `now` where time matters.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum


class NodeState(StrEnum):
    ENROLLED = "enrolled"
    INSPECTING = "inspecting"
    BURN_IN = "burn_in"
    AVAILABLE = "available"
    RESERVED = "reserved"
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    RELEASING = "releasing"
    WIPING = "wiping"
    DRAINING = "draining"
    QUARANTINED = "quarantined"
    REPAIRING = "repairing"
    RMA = "rma"
    RETIRED = "retired"


class NodeEvent(StrEnum):
    INSPECT = "inspect"
    OK = "ok"
    FAIL = "fail"
    DEADLINE = "deadline"
    RESERVE = "reserve"
    UNRESERVE = "unreserve"
    PROVISION = "provision"
    RELEASE = "release"
    DRAIN = "drain"
    REPAIR = "repair"
    RETIRE = "retire"
    HARDWARE_REPLACED = "hardware_replaced"


S, E = NodeState, NodeEvent

# Transient states: how long a node may stay, and where it goes when the step fails or the
# deadline passes. Deadlines are generous real-world figures; the simulated fleet finishes far
# sooner, and tests scale them down with `scale`.
TRANSIENT: dict[NodeState, tuple[timedelta, NodeState]] = {
    S.INSPECTING: (timedelta(minutes=30), S.QUARANTINED),
    S.BURN_IN: (timedelta(hours=4), S.QUARANTINED),
    S.RESERVED: (timedelta(minutes=10), S.AVAILABLE),
    S.PROVISIONING: (timedelta(minutes=30), S.WIPING),
    S.RELEASING: (timedelta(minutes=10), S.WIPING),
    S.WIPING: (timedelta(hours=1), S.QUARANTINED),
    S.DRAINING: (timedelta(hours=2), S.QUARANTINED),
    S.REPAIRING: (timedelta(hours=4), S.RMA),
}

STABLE = frozenset({S.ENROLLED, S.AVAILABLE, S.ACTIVE, S.QUARANTINED, S.RMA})
TERMINAL = frozenset({S.RETIRED})
# On their way back to the pool after an allocation, for a time the scheduler does not know: a
# plan counts them as coming back, never as free (`services/scheduling`, `scheduler/stack_check`).
RETURNING_TO_POOL = frozenset({S.RELEASING, S.WIPING, S.BURN_IN, S.RESERVED})

# Explicit moves. FAIL and DEADLINE from transient states are added below from TRANSIENT.
_MOVES: dict[tuple[NodeState, NodeEvent], NodeState] = {
    (S.ENROLLED, E.INSPECT): S.INSPECTING,
    (S.ENROLLED, E.RETIRE): S.RETIRED,
    (S.INSPECTING, E.OK): S.WIPING,
    (S.BURN_IN, E.OK): S.AVAILABLE,
    (S.AVAILABLE, E.RESERVE): S.RESERVED,
    (S.AVAILABLE, E.DRAIN): S.DRAINING,
    (S.RESERVED, E.PROVISION): S.PROVISIONING,
    (S.RESERVED, E.UNRESERVE): S.AVAILABLE,
    (S.PROVISIONING, E.OK): S.ACTIVE,
    (S.ACTIVE, E.RELEASE): S.RELEASING,
    (S.ACTIVE, E.DRAIN): S.DRAINING,
    (S.RELEASING, E.OK): S.WIPING,
    (S.WIPING, E.OK): S.BURN_IN,
    (S.DRAINING, E.OK): S.QUARANTINED,
    (S.QUARANTINED, E.REPAIR): S.REPAIRING,
    (S.QUARANTINED, E.RETIRE): S.RETIRED,
    (S.REPAIRING, E.OK): S.WIPING,
    (S.RMA, E.HARDWARE_REPLACED): S.ENROLLED,
    (S.RMA, E.RETIRE): S.RETIRED,
}

TRANSITIONS: dict[tuple[NodeState, NodeEvent], NodeState] = {
    **_MOVES,
    **{(state, E.FAIL): target for state, (_, target) in TRANSIENT.items()},
    **{(state, E.DEADLINE): target for state, (_, target) in TRANSIENT.items()},
}


class InvalidTransition(ValueError):
    def __init__(self, state: NodeState, event: NodeEvent) -> None:
        allowed = sorted(e.value for (s, e) in TRANSITIONS if s == state)
        super().__init__(
            f"event {event.value!r} is not allowed in state {state.value!r}"
            f" (allowed: {', '.join(allowed) or 'none, the state is terminal'})"
        )
        self.state = state
        self.event = event


def next_state(state: NodeState | str, event: NodeEvent | str) -> NodeState:
    """The one place a node's state changes: the table says where `event` leads, or it raises."""
    state, event = NodeState(state), NodeEvent(event)
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(state, event) from None


# States in which a tenant may hold root on the node: its workload is being provisioned or runs.
TENANT_HELD = frozenset({S.PROVISIONING, S.ACTIVE})


def ends_tenancy(from_state: NodeState | str, to_state: NodeState | str) -> bool:
    """Whether this move takes the node out of its tenant's hands (release, drain, a failed or
    cancelled provision): whatever the tenant could read on the node must stop working here."""
    return NodeState(from_state) in TENANT_HELD and NodeState(to_state) not in TENANT_HELD


def is_transient(state: NodeState | str) -> bool:
    return NodeState(state) in TRANSIENT


def deadline_for(state: NodeState | str, entered_at: datetime, *, scale: float = 1.0) -> datetime | None:
    """When a node that entered `state` at `entered_at` is overdue; None for stable states."""
    entry = TRANSIENT.get(NodeState(state))
    if entry is None:
        return None
    return entered_at + entry[0] * scale


def failure_target(state: NodeState | str) -> NodeState | None:
    entry = TRANSIENT.get(NodeState(state))
    return entry[1] if entry else None


def allowed_events(state: NodeState | str) -> list[NodeEvent]:
    state = NodeState(state)
    return [e for (s, e) in TRANSITIONS if s == state]
