"""Correlated faults wired into the health decision, against a real database: a burst of faults
behind one leaf switch is one fleet incident (its nodes cordoned, not pulled, one alert naming
the switch), nodes the health loop pulled before the burst showed are taken back, a fault
outside any burst is pulled as before, and resolving the incident returns the nodes to normal
judgement with what came before dealt with."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlmodel import select

from gpucloud.db import session_scope
from gpucloud.health.correlation import ComponentKind
from gpucloud.health.pulls import PullKind
from gpucloud.models.health_tables import FleetIncidentRecord, OperatorAlertRecord, QuarantinePull
from gpucloud.models.tables import Node, NodeTransition
from gpucloud.protocol.reports import Signal, SignalObservation, SignalReport, XidEvent
from gpucloud.services import fleet_incidents
from gpucloud.services import health as health_service
from support.nodes import enroll

pytestmark = pytest.mark.integration

ALLOW_ALL = health_service.BreakerSettings(max_pulled_share=1.0)
LEAF_A, LEAF_B = "pod0-r0-leaf", "pod0-r1-leaf"


def _fleet(db_url: str) -> tuple[list[str], list[str]]:
    """Eight available nodes: four behind each of two leaf switches (one rack each), one PDU."""
    a = enroll(db_url, [f"a-{i}" for i in range(4)], rack="pod0-r0", leaf_switch=LEAF_A, pdu="pdu0")
    b = enroll(db_url, [f"b-{i}" for i in range(4)], rack="pod0-r1", leaf_switch=LEAF_B, pdu="pdu0")
    with session_scope(db_url) as session:
        for node in session.exec(select(Node)).all():
            node.state = "available"
            session.add(node)
    return a, b


def _link_down(node_id: str, at: datetime) -> SignalReport:
    observation = SignalObservation(signal=Signal.IB_LINK_DOWN, at=at, source="mlx5_0/1")
    return SignalReport(node_id=node_id, at=at, observations=[observation])


def _signals(db_url: str, reports: list[SignalReport], now: datetime):
    with session_scope(db_url) as session:
        outcomes, _ = health_service.ingest_signals(session, reports, source="agent", now=now, breaker=ALLOW_ALL)
        return {o.node_id: o for o in outcomes}


def _nodes(db_url: str) -> dict[str, Node]:
    with session_scope(db_url) as session:
        return {n.id: n for n in session.exec(select(Node)).all()}


def _incidents(db_url: str) -> list[FleetIncidentRecord]:
    with session_scope(db_url) as session:
        return list(session.exec(select(FleetIncidentRecord)).all())


def _alerts(db_url: str) -> list[OperatorAlertRecord]:
    with session_scope(db_url) as session:
        return list(session.exec(select(OperatorAlertRecord)).all())


def test_topology_spans_every_node_behind_the_components_of_those_asked(db_url):
    a, b = _fleet(db_url)
    with session_scope(db_url) as session:
        topology = fleet_incidents.topology_of(session, [a[0]])
    leaf = topology.component_of(a[0], ComponentKind.LEAF_SWITCH)
    assert leaf is not None and leaf.id == LEAF_A and topology.nodes_behind(leaf) == frozenset(a)
    pdu = topology.component_of(a[0], ComponentKind.PDU)
    assert pdu is not None and topology.nodes_behind(pdu) == frozenset(a + b)


def test_a_burst_behind_one_switch_is_one_incident_and_no_pulls_while_a_fault_elsewhere_is_pulled(db_url):
    a, b = _fleet(db_url)
    now = datetime.now(UTC)
    outcomes = _signals(
        db_url, [_link_down(n, now - timedelta(seconds=i)) for i, n in enumerate(a)] + [_link_down(b[0], now)], now
    )
    assert all(outcomes[n].pull == PullKind.NONE and "fleet incident" in (outcomes[n].alert or "") for n in a)
    assert outcomes[b[0]].pull == PullKind.DRAIN  # alone behind its switch: judged alone
    (incident,) = _incidents(db_url)
    assert (incident.component_kind, incident.component_id, incident.status) == ("leaf_switch", LEAF_A, "open")
    assert incident.node_ids == a and incident.cordoned == a and incident.signals == ["ib_link_down"]
    nodes = _nodes(db_url)
    for n in a:
        assert nodes[n].fleet_incident_id == incident.id and nodes[n].cordoned and not nodes[n].drain_requested
    assert nodes[b[0]].fleet_incident_id is None and nodes[b[0]].drain_requested
    (alert,) = _alerts(db_url)
    assert alert.kind == "fleet_incident" and f"leaf switch {LEAF_A}" in alert.reason
    assert incident.id in alert.reason and all(n in alert.reason for n in a)
    with session_scope(db_url) as session:
        assert [p.node_id for p in session.exec(select(QuarantinePull)).all()] == [b[0]]


def test_nodes_pulled_before_the_burst_showed_are_taken_back_and_later_faults_held(db_url):
    a, _ = _fleet(db_url)
    now = datetime.now(UTC)
    # One agent after the other, as real ones report: the first two look like lone faults.
    first = _signals(db_url, [_link_down(a[0], now)], now)
    second = _signals(db_url, [_link_down(a[1], now)], now)
    assert first[a[0]].pull == second[a[1]].pull == PullKind.DRAIN
    third = _signals(db_url, [_link_down(a[2], now)], now + timedelta(seconds=1))
    assert third[a[2]].pull == PullKind.NONE
    nodes = _nodes(db_url)
    (incident,) = _incidents(db_url)
    assert incident.node_ids == a[:3] and incident.cordoned == a[:3]  # the health loop's cordons are its now
    for n in a[:3]:
        assert nodes[n].fleet_incident_id == incident.id and nodes[n].cordoned and not nodes[n].drain_requested
    with session_scope(db_url) as session:
        assert session.exec(select(QuarantinePull)).all() == []  # their budget refunded
        withdrawn = session.exec(select(NodeTransition).where(NodeTransition.event == "drain_withdrawn")).all()
        assert sorted(t.node_id for t in withdrawn) == a[:2]
    # The fourth node's fault, and another on a node already held: held, the same incident, no new alert.
    later = now + timedelta(seconds=30)
    fourth = _signals(db_url, [_link_down(a[3], later), _link_down(a[0], later)], later)
    assert fourth[a[3]].pull == fourth[a[0]].pull == PullKind.NONE
    (incident,) = _incidents(db_url)
    assert incident.node_ids == a and len(_alerts(db_url)) == 1


def test_resolving_returns_the_nodes_to_normal_judgement(db_url):
    a, _ = _fleet(db_url)
    now = datetime.now(UTC)
    _signals(db_url, [_link_down(n, now) for n in a], now)
    (incident,) = _incidents(db_url)
    later = now + timedelta(minutes=1)  # inside the correlation window of the burst
    with session_scope(db_url) as session:
        record = fleet_incidents.resolve(session, incident.id, actor="operator:alice", now=later, note="leaf replaced")
        session.flush()
        outcomes = health_service.judge_again(session, record.node_ids, now=later, breaker=ALLOW_ALL)
    # What the switch caused is dealt with: healthy again, nothing pulled.
    assert {(o.verdict.health, o.pull) for o in outcomes} == {("ok", PullKind.NONE)}
    nodes = _nodes(db_url)
    assert all(nodes[n].fleet_incident_id is None and not nodes[n].cordoned and nodes[n].health == "ok" for n in a)
    (incident,) = _incidents(db_url)
    assert (incident.status, incident.resolved_by, incident.resolution) == (
        "resolved",
        "operator:alice",
        "leaf replaced",
    )
    # Resolving again changes nothing; a fault after it is judged alone (what the incident dealt
    # with makes no new burst with it): a fatal XID, a port down, each pulls.
    with session_scope(db_url) as session:
        assert fleet_incidents.resolve(session, incident.id, actor="x", now=later).resolved_by == "operator:alice"
    fatal = XidEvent(node_id=a[0], xid=79, gpu_index=0, timestamp=later + timedelta(seconds=1))
    with session_scope(db_url) as session:
        (outcome,), _ = health_service.ingest_xids(
            session, [fatal], source="agent", now=later + timedelta(seconds=2), breaker=ALLOW_ALL
        )
    assert outcome.pull == PullKind.DRAIN
    again = _signals(db_url, [_link_down(a[1], later + timedelta(seconds=3))], later + timedelta(seconds=4))
    assert again[a[1]].pull == PullKind.DRAIN and len(_incidents(db_url)) == 1
    with pytest.raises(fleet_incidents.IncidentNotFound), session_scope(db_url) as session:
        fleet_incidents.resolve(session, "fi-missing", actor="x", now=later)
