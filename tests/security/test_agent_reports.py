"""Issue 13, rows 5 and 13: what a node's agent reports is bounded and checked. A tenant has
root on the node and holds its agent credential, so an XID dated in the future (it would count
as newer than a later burn-in and pull the next tenant's node), a claim about which tenant held
the node (it feeds the application-XID rule), or a fleet's worth of reports in one request are
refused or overridden."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlmodel import select

from gpucloud.db import session_scope
from gpucloud.models.health_tables import SignalObservationRecord, XidEventRecord

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def _event(node_id: str, **extra) -> dict:
    return {
        "node_id": node_id,
        "gpu_index": 0,
        "xid": 13,
        "timestamp": datetime.now(UTC).isoformat(),
        "message": "Graphics SM Warp Exception",
        **extra,
    }


def test_agent_reports_are_dated_stamped_and_bounded_by_the_control_plane(db_url, make_harness):
    h = make_harness(db_url, nodes=1)
    (node_id,) = h.enroll_fleet()
    with h.operator as op:
        token = op.post(f"/v1/nodes/{node_id}/agent-credential").json()["token"]
    with h.client(token) as agent:
        future = _event(node_id, timestamp=(datetime.now(UTC) + timedelta(hours=1)).isoformat())
        resp = agent.post("/v1/agents/events", json={"events": [future]})
        assert resp.status_code == 422, resp.text
        assert "events.0.timestamp" in resp.json()["detail"]

        # The tenant the agent names is not believed: the record says who held the node (nobody).
        blamed = _event(node_id, tenant_id="ten_someone_else", allocation_id="alloc_someone_else")
        assert agent.post("/v1/agents/events", json={"events": [blamed]}).status_code == 200
        with session_scope(h.settings.database_url) as session:
            (stored,) = session.exec(select(XidEventRecord)).all()
            assert stored.tenant_id is None and stored.allocation_id is None

        # A node's worth per request, every field bounded.
        too_many = agent.post("/v1/agents/events", json={"events": [_event(node_id)] * 501})
        assert too_many.status_code == 413 and "at most 500" in too_many.json()["detail"]
        reading = {"node_id": node_id, "timestamp": datetime.now(UTC).isoformat(), "is_gpu_node": False}
        assert agent.post("/v1/agents/readings", json={"readings": [reading] * 11}).status_code == 413
        assert agent.post("/v1/agents/readings", json={"readings": [reading] * 2}).status_code == 200
        beats = {"heartbeats": [{"node_id": node_id}] * 2}
        assert agent.post("/v1/agents/heartbeats", json=beats).status_code == 413
        long_message = agent.post("/v1/agents/events", json={"events": [_event(node_id, message="x" * 3000)]})
        assert long_message.status_code == 422
        assert agent.post("/v1/agents/events", json={"events": [_event(node_id, xid=-1)]}).status_code == 422

        # Issue 37, item 10: every string of a heartbeat is bounded (a 7 MiB boot id was stored).
        for oversize, field in (
            ({"boot_id": "b" * (7 << 20)}, "boot_id"),
            ({"boot_id": "not a boot id"}, "boot_id"),
            ({"tenant_id": "t" * 129}, "tenant_id"),
            ({"workload": {"state": "running", "allocation_id": "a" * 129}}, "workload.allocation_id"),
            ({"workload": {"state": "running", "isolation": "i" * 33}}, "workload.isolation"),
            ({"workload": {"state": "exited", "exit_code": 2**40}}, "workload.exit_code"),
        ):
            refused = agent.post("/v1/agents/heartbeats", json={"heartbeats": [{"node_id": node_id, **oversize}]})
            assert refused.status_code == 422, (field, refused.status_code)
            assert f"heartbeats.0.{field}" in refused.json()["detail"]
        oversize_node = agent.post("/v1/agents/heartbeats", json={"heartbeats": [{"node_id": "n" * 129}]})
        assert oversize_node.status_code == 422


def _signals(node_id: str, many: int = 1, **observation) -> dict:
    at = datetime.now(UTC).isoformat()
    return {
        "node_id": node_id,
        "at": at,
        "observations": [{"signal": "ib_rcv_errors", "at": at, "source": "mlx5_0/1", **observation}] * many,
    }


def test_agent_signal_reports_are_for_its_own_node_dated_stamped_and_bounded(db_url, make_harness):
    h = make_harness(db_url, nodes=2)
    node_id, other = h.enroll_fleet()
    with h.operator as op:
        token = op.post(f"/v1/nodes/{node_id}/agent-credential").json()["token"]
    # Who calls is checked before the body is read: a stranger's malformed body is a 401.
    with h.client("gpa_nobody.secret") as stranger:
        assert stranger.post("/v1/agents/signals", content=b"{not json").status_code == 401
    with h.client(token) as agent:
        foreign = agent.post("/v1/agents/signals", json={"reports": [_signals(other)]})
        assert foreign.status_code == 403 and other in foreign.json()["detail"]
        assert agent.post("/v1/agents/signals", json={"reports": [_signals(node_id)] * 11}).status_code == 413
        future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        ahead = agent.post("/v1/agents/signals", json={"reports": [_signals(node_id, at=future)]})
        assert ahead.status_code == 422 and "reports.0.observations.0.at" in ahead.json()["detail"]
        for bad, field in (
            ({"source": "s" * 129}, "source"),
            ({"detail": "d" * 2001}, "detail"),
            ({"count": -1}, "count"),
            ({"signal": "not_a_signal"}, "signal"),
        ):
            refused = agent.post("/v1/agents/signals", json={"reports": [_signals(node_id, **bad)]})
            assert refused.status_code == 422, (field, refused.text)
            assert refused.json()["errors"][0]["field"] == f"reports.0.observations.0.{field}"
        too_many = agent.post("/v1/agents/signals", json={"reports": [_signals(node_id, many=501)]})
        assert too_many.status_code == 422 and too_many.json()["errors"][0]["field"] == "reports.0.observations"

        accepted = agent.post("/v1/agents/signals", json={"reports": [_signals(node_id, many=3)] * 2})
        assert accepted.status_code == 200 and accepted.json()["accepted"] == 6
    with session_scope(h.settings.database_url) as session:
        stored = session.exec(select(SignalObservationRecord)).all()
    assert len(stored) == 6
    assert {(r.node_id, r.reported_by, r.tenant_id, r.allocation_id) for r in stored} == {
        (node_id, "agent", None, None)
    }
