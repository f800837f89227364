"""Correlated faults: bursts behind a leaf switch, rack or PDU become one fleet incident."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.health.correlation import (
    Component,
    ComponentKind,
    CorrelationPolicy,
    FaultObservation,
    NodePlacement,
    Topology,
    correlate,
)

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
WINDOW = timedelta(minutes=5)
POLICY = CorrelationPolicy(window=WINDOW, min_nodes=3)


def _fleet() -> Topology:
    """Two PDUs; each feeds two racks; each rack holds two leaf switches of four nodes.

    n00-n03 leaf-0, n04-n07 leaf-1 (rack-0); n08-n15 rack-1 (PDU pdu-0); n16-n31 likewise, pdu-1.
    """
    return Topology(
        NodePlacement(node_id=f"n{i:02d}", leaf_switch=f"leaf-{i // 4}", rack=f"rack-{i // 8}", pdu=f"pdu-{i // 16}")
        for i in range(32)
    )


def _fault(node: int, seconds: float, signal: str = "nvlink_down") -> FaultObservation:
    return FaultObservation(node_id=f"n{node:02d}", at=T0 + timedelta(seconds=seconds), signal=signal)


def test_a_switch_burst_is_one_incident_suspecting_the_switch() -> None:
    faults = [_fault(0, 0), _fault(1, 10), _fault(2, 20), _fault(3, 30, "agent_unreachable")]
    result = correlate(faults, _fleet(), policy=POLICY)
    assert len(result.incidents) == 1
    incident = result.incidents[0]
    assert incident.component == Component(kind=ComponentKind.LEAF_SWITCH, id="leaf-0")
    assert incident.nodes == ("n00", "n01", "n02", "n03")
    assert (incident.first, incident.last) == (T0, T0 + timedelta(seconds=30))
    assert incident.component_size == 4
    assert "leaf switch leaf-0" in incident.reason and "4 of 4 nodes" in incident.reason
    assert all(result.pull_suppressed(f"n{i:02d}") for i in range(4))
    assert all(n.pull_suppressed and n.unexplained == () for n in result.nodes)


def test_scattered_faults_stay_node_level() -> None:
    # One node behind each of four switches and four racks, two per PDU: nothing is shared by three.
    faults = [_fault(0, 0), _fault(9, 10), _fault(20, 20), _fault(29, 30)]
    result = correlate(faults, _fleet(), policy=POLICY)
    assert result.incidents == ()
    assert [n.node_id for n in result.nodes] == ["n00", "n09", "n20", "n29"]
    assert not any(n.pull_suppressed for n in result.nodes)
    assert all(len(n.unexplained) == 1 for n in result.nodes)


def test_too_few_nodes_behind_a_switch_stay_node_level() -> None:
    # Two nodes, however many faults each, are below min_nodes.
    faults = [_fault(0, s) for s in (0, 5, 10)] + [_fault(1, s) for s in (1, 6)]
    result = correlate(faults, _fleet(), policy=POLICY)
    assert result.incidents == ()
    assert not result.pull_suppressed("n00")


def test_window_edges_are_inclusive() -> None:
    at_the_edge = [_fault(0, 0), _fault(1, 150), _fault(2, WINDOW.total_seconds())]
    assert len(correlate(at_the_edge, _fleet(), policy=POLICY).incidents) == 1
    just_past = [_fault(0, 0), _fault(1, 150), _fault(2, WINDOW.total_seconds() + 0.001)]
    assert correlate(just_past, _fleet(), policy=POLICY).incidents == ()


def test_a_burst_ends_when_faults_stop_coming_fast_enough() -> None:
    burst = [_fault(0, 0), _fault(1, 10), _fault(2, 20)]
    later = _fault(3, 20 + WINDOW.total_seconds() + 60)  # same switch, too late to join
    result = correlate([*burst, later], _fleet(), policy=POLICY)
    assert [i.nodes for i in result.incidents] == [("n00", "n01", "n02")]
    assert not result.pull_suppressed("n03")


def test_a_node_fault_outside_the_incident_is_still_judged_alone() -> None:
    faults = [_fault(0, 0), _fault(1, 10), _fault(2, 20), _fault(0, 3_600, "xid_79")]
    result = correlate(faults, _fleet(), policy=POLICY)
    n00 = next(n for n in result.nodes if n.node_id == "n00")
    assert n00.incidents == (Component(kind=ComponentKind.LEAF_SWITCH, id="leaf-0"),)
    assert [o.signal for o in n00.unexplained] == ["xid_79"]
    assert not n00.pull_suppressed
    assert result.pull_suppressed("n01") and result.pull_suppressed("n02")


def test_the_smallest_explaining_component_is_suspected() -> None:
    # All three behind leaf-0, hence rack-0 and pdu-0 too: the switch explains them.
    result = correlate([_fault(0, 0), _fault(1, 1), _fault(2, 2)], _fleet(), policy=POLICY)
    assert [i.component.kind for i in result.incidents] == [ComponentKind.LEAF_SWITCH]


def test_faults_across_two_switches_of_a_rack_suspect_the_rack() -> None:
    faults = [_fault(0, 0), _fault(1, 1), _fault(4, 2), _fault(5, 3)]  # 2 on leaf-0, 2 on leaf-1
    result = correlate(faults, _fleet(), policy=POLICY)
    assert [(i.component, i.nodes) for i in result.incidents] == [
        (Component(kind=ComponentKind.RACK, id="rack-0"), ("n00", "n01", "n04", "n05"))
    ]
    assert "rack rack-0" in result.incidents[0].reason


def test_faults_across_two_racks_of_a_pdu_suspect_the_pdu() -> None:
    faults = [_fault(0, 0), _fault(4, 1), _fault(8, 2), _fault(12, 3)]  # one per switch, two racks
    result = correlate(faults, _fleet(), policy=POLICY)
    assert [i.component for i in result.incidents] == [Component(kind=ComponentKind.PDU, id="pdu-0")]


def test_a_stray_fault_beside_a_switch_burst_does_not_make_a_rack_incident() -> None:
    faults = [_fault(0, 0), _fault(1, 1), _fault(2, 2), _fault(4, 3)]  # leaf-0 ×3, one on leaf-1
    result = correlate(faults, _fleet(), policy=POLICY)
    assert [i.component.id for i in result.incidents] == ["leaf-0"]
    assert not result.pull_suppressed("n04")


def test_a_larger_burst_takes_in_the_switch_incident_inside_it() -> None:
    # leaf-0 ×3 is a switch incident; leaf-1 ×2 and leaf-2 ×1 are left over and make a PDU burst
    # (leaf-2 is in rack-1), which explains all six: one PDU incident, no switch incident.
    faults = [_fault(0, 0), _fault(1, 1), _fault(2, 2), _fault(4, 3), _fault(5, 4), _fault(8, 5)]
    result = correlate(faults, _fleet(), policy=POLICY)
    assert [(i.component.id, len(i.nodes)) for i in result.incidents] == [("pdu-0", 6)]
    assert all(n.pull_suppressed for n in result.nodes)


def test_a_share_of_the_component_can_set_the_bar() -> None:
    faults = [_fault(0, 0), _fault(1, 1), _fault(2, 2)]
    half_of_a_switch_is_two = CorrelationPolicy(window=WINDOW, min_nodes=2, min_share=0.5)
    assert len(correlate(faults[:2], _fleet(), policy=half_of_a_switch_is_two).incidents) == 1
    all_of_a_switch = CorrelationPolicy(window=WINDOW, min_nodes=2, min_share=1.0)
    # Three of leaf-0's four are not all of it; nor are they all of rack-0 or pdu-0.
    assert correlate(faults, _fleet(), policy=all_of_a_switch).incidents == ()


def test_nodes_outside_the_topology_stay_node_level() -> None:
    faults = [FaultObservation(node_id=f"x{i}", at=T0, signal="xid_79") for i in range(5)]
    result = correlate(faults, _fleet(), policy=POLICY)
    assert result.incidents == ()
    assert len(result.nodes) == 5 and not any(n.pull_suppressed for n in result.nodes)


def test_a_node_placed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="placed twice"):
        Topology([NodePlacement(node_id="a", rack="r"), NodePlacement(node_id="a", rack="s")])


@settings(max_examples=60, deadline=None)
@given(
    faults=st.lists(
        st.tuples(st.integers(0, 31), st.integers(0, 1_200), st.sampled_from(["xid_79", "nvlink_down", "lost"])),
        max_size=40,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_order_and_duplicates_change_nothing(faults: list[tuple[int, int, str]], seed: int) -> None:
    observations = [_fault(node, seconds, signal) for node, seconds, signal in faults]
    shuffled = observations + observations[: len(observations) // 2]
    random.Random(seed).shuffle(shuffled)
    assert correlate(shuffled, _fleet(), policy=POLICY) == correlate(observations, _fleet(), policy=POLICY)


@settings(max_examples=60, deadline=None)
@given(
    faults=st.lists(st.tuples(st.integers(0, 31), st.integers(0, 3_600)), max_size=40),
)
def test_every_fault_is_explained_once_or_left_to_its_node(faults: list[tuple[int, int]]) -> None:
    observations = {_fault(node, seconds) for node, seconds in faults}
    result = correlate(observations, _fleet(), policy=POLICY)
    in_incidents = [o for i in result.incidents for o in i.observations]
    left = [o for n in result.nodes for o in n.unexplained]
    assert len(in_incidents) == len(set(in_incidents))
    assert set(in_incidents) | set(left) == observations and not set(in_incidents) & set(left)
    for incident in result.incidents:
        assert len(incident.nodes) >= POLICY.min_nodes
