"""A pull opens its incident (`services/pulls.py`) and an engine that is down never fails the pull:
the replace signal still goes out, the refused start is logged. The incident's input names the
fault by the pulling condition's start; a pull with no moment to key it opens none. A tenant's
view of an incident keeps nothing of another tenant's (nor, of a fleet incident, another
tenant's nodes). A fleet-kind incident's start the engine refuses is logged too."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from temporalio.service import RPCError, RPCStatusCode

from gpucloud.config import Settings
from gpucloud.health.pulls import PullDecision, PullKind
from gpucloud.models.health_tables import Incident, IncidentTenant
from gpucloud.services import fleet_kind_incidents, incidents, pulls

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)
OWN_LINK = {"incident_id": "inc_1", "allocation_id": "alloc_a", "node_id": "n1", "tenant_id": "ten_a"}


class _Handle:
    def __init__(self, client: _EngineDown) -> None:
        self.client = client

    async def signal(self, name: str, arg: object) -> None:
        self.client.signals.append(name)


class _EngineDown:
    """Takes signals but refuses every start, as an engine that lost its frontend mid-request."""

    def __init__(self) -> None:
        self.signals: list[str] = []
        self.starts = 0

    async def start_workflow(self, *args: object, **kwargs: object) -> None:
        self.starts += 1
        raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")

    def get_workflow_handle(self, workflow_id: str) -> _Handle:
        return _Handle(self)


async def test_a_start_the_engine_refuses_is_logged_and_the_pull_goes_on(caplog) -> None:
    client = _EngineDown()
    decision = PullDecision(node_id="n1", kind=PullKind.REPLACE, allocation_id="alloc_a", fault_at=T0, since=T0)

    with caplog.at_level(logging.WARNING, logger="gpucloud.services.pulls"):
        undelivered = await pulls.carry_out(client, Settings(), [decision])

    assert undelivered == [] and client.signals == ["replace_node"] and client.starts == 1
    assert any(
        "incident incident-n1-" in r.getMessage() and "the pull stands" in r.getMessage() for r in caplog.records
    )


async def test_an_engine_that_does_not_answer_is_asked_once_per_batch(caplog) -> None:
    client = _EngineDown()
    decisions = [PullDecision(node_id=f"n{i}", kind=PullKind.DRAIN, since=T0) for i in range(5)]

    with caplog.at_level(logging.WARNING, logger="gpucloud.services.pulls"):
        assert await pulls.open_incidents(client, Settings(), decisions) == []  # type: ignore[arg-type]

    assert client.starts == 1
    assert any("4 more incidents not opened" in r.getMessage() for r in caplog.records)


def test_the_incident_input_keys_the_fault_by_the_conditions_start() -> None:
    settings = Settings(health={"incident_poll_s": 2.0, "incident_max_wait_s": 60.0})
    replace = PullDecision(
        node_id="n1", kind=PullKind.REPLACE, allocation_id="alloc_a", fault_at=T0 - timedelta(seconds=3), since=T0
    )
    inp = pulls.incident_input(settings, replace)
    assert inp is not None
    assert (inp.detected_at, inp.key_at, inp.allocation_id) == (T0 - timedelta(seconds=3), T0, "alloc_a")
    assert (inp.poll_s, inp.max_wait_s) == (2.0, 60.0)
    drain = pulls.incident_input(settings, PullDecision(node_id="n2", kind=PullKind.DRAIN, since=T0))
    assert drain is not None and drain.allocation_id is None and drain.key_at == T0
    assert pulls.incident_input(settings, PullDecision(node_id="n3", kind=PullKind.REPLACE)) is None
    assert pulls.incident_input(settings, PullDecision(node_id="n4", kind=PullKind.NONE, since=T0)) is None


def test_a_tenant_sees_its_own_incident_without_another_tenants_data() -> None:
    incident = Incident(
        id="inc_1",
        workflow_id="incident-n1-1",
        node_id="n1",
        node_ids=["n1"],
        detected_at=T0,
        tenant_id="ten_a",
        tenant_ids=["ten_a", "ten_b"],
        allocation_ids=["alloc_a"],
        signals=[{"name": "xid_13", "reason": "seen by ten_b's job"}],
        actions=[{"event": "cordon", "cause": "ten_b reported it", "at": T0.isoformat()}],
        created_at=T0,
        updated_at=T0,
    )
    mine = incidents.for_tenant(incident, "ten_a", [IncidentTenant(**OWN_LINK)])
    assert mine.tenant_ids == ["ten_a"] and mine.allocation_ids == ["alloc_a"]
    assert "ten_b" not in mine.model_dump_json()

    theirs = incidents.for_tenant(incident, "ten_b", [])
    assert theirs.tenant_ids == ["ten_b"] and theirs.allocation_ids == []  # alloc_a is ten_a's
    assert "ten_a" not in theirs.model_dump_json() and "alloc_a" not in theirs.model_dump_json()


def test_a_tenant_sees_of_a_fleet_incident_its_own_nodes_and_allocations_only() -> None:
    incident = Incident(
        id="inc_2",
        workflow_id="incident-fleet-fi-1",
        kind="fleet",
        trigger="correlated_burst",
        fleet_incident_id="fi-1",
        node_ids=["n1", "n2", "n10"],
        detected_at=T0,
        summary="leaf switch sw1 suspected: n1, n2, n10 faulted; ten_b's job saw it",
        tenant_ids=["ten_a", "ten_b"],
        allocation_ids=["alloc_a", "alloc_b"],
        signals=[{"name": "ib_link_down"}, {"name": "circuit_breaker", "node": "n2"}],
        actions=[
            {"event": "fleet_incident", "node": "n1", "cause": "x", "at": T0.isoformat()},
            {"event": "fleet_incident", "node": "n2", "cause": "y", "at": T0.isoformat()},
        ],
        created_at=T0,
        updated_at=T0,
    )
    mine = incidents.for_tenant(incident, "ten_a", [IncidentTenant(**{**OWN_LINK, "incident_id": "inc_2"})])
    assert (mine.node_ids, mine.allocation_ids, mine.tenant_ids) == (["n1"], ["alloc_a"], ["ten_a"])
    assert [a["node"] for a in mine.actions] == ["n1"] and [s["name"] for s in mine.signals] == ["ib_link_down"]
    dumped = mine.model_dump_json()
    assert "ten_b" not in dumped and "alloc_b" not in dumped and "n2" not in dumped and "n10" not in dumped
    assert "another node" in mine.summary and "n1" in mine.summary


async def test_a_fleet_incident_start_the_engine_refuses_is_logged_and_the_judgement_stands(caplog) -> None:
    client = _EngineDown()
    start = fleet_kind_incidents.IncidentStart(
        incident_id="inc_2", workflow_id="incident-fleet-fi-1", node_id="n1", detected_at=T0
    )
    with caplog.at_level(logging.WARNING, logger="gpucloud.services.pulls"):
        opened = await pulls.open_fleet_incidents(client, Settings(), [start, start])
    assert opened == [] and client.starts == 1  # the same incident twice is started once
    assert any(
        "incident-fleet-fi-1" in r.getMessage() and "the sweep starts it" in r.getMessage() for r in caplog.records
    )
    inp = pulls.fleet_incident_input(Settings(), start)
    assert (inp.workflow_id, inp.incident_id, inp.kind) == ("incident-fleet-fi-1", "inc_2", "fleet")
