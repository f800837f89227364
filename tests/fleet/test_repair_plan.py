"""The reconciler starts a repair only for nodes the health loop pulled, and only when it can work."""

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from gpucloud.health.pulls import PullKind
from gpucloud.models.messages import NodeOperationKind
from gpucloud.reconciler.plan import FleetSilence, NodeSnapshot, control_plane_suspect, plan_node, plan_sweep

pytestmark = pytest.mark.unit

NOW = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("state", "health", "maintenance", "reachable", "start"),
    [
        ("quarantined", "failed", False, True, NodeOperationKind.REPAIR),
        ("quarantined", "suspect", False, True, NodeOperationKind.REPAIR),
        ("quarantined", "ok", False, True, None),  # an operator's drain: the operator decides
        ("quarantined", "failed", True, True, None),  # under maintenance
        ("quarantined", "failed", False, False, None),  # a silent agent would fail every rung
        ("rma", "failed", False, True, None),
        ("available", "failed", False, True, None),
    ],
)
def test_repair_started_for_health_quarantined_nodes_only(state, health, maintenance, reachable, start):
    node = NodeSnapshot(id="n1", state=state, health=health, maintenance=maintenance, agent_reachable=reachable)
    assert plan_node(node, now=NOW, heartbeat_timeout=timedelta(seconds=90)).start == start


@pytest.mark.parametrize(
    ("state", "actions", "replace", "at_once"),
    [
        ("active", ("drain",), True, False),  # the tenant gets the grace period to checkpoint
        ("active", ("watch", "drain_now"), True, True),
        ("reserved", ("drain",), True, True),  # no job on it yet: nothing to wait for
        ("provisioning", ("rma",), True, True),
        ("active", ("watch",), False, False),  # suspect only: watched, not pulled
        ("releasing", ("drain_now",), False, False),  # the allocation is letting go anyway
    ],
)
def test_a_bad_node_its_allocation_holds_is_asked_to_be_replaced(state, actions, replace, at_once):
    conditions = tuple({"name": f"c{i}", "reason": "r", "action": a} for i, a in enumerate(actions))
    node = NodeSnapshot(id="n1", state=state, health="failed", allocation_id="a1", health_conditions=conditions)
    plan = plan_node(node, now=NOW, heartbeat_timeout=timedelta(seconds=90))
    assert (plan.pull == PullKind.REPLACE, plan.immediate, plan.start) == (replace, at_once, None)
    free = NodeSnapshot(id="n1", state=state, health="failed", health_conditions=conditions)
    assert plan_node(free, now=NOW, heartbeat_timeout=timedelta(seconds=90)).pull != PullKind.REPLACE


def test_a_bad_node_back_in_the_pool_is_drained():
    pulled = ({"name": "xid_79", "reason": "fell off the bus", "action": "drain_now"},)
    node = NodeSnapshot(id="n1", state="available", health="failed", health_conditions=pulled)
    assert plan_node(node, now=NOW, heartbeat_timeout=timedelta(seconds=90)).start == NodeOperationKind.DRAIN
    watched = NodeSnapshot(
        id="n1",
        state="available",
        health="suspect",
        health_conditions=({"name": "xid_63", "reason": "r", "action": "watch"},),
    )
    assert plan_node(watched, now=NOW, heartbeat_timeout=timedelta(seconds=90)).empty


@pytest.mark.parametrize(
    ("state", "allocation", "has_bmc", "silent_s", "start", "replace"),
    [
        ("available", None, True, 400, NodeOperationKind.DRAIN, False),  # out of the pool
        ("quarantined", None, True, 400, NodeOperationKind.REPAIR, False),  # power-cycled by the ladder
        ("active", "a1", True, 400, None, True),  # its allocation replaces it at once
        ("available", None, True, 200, None, False),  # silent, not yet past the power-cycle delay
        ("available", None, False, 4000, None, False),  # no BMC: nothing to act with, it waits
        ("quarantined", None, False, 4000, None, False),
    ],
)
def test_a_host_silent_past_the_power_cycle_delay_with_a_bmc_is_pulled_and_repaired(
    state, allocation, has_bmc, silent_s, start, replace
):
    node = NodeSnapshot(
        id="n1",
        state=state,
        allocation_id=allocation,
        last_heartbeat_at=NOW - timedelta(seconds=silent_s),
        agent_reachable=False,
        health="suspect",
        has_bmc=has_bmc,
    )
    plan = plan_node(node, now=NOW, heartbeat_timeout=timedelta(seconds=90), power_cycle_after=timedelta(seconds=300))
    assert (plan.start, plan.pull == PullKind.REPLACE) == (start, replace)
    if replace:
        assert plan.immediate and "host down" in plan.reasons[-1]


def _silent_fleet(silent: int, total: int = 10) -> list[NodeSnapshot]:
    """A fleet of BMC nodes in every state a silent host is power-cycled from, `silent` of them
    quiet past the power-cycle delay (marked unreachable already) and the rest heartbeating."""
    states = [("available", None), ("quarantined", None), ("active", "a1")]
    return [
        NodeSnapshot(
            id=f"n{i}",
            state=states[i % 3][0],
            allocation_id=states[i % 3][1],
            last_heartbeat_at=NOW - timedelta(seconds=400 if i < silent else 5),
            agent_reachable=i >= silent,
            health="suspect" if i < silent else "ok",
            has_bmc=True,
        )
        for i in range(total)
    ]


def _sweep(nodes: list[NodeSnapshot], silent: int):
    return plan_sweep(
        nodes,
        now=NOW,
        heartbeat_timeout=timedelta(seconds=90),
        power_cycle_after=timedelta(seconds=300),
        silence=FleetSilence(reporting=len(nodes), silent=silent),
        max_silent_share=0.5,
        min_silent_nodes=5,
    )


def test_a_fleet_wide_silence_holds_every_power_action_and_raises_an_alert():
    """60 % of the fleet silent at once is likelier the control plane's doing (an overloaded API
    answering every agent 503): power-cycling it would make the outage real."""
    sweep = _sweep(_silent_fleet(6), silent=6)
    assert sweep.alert is not None and "6 of 10" in sweep.alert and "control plane" in sweep.alert
    assert [(p.start, p.pull) for p in sweep.plans if p.start or p.pull != PullKind.NONE] == []


def test_one_silent_host_is_still_power_cycled():
    sweep = _sweep(_silent_fleet(3), silent=3)  # below both the share and the minimum count
    assert sweep.alert is None
    assert [(p.node_id, p.start, p.pull) for p in sweep.plans] == [
        ("n0", NodeOperationKind.DRAIN, PullKind.DRAIN),  # out of the pool, then power-cycled
        ("n1", NodeOperationKind.REPAIR, PullKind.NONE),  # power-cycled by the repair ladder
        ("n2", None, PullKind.REPLACE),  # its allocation replaces it at once
    ]
    (one,) = _sweep(_silent_fleet(1), silent=1).plans
    assert (one.node_id, one.start) == ("n0", NodeOperationKind.DRAIN)


@pytest.mark.parametrize(("silent", "reporting", "suspect"), [(5, 10, True), (4, 8, False), (5, 12, False)])
def test_the_silence_is_suspect_from_the_share_and_the_count_together(silent, reporting, suspect):
    found = control_plane_suspect(FleetSilence(reporting=reporting, silent=silent), max_share=0.45, min_nodes=5)
    assert (found is not None) == suspect


def test_a_node_whose_credential_was_revoked_is_not_marked_unreachable_for_its_silence():
    """It cannot report until its next wipe: silence is expected, not a host that went down."""
    quiet = {"state": "quarantined", "health": "failed", "has_bmc": True, "last_heartbeat_at": NOW - timedelta(hours=1)}
    revoked = plan_node(
        NodeSnapshot(id="n1", reports_revoked=True, **quiet),
        now=NOW,
        heartbeat_timeout=timedelta(seconds=90),
        power_cycle_after=timedelta(seconds=300),
    )
    assert revoked.set_reachable is None and revoked.start == NodeOperationKind.REPAIR
    assert "power cycle" not in "; ".join(revoked.reasons)  # the ladder's own rung, through the agent
    heard = plan_node(NodeSnapshot(id="n1", **quiet), now=NOW, heartbeat_timeout=timedelta(seconds=90))
    assert heard.set_reachable is False


_LINK_DOWN = ({"name": "ib_link_down", "action": "drain", "reason": "port mlx5_0/1 down"},)


@pytest.mark.parametrize(
    ("state", "allocation_id", "reachable"),
    [
        ("quarantined", None, True),  # drained before the burst showed: not repaired
        ("available", None, True),  # its conditions pull: not drained
        ("active", "a1", True),  # its allocation's: not replaced
        ("available", None, False),  # a host silent past the power-cycle delay: not power-cycled
        ("active", "a1", False),
        ("quarantined", None, False),
    ],
)
def test_a_node_inside_an_open_fleet_incident_is_neither_pulled_repaired_nor_power_cycled(
    state, allocation_id, reachable
):
    node = NodeSnapshot(
        id="n1",
        state=state,
        health="failed",
        health_conditions=_LINK_DOWN,
        allocation_id=allocation_id,
        agent_reachable=reachable,
        last_heartbeat_at=NOW - timedelta(seconds=5 if reachable else 3600),
        has_bmc=True,
    )
    timing = {"now": NOW, "heartbeat_timeout": timedelta(seconds=90), "power_cycle_after": timedelta(seconds=300)}
    free = plan_node(node, **timing)
    assert free.start is not None or free.pull != PullKind.NONE  # the same node outside an incident is acted on
    held = plan_node(dataclasses.replace(node, fleet_incident_id="fi-1"), **timing)
    assert (held.start, held.pull) == (None, PullKind.NONE)
    assert "held by fleet incident fi-1" in held.reasons


def test_an_operators_drain_of_a_node_inside_a_fleet_incident_still_happens():
    node = NodeSnapshot(id="n1", state="available", drain_requested=True, fleet_incident_id="fi-1")
    assert plan_node(node, now=NOW, heartbeat_timeout=timedelta(seconds=90)).start == NodeOperationKind.DRAIN
