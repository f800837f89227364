"""Fleet-kind incidents against a real database (SQLite, and Postgres when configured): a
correlated burst opens one incident of kind `fleet` (its component suspected, its nodes and the
tenants whose allocations held them linked), which goes through its phases as the fleet
incident is resolved and its nodes come back; a circuit-breaker trip opens one per pool and
trip, gathering the nodes it refused, and ends when the window lets pulls through again or an
operator resolves it; a tenant's listing finds both kinds (and node incidents) through the link
table; the reconciler's sweep makes the incident an open fleet incident lacks, and restarts
what nobody follows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlmodel import select

from gpucloud.db import session_scope
from gpucloud.health.correlation import CorrelationPolicy
from gpucloud.health.pulls import PullKind
from gpucloud.models.health_tables import FleetIncidentRecord, Incident, IncidentTenant
from gpucloud.models.incident_messages import IncidentInput
from gpucloud.models.tables import Node
from gpucloud.models.workflow_ids import fleet_incident_workflow_id
from gpucloud.protocol.reports import Signal, SignalObservation, SignalReport, XidEvent
from gpucloud.services import fleet_incidents, fleet_kind_incidents, incidents
from gpucloud.services import health as health_service
from support.nodes import enroll

pytestmark = pytest.mark.integration

ALLOW_ALL = health_service.BreakerSettings(max_pulled_share=1.0)
# One pull per window in an eight-node pool, and no correlation: the second fault trips it.
TIGHT = health_service.BreakerSettings(
    max_pulled_share=0.125, window=timedelta(minutes=10), correlation=CorrelationPolicy(min_nodes=1000)
)
LEAF = "pod0-r0-leaf"


def _fleet(db_url: str) -> list[str]:
    """Eight nodes behind one leaf switch: n0, n1 held by ten_a's allocation, n2 by ten_b's."""
    ids = enroll(db_url, [f"n{i}" for i in range(8)], rack="pod0-r0", leaf_switch=LEAF, pdu="pdu0")
    held = {"n0": ("ten_a", "alloc_a"), "n1": ("ten_a", "alloc_a"), "n2": ("ten_b", "alloc_b")}
    with session_scope(db_url) as session:
        for node in session.exec(select(Node)).all():
            node.state = "active" if node.id in held else "available"
            node.tenant_id, node.allocation_id = held.get(node.id, (None, None))
            session.add(node)
    return ids


def _link_down(node_id: str, at: datetime) -> SignalReport:
    return SignalReport(
        node_id=node_id, at=at, observations=[SignalObservation(signal=Signal.IB_LINK_DOWN, at=at, source="mlx5_0/1")]
    )


def _fleet_incidents(db_url: str) -> list[Incident]:
    with session_scope(db_url) as session:
        return list(session.exec(select(Incident).where(Incident.kind == "fleet").order_by(Incident.seq)).all())


def _visible_to(db_url: str, tenant: str) -> list[str]:
    with session_scope(db_url) as session:
        return [i.id for i in session.exec(select(Incident).where(incidents.tenant_filter(tenant))).all()]


def test_a_burst_is_one_fleet_incident_through_its_phases_to_its_write_up(db_url):
    nodes = _fleet(db_url)
    now = datetime.now(UTC)
    burst = nodes[:4]
    with session_scope(db_url) as session:
        outcomes, _ = health_service.ingest_signals(
            session,
            [_link_down(n, now - timedelta(seconds=3 - i)) for i, n in enumerate(burst)],
            source="agent",
            now=now,
            breaker=ALLOW_ALL,
        )
    assert {o.pull for o in outcomes} == {PullKind.NONE}
    starts = {o.incident for o in outcomes}
    (incident,) = _fleet_incidents(db_url)
    (record,) = _records(db_url)
    assert len(starts) == 1 and next(iter(starts)).incident_id == incident.id  # every held node names it
    assert incident.workflow_id == fleet_incident_workflow_id(record.id) and incident.fleet_incident_id == record.id
    assert (incident.trigger, incident.suspected_component, incident.category) == (
        "correlated_burst",
        f"leaf switch {LEAF}",
        "network",
    )
    assert incident.node_ids == burst and incident.detected_at == record.first_at and incident.gpu_count == 32
    assert (incident.tenant_ids, incident.allocation_ids) == (["ten_a", "ten_b"], ["alloc_a", "alloc_b"])
    # A later fault on a node already held: the same incident, no second row.
    with session_scope(db_url) as session:
        health_service.ingest_signals(
            session,
            [_link_down(burst[0], now + timedelta(seconds=5))],
            source="agent",
            now=now + timedelta(seconds=5),
            breaker=ALLOW_ALL,
        )
    assert [i.id for i in _fleet_incidents(db_url)] == [incident.id]
    # Both tenants whose allocations it touched find it; a third does not.
    assert incident.id in _visible_to(db_url, "ten_a") and incident.id in _visible_to(db_url, "ten_b")
    assert _visible_to(db_url, "ten_c") == []

    with session_scope(db_url) as session:
        found, _ = incidents.observe(session, incident.id, now=now + timedelta(seconds=10))
        assert found.phase == "repair" and found.diagnosed_at == record.opened_at
        assert found.stabilized_at is not None and found.stabilized_at >= record.opened_at
        assert {a["node"] for a in found.actions} == set(burst)

    later = now + timedelta(minutes=1)
    with session_scope(db_url) as session:
        fleet_incidents.resolve(session, record.id, actor="operator:alice", now=later, note="leaf replaced")
        session.flush()
        health_service.judge_again(session, burst, now=later, breaker=ALLOW_ALL)
    with session_scope(db_url) as session:
        closed = incidents.close(session, incident.id, abandoned=False, now=later + timedelta(seconds=1))
        assert (closed.status, closed.phase, closed.repaired_by) == ("resolved", "closed", "leaf replaced")
        assert closed.repaired_at == later and closed.gated_at == later
        assert closed.write_up is not None and "leaf replaced" in closed.write_up
        assert "tenants kept their nodes" in closed.write_up and f"leaf switch {LEAF}" in closed.write_up


def test_a_node_still_cordoned_after_the_resolve_holds_the_gate(db_url):
    nodes = _fleet(db_url)
    now = datetime.now(UTC)
    with session_scope(db_url) as session:
        health_service.ingest_signals(
            session, [_link_down(n, now) for n in nodes[3:6]], source="agent", now=now, breaker=ALLOW_ALL
        )
    (incident,) = _fleet_incidents(db_url)
    (record,) = _records(db_url)
    later = now + timedelta(minutes=1)
    with session_scope(db_url) as session:
        fleet_incidents.resolve(session, record.id, actor="operator:alice", now=later, note="cable reseated")
        session.flush()
        health_service.judge_again(session, nodes[3:6], now=later, breaker=ALLOW_ALL)
        node = session.get(Node, nodes[3])
        assert node is not None
        node.cordoned = True  # an operator's own cordon, after the resolve
        session.add(node)
    with session_scope(db_url) as session:
        found, _ = incidents.observe(session, incident.id, now=later + timedelta(seconds=1))
        assert (found.phase, found.repaired_by, found.gated_at) == ("gate", "cable reseated", None)
        # A fault of its own pulls it: that is normal judgement too.
        health_service.ingest_xids(
            session,
            [XidEvent(node_id=nodes[3], xid=79, gpu_index=0, timestamp=later + timedelta(seconds=2))],
            source="agent",
            now=later + timedelta(seconds=3),
            breaker=ALLOW_ALL,
        )
    with session_scope(db_url) as session:
        found, phases = incidents.observe(session, incident.id, now=later + timedelta(seconds=4))
        assert phases.ended is not None and found.gated_at is not None and found.gated_at > later


def test_a_breaker_trip_is_one_incident_per_pool_until_its_window_lets_pulls_through(db_url):
    nodes = _fleet(db_url)
    now = datetime.now(UTC)

    def fault(node_id: str, at: datetime):
        with session_scope(db_url) as session:
            (outcome,), _ = health_service.ingest_xids(
                session,
                [XidEvent(node_id=node_id, xid=79, gpu_index=0, timestamp=at)],
                source="agent",
                now=at,
                breaker=TIGHT,
            )
            return outcome

    assert fault(nodes[5], now).pull == PullKind.DRAIN  # the pool's one pull of the window
    refused = [fault(nodes[6], now + timedelta(seconds=1)), fault(nodes[7], now + timedelta(seconds=2))]
    assert {o.pull for o in refused} == {PullKind.NONE} and all("refused" in (o.alert or "") for o in refused)
    (incident,) = _fleet_incidents(db_url)
    assert {o.incident.incident_id for o in refused if o.incident} == {incident.id}
    assert (incident.trigger, incident.pool, incident.node_ids) == ("breaker_trip", "H100/r1", nodes[6:8])
    assert incident.workflow_id.startswith("incident-breaker-H100_r1-")
    assert (
        "pool H100/r1" in incident.summary and "1 of 5 nodes (20%" in incident.summary
    )  # the platform's five idle nodes
    assert nodes[6] in incident.summary and nodes[7] in incident.summary
    assert incident.tenant_ids == []  # idle nodes: no tenant touched

    with session_scope(db_url) as session:
        found, phases = incidents.observe(session, incident.id, now=now + timedelta(minutes=5))
        assert found.phase == "repair" and phases.ended is None
        assert [a["node"] for a in found.actions] == nodes[6:8]
    reopened = now + timedelta(minutes=11)  # the pull that used the budget is out of the window
    with session_scope(db_url) as session:
        closed = incidents.close(session, incident.id, abandoned=False, now=reopened)
        assert (closed.status, closed.repaired_by, closed.gated_at) == ("resolved", "breaker window", reopened)
        assert closed.write_up is not None and "let pulls through again" in closed.write_up
    # The next trip in the pool is a new incident.
    assert fault(nodes[4], reopened).pull == PullKind.DRAIN
    assert fault(nodes[3], reopened + timedelta(seconds=1)).pull == PullKind.NONE
    assert [i.status for i in _fleet_incidents(db_url)] == ["resolved", "open"]


def test_an_operator_resolves_a_trip_and_a_node_incident_is_not_theirs_to_resolve(db_url):
    nodes = _fleet(db_url)
    now = datetime.now(UTC)
    with session_scope(db_url) as session:
        for i, node_id in enumerate(nodes[:2]):  # ten_a's budget: one pull of its two nodes
            health_service.ingest_xids(
                session,
                [XidEvent(node_id=node_id, xid=79, gpu_index=0, timestamp=now)],
                source="agent",
                now=now + timedelta(seconds=i),
                breaker=TIGHT,
            )
    (incident,) = _fleet_incidents(db_url)
    assert incident.pool == "H100/r1 tenant ten_a" and incident.tenant_ids == ["ten_a"]
    assert _visible_to(db_url, "ten_a") == [incident.id] and _visible_to(db_url, "ten_b") == []
    with session_scope(db_url) as session:
        trip = incidents.get(session, incident.id)
        fleet_kind_incidents.resolve_trip(
            session, trip, actor="operator:bob", note="bad batch of XIDs", now=now + timedelta(seconds=2)
        )
    with session_scope(db_url) as session:
        closed = incidents.close(session, incident.id, abandoned=False, now=now + timedelta(seconds=5))
        assert (closed.status, closed.repaired_by, closed.repaired_at) == (
            "resolved",
            "bad batch of XIDs",
            now + timedelta(seconds=2),
        )
        node_incident = incidents.open_incident(
            session,
            workflow_id="incident-n2-1",
            inp=IncidentInput(node_id=nodes[2], detected_at=now, allocation_id="alloc_b"),
        )
        with pytest.raises(fleet_kind_incidents.NotResolvable):
            fleet_kind_incidents.resolve_trip(session, node_incident, actor="x", note="", now=now)
    # The node incident is ten_b's through the same link table.
    assert _visible_to(db_url, "ten_b") == [node_incident.id]
    with session_scope(db_url) as session:
        (link,) = session.exec(select(IncidentTenant).where(IncidentTenant.incident_id == node_incident.id)).all()
        assert (link.tenant_id, link.allocation_id, link.node_id) == ("ten_b", "alloc_b", nodes[2])


def test_the_sweep_makes_the_incident_an_open_fleet_incident_lacks_and_restarts_what_nobody_follows(db_url):
    nodes = _fleet(db_url)
    now = datetime.now(UTC)
    with session_scope(db_url) as session:  # as written before fleet incidents had their incident
        session.add(
            FleetIncidentRecord(
                id="fi-old",
                component_kind="rack",
                component_id="pod0-r0",
                component_size=8,
                node_ids=nodes[:3],
                cordoned=nodes[:3],
                signals=["xid_79"],
                first_at=now - timedelta(minutes=2),
                last_at=now - timedelta(minutes=1),
                reason="3 of 8 nodes",
                opened_at=now - timedelta(minutes=1),
            )
        )
    with session_scope(db_url) as session:
        (start,) = fleet_kind_incidents.to_start(session, now=now, stale_after=timedelta(seconds=90))
    (incident,) = _fleet_incidents(db_url)
    assert (start.incident_id, start.workflow_id) == (incident.id, fleet_incident_workflow_id("fi-old"))
    assert incident.category == "faulty_gpu" and incident.suspected_component == "rack pod0-r0"
    with session_scope(db_url) as session:  # followed (just looked at): nothing to start
        assert fleet_kind_incidents.to_start(session, now=now, stale_after=timedelta(seconds=90)) == []
    with session_scope(db_url) as session:  # nobody looked for longer than that: started again
        (again,) = fleet_kind_incidents.to_start(
            session, now=now + timedelta(minutes=5), stale_after=timedelta(seconds=90)
        )
    assert again.incident_id == incident.id


def _records(db_url: str) -> list[FleetIncidentRecord]:
    with session_scope(db_url) as session:
        return list(session.exec(select(FleetIncidentRecord)).all())
