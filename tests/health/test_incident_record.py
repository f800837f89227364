"""An incident's phases are read off the node's history (`health/incidents.py`), its category and
suspected component off the conditions that pulled it, and its write-up
(`health/incident_writeup.py`) says what happened, what it cost and what fixed it. A fleet
incident's phases (a correlated burst's, a breaker trip's) and write-up likewise."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpucloud.health.categories import FaultCategory
from gpucloud.health.incident_writeup import duration, write_up
from gpucloud.health.incidents import (
    BurstNode,
    IncidentStatus,
    Phase,
    Replacement,
    Step,
    breaker_phases,
    burst_category,
    classify,
    fleet_gpu_hours_lost,
    fleet_phases,
    gpu_hours_lost,
    phases,
    rung_of,
)
from gpucloud.health.pulls import PullDecision, PullKind, pulling_since
from gpucloud.models.health_tables import IncidentPublic

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# What a fatal XID on an allocated node leaves in its history, repaired by the first rung.
HISTORY = [
    Step(at(-3600), "ok", "provisioning", "active", "provision ok"),  # before the fault: not the incident's
    Step(at(1), "cordon", "active", "active", "xid_79: fell off the bus", "health"),
    Step(at(3), "drain", "active", "draining", "replaced"),
    Step(at(5), "ok", "draining", "quarantined", "drained"),
    Step(at(60), "repair", "quarantined", "repairing", "repair"),
    Step(at(70), "ok", "repairing", "wiping", "repair attempt 1: reset"),
    Step(at(80), "ok", "wiping", "burn_in", "wipe ok"),
    Step(at(90), "ok", "burn_in", "available", "burn_in ok"),
]
REPLACED = [Replacement(at(20), "n1", "n9")]


def test_a_repaired_node_goes_through_every_phase_at_the_moments_its_history_shows() -> None:
    found = phases(node_id="n1", detected_at=T0, held=True, steps=HISTORY, replacements=REPLACED)

    assert found.pulled_at == at(1)
    assert found.stabilized_at == at(20)  # the allocation whole again, not just the cordon
    assert found.replacement_node_id == "n9"
    assert (found.diagnosed_at, found.repaired_at, found.repaired_by) == (at(60), at(70), "reset")
    assert (found.gated_at, found.ended, found.ended_at) == (at(90), IncidentStatus.RESOLVED, at(90))
    assert found.phase == Phase.WRITE_UP


@pytest.mark.parametrize(
    ("seen", "replaced", "phase"),
    [
        (1, False, Phase.STABILIZE),
        (4, False, Phase.STABILIZE),  # pulled and drained, the allocation not whole yet
        (4, True, Phase.DIAGNOSE),
        (5, True, Phase.REPAIR),
        (6, True, Phase.GATE),
        (7, True, Phase.GATE),  # wiped and burning in: not gated until it passes
    ],
)
def test_each_phase_waits_for_its_own_step(seen: int, replaced: bool, phase: Phase) -> None:
    found = phases(
        node_id="n1", detected_at=T0, held=True, steps=HISTORY[:seen], replacements=REPLACED if replaced else []
    )
    assert found.phase == phase
    assert found.ended is None


def test_an_idle_node_is_stable_once_pulled_and_its_climb_up_the_ladder_names_the_last_rung() -> None:
    steps = [
        Step(at(1), "drain", "available", "available", "xid_48", "health"),
        Step(at(2), "drain", "available", "draining"),
        Step(at(3), "ok", "draining", "quarantined"),
        Step(at(10), "repair", "quarantined", "repairing"),
        Step(at(11), "ok", "repairing", "wiping", "repair attempt 1: reset"),
        Step(at(12), "ok", "wiping", "burn_in"),
        Step(at(13), "fail", "burn_in", "quarantined", "burn-in failed"),
        Step(at(20), "repair", "quarantined", "repairing"),
        Step(at(21), "ok", "repairing", "wiping", "repair attempt 2: reboot"),
        Step(at(22), "ok", "wiping", "burn_in"),
        Step(at(23), "ok", "burn_in", "available"),
    ]
    found = phases(node_id="n1", detected_at=T0, held=False, steps=steps)

    assert (found.stabilized_at, found.diagnosed_at) == (at(1), at(10))
    assert (found.repaired_at, found.repaired_by, found.gated_at) == (at(21), "reboot", at(23))


def test_rma_ends_the_incident_without_a_gate() -> None:
    steps = [
        Step(at(1), "drain", "available", "available", "lemon", "health"),
        Step(at(2), "drain", "available", "draining"),
        Step(at(3), "ok", "draining", "quarantined"),
        Step(at(10), "repair", "quarantined", "repairing"),
        Step(at(11), "fail", "repairing", "rma", "lemon: second episode"),
    ]
    found = phases(node_id="n1", detected_at=T0, held=False, steps=steps)

    assert (found.ended, found.ended_at, found.gated_at, found.repaired_by) == (IncidentStatus.RMA, at(11), None, None)


def test_an_allocation_that_ended_without_a_replacement_is_stable_when_it_ended() -> None:
    found = phases(node_id="n1", detected_at=T0, held=True, steps=HISTORY[:3], allocation_ended_at=at(30))
    assert found.stabilized_at == at(30)


def test_nothing_happened_yet_is_no_phase_at_all() -> None:
    found = phases(node_id="n1", detected_at=T0, held=True, steps=HISTORY[:1])
    assert found.pulled_at is None and found.phase == Phase.STABILIZE


def test_gpu_hours_lost_count_the_tenants_loss_or_the_pools() -> None:
    held = phases(node_id="n1", detected_at=T0, held=True, steps=HISTORY, replacements=REPLACED)
    assert gpu_hours_lost(gpu_count=8, detected_at=T0, held=True, phases_=held, now=at(1000)) == round(8 * 20 / 3600, 4)
    idle = phases(node_id="n1", detected_at=T0, held=False, steps=HISTORY)
    assert gpu_hours_lost(gpu_count=8, detected_at=T0, held=False, phases_=idle, now=at(1000)) == round(
        8 * 90 / 3600, 4
    )
    open_ = phases(node_id="n1", detected_at=T0, held=True, steps=[])
    assert gpu_hours_lost(gpu_count=4, detected_at=T0, held=True, phases_=open_, now=at(3600)) == 4.0


@pytest.mark.parametrize(
    ("condition", "category", "component"),
    [
        ({"name": "xid_79", "xid": 79, "gpu_index": 3}, FaultCategory.FAULTY_GPU, "GPU 3"),
        ({"name": "xid_48", "xid": 48, "gpu_index": 0}, FaultCategory.HBM3, "GPU 0"),
        ({"name": "xid_119", "xid": 119}, FaultCategory.GSP, None),
        ({"name": "ib_link_down"}, FaultCategory.NETWORK, "InfiniBand port"),
        ({"name": "nvlink_link_down", "gpu_index": None}, FaultCategory.NETWORK, "NVLink"),
        ({"name": "something_new"}, FaultCategory.OTHER, None),
    ],
)
def test_the_pulling_condition_names_category_and_component(condition, category, component) -> None:
    assert classify([condition]) == (category, component)


def test_a_nic_fault_explains_the_link_down_it_took_with_it() -> None:
    at = "2026-12-06T10:00:00+00:00"
    both = [
        {"name": "ib_link_down", "action": "drain", "since": at},
        {"name": "nic_error", "action": "drain", "since": at},
    ]
    assert classify(both) == (FaultCategory.NIC, "NIC")
    # A link down first, the NIC's error later: two faults, the first decides.
    later = [both[0], {**both[1], "since": "2026-12-06T10:05:00+00:00"}]
    assert classify(later) == (FaultCategory.NETWORK, "InfiniBand port")


def test_the_lemon_rule_does_not_hide_the_fault_it_repeats() -> None:
    assert classify([{"name": "lemon"}, {"name": "xid_48", "xid": 48, "gpu_index": 2}]) == (
        FaultCategory.HBM3,
        "GPU 2",
    )


def test_a_rung_is_read_from_the_repairs_cause() -> None:
    assert rung_of("repair attempt 3: reflash") == "reflash"
    assert rung_of("repair: power cycle through the BMC") == "power_cycle"


def test_the_incident_key_is_the_pulling_conditions_start_from_either_path() -> None:
    """The API's verdict and the reconciler's stored conditions give the same moment."""
    stored = [
        {"name": "xid_92", "action": "watch", "since": at(-50).isoformat()},
        {"name": "xid_79", "action": "drain_now", "since": at(0).isoformat().replace("+00:00", "Z")},
        {"name": "agent_unreachable", "since": at(-90).isoformat()},  # no action: not a pull
    ]
    assert pulling_since(stored) == T0
    decision = PullDecision(node_id="n1", kind=PullKind.REPLACE, fault_at=at(-2), since=T0)
    assert decision.detected_at == at(-2)  # the earlier of the two
    assert PullDecision(node_id="n1", kind=PullKind.DRAIN).detected_at is None


def _incident(**changes) -> IncidentPublic:
    base = {
        "id": "inc_1",
        "kind": "node",
        "status": "resolved",
        "phase": "closed",
        "node_ids": ["n1"],
        "suspected_component": "GPU 3",
        "category": "faulty_gpu",
        "summary": "node n1 pulled: xid_79: GPU fell off the bus",
        "detected_at": T0,
        "pulled_at": at(1),
        "stabilized_at": at(20),
        "diagnosed_at": at(60),
        "repaired_at": at(70),
        "repaired_by": "reset",
        "gated_at": at(90),
        "closed_at": at(90),
        "tenant_ids": ["ten_a"],
        "allocation_ids": ["alloc_a"],
        "replacement_node_ids": ["n9"],
        "gpu_count": 8,
        "gpu_hours_lost": 0.0444,
        "signals": [{"name": "xid_79", "since": T0.isoformat(), "health": "failed", "action": "drain_now"}],
        "actions": [s.as_action() for s in HISTORY[1:]],
        "root_cause": None,
        "follow_ups": None,
        "root_cause_by": None,
        "root_cause_at": None,
        "created_at": T0,
        "updated_at": at(90),
    }
    return IncidentPublic(**{**base, **changes})


def test_the_write_up_has_every_section_with_the_incidents_facts() -> None:
    text = write_up(_incident())

    for heading in (
        "# Incident inc_1",
        "## Summary",
        "## Timeline",
        "## Impact",
        "## Signals",
        "## Actions",
        "## What fixed it",
        "## Root cause and follow-ups",
    ):
        assert heading in text
    assert "| stabilized | 2026-12-06 10:00:20 UTC | 20s |" in text
    assert "| gated | 2026-12-06 10:01:30 UTC | 1m 30s |" in text
    assert "**Tenants touched**: ten_a" in text and "**Allocations touched**: alloc_a" in text
    assert "**GPU-hours lost**: 0.04 (8 GPUs)" in text
    assert "**Time to stabilize**: 20s" in text and "**Time to repair**: 1m 30s" in text
    assert "The `reset` rung of the repair ladder" in text
    assert "| xid_79 |" in text and "repair attempt 1: reset" in text
    assert "not written yet" in text


def test_the_write_up_carries_the_operators_root_cause_and_follow_ups() -> None:
    text = write_up(
        _incident(
            root_cause="a GPU's solder joint",
            follow_ups=["RMA the board if it recurs", "check the rack's other nodes"],
            root_cause_by="operator:alice",
            root_cause_at=at(4000),
        )
    )
    assert "**Root cause** (operator:alice, 2026-12-06 11:06:40 UTC): a GPU's solder joint" in text
    assert "- [ ] RMA the board if it recurs" in text and "- [ ] check the rack's other nodes" in text


def test_an_open_or_abandoned_incident_says_so_and_a_pipe_stays_in_its_cell() -> None:
    still = write_up(
        _incident(
            status="open",
            phase="repair",
            repaired_at=None,
            gated_at=None,
            closed_at=None,
            signals=[{"name": "nvrm_error", "reason": "a | b"}],
        )
    )
    assert "open (waiting to repair)" in still and "Not fixed yet." in still and "a \\| b" in still
    assert "| gated | - | - |" in still
    gone = write_up(_incident(status="abandoned", signals=[], actions=[]))
    assert "abandoned" in gone and "No signal recorded." in gone and "No action recorded." in gone


def test_durations_read_as_people_write_them() -> None:
    assert [duration(timedelta(seconds=s)) for s in (0, 59, 61, 3723)] == ["0s", "59s", "1m 01s", "1h 02m 03s"]
    assert duration(None) == "-"


# ----------------------------------------------------------------- fleet incidents


def test_a_burst_waits_for_its_resolve_then_for_every_node_back_to_normal_judgement() -> None:
    opened = at(30)
    joined = [BurstNode("n1", joined_at=at(10)), BurstNode("n2", joined_at=at(40))]
    open_ = fleet_phases(opened_at=opened, resolved_at=None, resolved_by=None, nodes=joined)
    assert (open_.stabilized_at, open_.diagnosed_at, open_.phase) == (at(40), opened, Phase.REPAIR)

    one_back = [BurstNode("n1", at(10), back_at=at(600)), BurstNode("n2", at(40))]
    fixed = fleet_phases(opened_at=opened, resolved_at=at(600), resolved_by="leaf replaced", nodes=one_back)
    assert (fixed.repaired_at, fixed.repaired_by, fixed.gated_at, fixed.phase) == (
        at(600),
        "leaf replaced",
        None,
        Phase.GATE,
    )

    both = [BurstNode("n1", at(10), back_at=at(600)), BurstNode("n2", at(40), back_at=at(700))]
    done = fleet_phases(opened_at=opened, resolved_at=at(600), resolved_by="leaf replaced", nodes=both)
    assert (done.gated_at, done.ended, done.ended_at, done.phase) == (
        at(700),
        IncidentStatus.RESOLVED,
        at(700),
        Phase.WRITE_UP,
    )
    # A node that joined before it opened (the health loop's cordon) stabilizes it when it opened.
    assert fleet_phases(opened_at=opened, resolved_at=None, resolved_by=None, nodes=[]).stabilized_at == opened


def test_a_breaker_trip_is_held_at_once_and_over_when_its_window_or_an_operator_says_so() -> None:
    held = breaker_phases(detected_at=T0, closed_at=None, closed_by=None)
    assert (held.stabilized_at, held.diagnosed_at, held.phase) == (T0, T0, Phase.REPAIR)
    over = breaker_phases(detected_at=T0, closed_at=at(3600), closed_by="breaker window")
    assert (over.repaired_at, over.gated_at, over.ended, over.repaired_by) == (
        at(3600),
        at(3600),
        IncidentStatus.RESOLVED,
        "breaker window",
    )
    assert fleet_gpu_hours_lost(gpu_count=16, detected_at=T0, until=at(1800), now=at(9999)) == 8.0
    assert fleet_gpu_hours_lost(gpu_count=8, detected_at=T0, until=None, now=at(3600)) == 8.0


@pytest.mark.parametrize(
    ("kind", "signals", "category"),
    [
        ("leaf_switch", ["xid_79"], FaultCategory.NETWORK),
        ("rack", ["ib_link_down", "ib_link_down", "xid_79"], FaultCategory.NETWORK),
        ("pdu", ["xid_79", "xid_79"], FaultCategory.FAULTY_GPU),
        ("rack", [], FaultCategory.OTHER),
    ],
)
def test_a_bursts_category_is_its_components_or_its_signals(kind, signals, category) -> None:
    assert burst_category(kind, signals) == category


def _fleet_incident(**changes) -> IncidentPublic:
    return _incident(
        **{
            "kind": "fleet",
            "trigger": "correlated_burst",
            "fleet_incident_id": "fi-1",
            "node_ids": ["n1", "n2"],
            "suspected_component": "leaf switch sw1",
            "category": "network",
            "summary": "leaf switch sw1 suspected: 2 of its 4 nodes faulted (ib_link_down)",
            "pulled_at": None,
            "stabilized_at": at(5),
            "diagnosed_at": at(5),
            "repaired_at": at(600),
            "repaired_by": "leaf replaced",
            "gated_at": at(610),
            "closed_at": at(610),
            "replacement_node_ids": [],
            "tenant_ids": ["ten_a", "ten_b"],
            "allocation_ids": ["alloc_a", "alloc_b"],
            "gpu_count": 16,
            "signals": [{"name": "ib_link_down", "since": T0.isoformat(), "reason": "2 of 4 nodes behind sw1"}],
            "actions": [{**HISTORY[1].as_action(), "node": "n1"}],
            **changes,
        }
    )


def test_a_fleet_incidents_write_up_names_the_component_its_fix_and_that_tenants_kept_their_nodes() -> None:
    text = write_up(_fleet_incident())
    assert "**Kind**: fleet; **nodes**: `n1`, `n2`" in text
    assert "**suspected component**: leaf switch sw1" in text and "**Category**: network" in text
    assert "| diagnosed | 2026-12-06 10:00:05 UTC | 5s | the shared component suspected" in text
    assert "| repaired | 2026-12-06 10:10:00 UTC | 10m 00s | an operator resolved it |" in text
    assert "| gated | 2026-12-06 10:10:10 UTC | 10m 10s | every node back to normal judgement |" in text
    assert "tenants kept their nodes" in text and "**Tenants touched**: ten_a, ten_b" in text
    assert "An operator resolved it once the component was dealt with: leaf replaced" in text
    assert "| node |" in text and "| n1 | cordon |" in text
    assert "resolved: the component was fixed" in text


def test_a_breaker_trips_write_up_says_the_window_let_pulls_through_again() -> None:
    text = write_up(
        _fleet_incident(
            trigger="breaker_trip",
            fleet_incident_id=None,
            pool="H100/r1",
            suspected_component="pool H100/r1",
            summary="circuit breaker tripped in pool H100/r1: 1 of 4 nodes (25%) pulled; refused n1, n2",
            repaired_by="breaker window",
        )
    )
    assert "the first pull the circuit breaker refused" in text and "pool H100/r1" in text
    assert "The breaker's window let pulls through again" in text
    assert "automatic pulls go through again" in text
    assert "the breaker refused the pulls" in text
    still = write_up(_fleet_incident(status="open", phase="repair", repaired_at=None, gated_at=None, closed_at=None))
    assert "Not fixed yet." in still
