"""What one node needs, decided from its record alone: pure, no I/O, time passed in.

Level-triggered like a Kubernetes controller: the plan depends only on the node's current
record (desired state: operator intent, deadlines; observed state: agent heartbeats), never on
which event woke the reconciler, so running it twice, late, or after an outage is harmless.

One fleet-wide fact joins the record: how much of the fleet is silent (`plan_sweep`). A host
that stops heartbeating is power-cycled through its BMC; but when a large share of the fleet
goes silent together, the likelier cause is the control plane itself (an overloaded API that
answers every agent 503, a partition), and power-cycling the fleet would turn that outage into a
real one. So, as the circuit breaker does for health pulls, the sweep then holds every power
action and raises an operator alert until the silence clears.

A node inside an open fleet incident (`fleet_incident_id`: a leaf switch, rack or PDU is
suspected, `services/fleet_incidents.py`) is left where it is: its health conditions pull
nothing, and it is neither repaired nor power-cycled until an operator resolves the incident.
Deadlines, reachability and an operator's own drain still apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpucloud.health.pulls import HELD, PullDecision, PullKind, pulling_since, pulls, replace_at_once, stored_action
from gpucloud.models.messages import NodeOperationKind
from gpucloud.models.node_states import NodeState, failure_target

Op = NodeOperationKind

# The condition the reconciler owns on a node's health. (A node whose agent reports it lost its
# tenant's workload is `Node.drifted`, a column the sweep restores from, not a health condition.)
AGENT_UNREACHABLE = "AgentUnreachable"


@dataclass(frozen=True)
class NodeSnapshot:
    id: str
    state: str
    deadline_at: datetime | None = None
    drain_requested: bool = False
    last_heartbeat_at: datetime | None = None
    agent_reachable: bool = True
    drifted: bool = False
    tenant_id: str | None = None
    allocation_id: str | None = None
    health: str = "ok"
    maintenance: bool = False
    health_conditions: tuple[dict, ...] = ()
    has_bmc: bool = False
    # Its agent credential was revoked when its allocation ended: it cannot report until its
    # next wipe, so its silence says nothing about the host.
    reports_revoked: bool = False
    # The open fleet incident that holds it: no pull, repair or power cycle.
    fleet_incident_id: str | None = None


@dataclass
class NodePlan:
    node_id: str
    deadline_passed: bool = False
    state_after_deadline: str | None = None
    set_reachable: bool | None = None  # None: leave as is
    start: NodeOperationKind | None = None
    # The plan pulls a node on the health rules' word alone: (again) ask the allocation's
    # workflow to replace it (re-derived from the record, so a lost signal is sent again), or
    # drain a node back in the pool (`start`). The circuit breaker's alert on the node holds it
    # back for the operator.
    pull: PullKind = PullKind.NONE
    immediate: bool = False  # a replacement with no grace period
    tenant_id: str | None = None
    allocation_id: str | None = None
    reasons: list[str] = field(default_factory=list)
    # When the pull's cause began: the pulling conditions' `since`, or the silence of a host down.
    since: datetime | None = None

    @property
    def empty(self) -> bool:
        return (
            not self.deadline_passed
            and self.set_reachable is None
            and self.start is None
            and self.pull != PullKind.REPLACE
        )

    def decision(self) -> PullDecision:
        """The plan's pull, for `services.pulls.carry_out`."""
        return PullDecision(
            node_id=self.node_id,
            kind=self.pull,
            allocation_id=self.allocation_id,
            reason="; ".join(self.reasons)[:1000],
            immediate=self.immediate,
            since=self.since,
        )


# Transient states whose work belongs to the node's own workflows once the allocation has let
# go: if the reconciler finds a node there it (re)starts the operation that finishes the job.
_RESUME = {
    NodeState.ENROLLED: Op.BRINGUP,
    NodeState.INSPECTING: Op.BRINGUP,
    NodeState.WIPING: Op.RECYCLE,
    NodeState.BURN_IN: Op.RECYCLE,
}


@dataclass(frozen=True)
class FleetSilence:
    """Nodes whose agents are expected to report, and how many of them are silent past the
    heartbeat timeout."""

    reporting: int = 0
    silent: int = 0


@dataclass
class SweepPlan:
    plans: list[NodePlan]
    # Why the silence looks like the control plane's own, for an operator; power actions held.
    alert: str | None = None


def control_plane_suspect(silence: FleetSilence, *, max_share: float, min_nodes: int) -> str | None:
    """Why this much silence is likelier the control plane's doing than the hosts', or None."""
    if silence.silent < min_nodes or silence.silent < max_share * silence.reporting:
        return None
    return (
        f"{silence.silent} of {silence.reporting} reporting nodes are silent at once (at least"
        f" {max_share:.0%} and {min_nodes}): suspect the control plane (API overloaded, network"
        " partition), not the hosts; no node is power-cycled until the silence clears"
    )


def plan_sweep(
    nodes: list[NodeSnapshot],
    *,
    now: datetime,
    heartbeat_timeout: timedelta,
    power_cycle_after: timedelta | None,
    silence: FleetSilence,
    max_silent_share: float,
    min_silent_nodes: int,
) -> SweepPlan:
    """Every candidate's plan, with power actions held while the fleet's silence is suspect."""
    alert = control_plane_suspect(silence, max_share=max_silent_share, min_nodes=min_silent_nodes)
    plans = [
        plan_node(
            n, now=now, heartbeat_timeout=heartbeat_timeout, power_cycle_after=power_cycle_after, hold_power=bool(alert)
        )
        for n in nodes
    ]
    return SweepPlan(plans=[p for p in plans if not p.empty], alert=alert)


def plan_node(
    node: NodeSnapshot,
    *,
    now: datetime,
    heartbeat_timeout: timedelta,
    power_cycle_after: timedelta | None = None,
    hold_power: bool = False,
) -> NodePlan:
    plan = NodePlan(node_id=node.id, tenant_id=node.tenant_id, allocation_id=node.allocation_id)
    state = NodeState(node.state)

    if node.deadline_at is not None and node.deadline_at <= now:
        target = failure_target(state)
        if target is not None:
            plan.deadline_passed = True
            plan.state_after_deadline = target.value
            plan.reasons.append(f"{state.value} overdue since {node.deadline_at.isoformat()}: -> {target.value}")
            state = target

    if node.last_heartbeat_at is not None and not node.reports_revoked:
        stale = now - node.last_heartbeat_at > heartbeat_timeout
        if stale and node.agent_reachable:
            plan.set_reachable = False
            plan.reasons.append(f"no heartbeat since {node.last_heartbeat_at.isoformat()}")
        elif not stale and not node.agent_reachable:
            plan.set_reachable = True
            plan.reasons.append("agent heartbeats again")

    reachable = node.agent_reachable if plan.set_reachable is None else plan.set_reachable
    # A host silent this long is down (hung or off): with a BMC it is pulled, then power-cycled
    # by the repair ladder (without one it waits for its agent, as there is nothing to act with).
    # Not while the fleet's silence is suspect (`hold_power`): then nothing is pulled for it.
    held = node.fleet_incident_id is not None
    host_down = (
        not hold_power
        and not held
        and node.has_bmc
        and not reachable
        and power_cycle_after is not None
        and node.last_heartbeat_at is not None
        and now - node.last_heartbeat_at >= power_cycle_after
    )
    # Only a node that is down has its reason written (the sweep plans every candidate node).
    down_reason = f"agent silent since {node.last_heartbeat_at}: host down" if host_down else ""
    if node.drain_requested and state in (NodeState.AVAILABLE, NodeState.ACTIVE, NodeState.DRAINING):
        plan.start = Op.DRAIN
        plan.reasons.append("operator asked to drain")
    elif state in _RESUME:
        plan.start = _RESUME[state]
    elif state == NodeState.ACTIVE and node.drifted and reachable:
        plan.start = Op.RESTORE
        plan.reasons.append("agent reports a node that lost its tenant's workload")
    elif held:
        plan.reasons.append(f"held by fleet incident {node.fleet_incident_id}")
    elif state in HELD and node.allocation_id is not None:
        pulling = _pulling(node)
        if pulling or host_down:
            plan.pull = PullKind.REPLACE
            plan.immediate = host_down or replace_at_once(state, stored_action(pulling))
            plan.since = pulling_since(pulling) or (node.last_heartbeat_at if host_down else None)
            reasons = [f"{c.get('name')}: {c.get('reason')}" for c in pulling] + ([down_reason] if host_down else [])
            plan.reasons.append("; ".join(reasons)[:900])
    elif state == NodeState.AVAILABLE and node.allocation_id is None and host_down:
        plan.start, plan.pull = Op.DRAIN, PullKind.DRAIN
        plan.reasons.append(f"{down_reason}: out of the pool, to be power-cycled through its BMC")
        plan.since = node.last_heartbeat_at
    elif state == NodeState.AVAILABLE and node.allocation_id is None and _pulling(node):
        # Judged bad while an allocation held it, which let go before pulling it: drain it now.
        plan.start, plan.pull = Op.DRAIN, PullKind.DRAIN
        plan.reasons.append("health rules want it pulled; its allocation let go first")
        plan.since = pulling_since(_pulling(node))
    elif needs_repair(state, health=node.health, maintenance=node.maintenance, reachable=reachable or host_down):
        plan.start = Op.REPAIR
        plan.reasons.append(
            f"{down_reason}: power cycle through the BMC, then burn-in"
            if host_down and not reachable
            else f"quarantined with health {node.health}: repair, then burn-in"
        )
    return plan


def _pulling(node: NodeSnapshot) -> list[dict]:
    """The node's stored conditions whose action takes it out."""
    return [c for c in node.health_conditions if pulls(stored_action([c]))]


def needs_repair(state: NodeState, *, health: str, maintenance: bool, reachable: bool) -> bool:
    """A node the health loop pulled goes up the repair ladder; one an operator drained (health
    ok), or under maintenance, or whose agent is silent with no BMC to power-cycle it (a repair
    would only fail) waits; `reachable` is true for a silent node with a BMC.
    Lemons and used-up ladders are sent to RMA by the repair itself, without another reset."""
    return state == NodeState.QUARANTINED and health != "ok" and not maintenance and reachable


def backoff(attempts: int, *, base_s: float, cap_s: float) -> timedelta:
    """Delay before the reconciler touches a node again after `attempts` tries: base x 2^(n-1), capped."""
    if attempts <= 0:
        return timedelta(0)
    return timedelta(seconds=min(cap_s, base_s * 2 ** (attempts - 1)))
