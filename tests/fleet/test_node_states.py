"""The node state machine: the table, deadlines, failure targets, and properties over random
event sequences."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpucloud.models.node_states import (
    STABLE,
    TERMINAL,
    TRANSIENT,
    TRANSITIONS,
    InvalidTransition,
    NodeEvent,
    NodeState,
    allowed_events,
    deadline_for,
    failure_target,
    is_transient,
    next_state,
)

pytestmark = pytest.mark.unit

S, E = NodeState, NodeEvent


def test_every_state_is_exactly_one_of_stable_transient_terminal():
    for state in NodeState:
        kinds = [state in STABLE, state in TRANSIENT, state in TERMINAL]
        assert sum(kinds) == 1, state


def test_happy_paths():
    path = [
        (E.INSPECT, S.INSPECTING),
        (E.OK, S.WIPING),
        (E.OK, S.BURN_IN),
        (E.OK, S.AVAILABLE),
        (E.RESERVE, S.RESERVED),
        (E.PROVISION, S.PROVISIONING),
        (E.OK, S.ACTIVE),
        (E.RELEASE, S.RELEASING),
        (E.OK, S.WIPING),
        (E.OK, S.BURN_IN),
        (E.OK, S.AVAILABLE),
    ]
    state = S.ENROLLED
    for event, expected in path:
        state = next_state(state, event)
        assert state == expected


@pytest.mark.parametrize(
    "state,target",
    [
        (S.INSPECTING, S.QUARANTINED),
        (S.BURN_IN, S.QUARANTINED),
        (S.RESERVED, S.AVAILABLE),
        (S.PROVISIONING, S.WIPING),
        (S.RELEASING, S.WIPING),
        (S.WIPING, S.QUARANTINED),
        (S.DRAINING, S.QUARANTINED),
        (S.REPAIRING, S.RMA),
    ],
)
def test_failure_and_deadline_go_to_the_failure_target(state, target):
    assert failure_target(state) == target
    assert next_state(state, E.FAIL) == target
    assert next_state(state, E.DEADLINE) == target


def test_invalid_transition_names_state_event_and_allowed():
    with pytest.raises(InvalidTransition) as err:
        next_state(S.AVAILABLE, E.PROVISION)
    msg = str(err.value)
    assert "'provision'" in msg and "'available'" in msg and "reserve" in msg
    with pytest.raises(InvalidTransition, match="terminal"):
        next_state(S.RETIRED, E.REPAIR)


def test_deadlines():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    assert deadline_for(S.PROVISIONING, t0) == t0 + timedelta(minutes=30)
    assert deadline_for(S.PROVISIONING, t0, scale=0.1) == t0 + timedelta(minutes=3)
    assert deadline_for(S.AVAILABLE, t0) is None
    assert is_transient(S.WIPING) and not is_transient(S.ACTIVE)
    assert set(allowed_events(S.RESERVED)) == {E.PROVISION, E.UNRESERVE, E.FAIL, E.DEADLINE}


def test_a_repaired_node_is_wiped_before_burn_in():
    path = [E.INSPECT, E.OK, E.OK, E.OK, E.RESERVE, E.PROVISION, E.OK, E.DRAIN, E.OK, E.REPAIR, E.OK]
    state = S.ENROLLED
    for event in path:
        state = next_state(state, event)
    assert state == S.WIPING
    assert next_state(state, E.OK) == S.BURN_IN


# A tenant's node pulled by the health loop, repaired, and back in the pool.
DRAIN_REPAIR = [E.INSPECT, E.OK, E.OK, E.OK, E.RESERVE, E.PROVISION, E.OK, E.DRAIN, E.OK, E.REPAIR, E.OK, E.OK, E.OK]
# The same node sent to RMA after a failed repair, its hardware replaced, brought up again.
RMA_RETURN = [*DRAIN_REPAIR[:10], E.FAIL, E.HARDWARE_REPLACED, E.INSPECT, E.OK, E.OK, E.OK]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(list(NodeEvent)), max_size=60))
@example(events=DRAIN_REPAIR)
@example(events=RMA_RETURN)
def test_random_event_sequences_keep_the_invariants(events):
    """Over any event sequence (invalid events are refused and change nothing):
    - a node that a tenant touched (provisioning) reaches available only after it was wiped
      (wiping -> burn_in) since;
    - burn_in is entered only from wiping, and available only from burn_in or from reserved
      (never touched): the wipe is a state on every way into the pool;
    - every transient state has a way out by FAIL and by DEADLINE (nothing can be stuck)."""
    state = S.ENROLLED
    dirty = False  # tenant data may be on the node
    for event in events:
        try:
            new = next_state(state, event)
        except InvalidTransition:
            assert (state, event) not in TRANSITIONS
            continue
        if new == S.PROVISIONING:
            dirty = True
        if state == S.WIPING and new == S.BURN_IN:
            dirty = False
        if new == S.BURN_IN:
            assert state == S.WIPING
        if new == S.AVAILABLE:
            assert state in (S.BURN_IN, S.RESERVED)
            assert not dirty
        state = new
        if state in TRANSIENT:
            assert (state, E.FAIL) in TRANSITIONS and (state, E.DEADLINE) in TRANSITIONS
