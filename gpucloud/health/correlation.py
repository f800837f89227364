"""Correlated faults: several nodes behind one leaf switch, rack or PDU failing together are one
fleet incident that suspects the shared component, not that many broken nodes.

The health rules judge one node at a time (`rules.evaluate_node`). When a leaf switch dies, every
node behind it reports its fabric links down within seconds; a tripped PDU takes a rack's worth of
nodes off at once. Judged one by one, each node is drained, reset, burnt in and perhaps sent for
RMA, though nothing is wrong with it, and the operator is told about N nodes instead of one switch.

`correlate(observations, topology, policy=)` groups faults by the components the nodes share:

- A *burst* behind a component: at least `CorrelationPolicy.threshold(size)` distinct nodes behind
  it (`min_nodes`, or `min_share` of the component's nodes if that is more) fault within `window`
  of each other. "Within" is inclusive: faults exactly `window` apart are together, as in
  `rules.group_incidents`. Every window [t, t + window] that starts at a fault and holds enough
  nodes belongs to the burst, and windows that overlap are one burst, so a burst lasts as long as
  faults keep arriving that fast and no longer.
- The smallest component explains first: leaf switches, then racks, then PDUs (the order of
  `ComponentKind`, not of node counts). A rack is looked at only with the faults no leaf-switch
  incident explained, so three faults behind one switch and a stray fault next door are a switch
  incident and a node-level fault, not a rack incident. When the faults left over do make a burst
  of a larger component, that incident takes in the smaller incidents inside the component that
  overlap it in time (within `window`): one cause that explains all of them is the simpler story.
- Each incident names its component (kind and id), its nodes, its first and last fault, and the
  sentence an operator reads. A node whose every fault here lies inside incidents has its
  node-level pull suppressed; a node with any fault outside them is judged alone as before. A node
  missing from the topology, or with no component of a kind, is never correlated on that kind.

The result depends only on the set of observations: input order and exact duplicates change
nothing.

How the circuit breaker (`health/breaker.py`) becomes topology-aware with this
(`services/fleet_incidents.py`, asked by `services/health.py` before the breaker): alone it sees
only pulls per pool (per owner) and refuses beyond `max_pulled_share`, so a switch behind 16 nodes
would spend a pool's whole budget on nodes that are fine, leave a really broken node elsewhere
unpulled for the breaker's window, and name a pool, not the switch. The health service runs
`correlate` over the fleet's recent faults (the correlation window of them) before asking the
breaker; a node whose pull is suppressed does not ask it at all (it spends no budget), each
`FleetIncident` becomes one fleet incident and one operator alert naming the component to look at,
and only the faults left node-level go to `request_quarantine`. The breaker stays as the backstop
for shared causes the topology cannot see (a driver rollout, a bug in the rules), and
`BreakerState` needs no change.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field


class ComponentKind(StrEnum):
    """Components nodes share, smallest first: the order in which they are suspected."""

    LEAF_SWITCH = "leaf_switch"
    RACK = "rack"
    PDU = "pdu"


_KINDS = list(ComponentKind)
_LABEL = {ComponentKind.LEAF_SWITCH: "leaf switch", ComponentKind.RACK: "rack", ComponentKind.PDU: "PDU"}


class Component(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: ComponentKind
    id: str

    def __str__(self) -> str:
        return f"{_LABEL[self.kind]} {self.id}"


class NodePlacement(BaseModel):
    """Where a node sits: the components it shares with others. `None`: not known."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    leaf_switch: str | None = None
    rack: str | None = None
    pdu: str | None = None

    def component(self, kind: ComponentKind) -> Component | None:
        component_id = getattr(self, kind.value)
        return None if component_id is None else Component(kind=kind, id=component_id)


class Topology:
    """The fleet's placements, indexed both ways."""

    def __init__(self, placements: Iterable[NodePlacement]):
        self._placements: dict[str, NodePlacement] = {}
        self._behind: dict[Component, set[str]] = {}
        for placement in placements:
            if placement.node_id in self._placements:
                raise ValueError(f"node {placement.node_id} placed twice")
            self._placements[placement.node_id] = placement
            for kind in ComponentKind:
                if (component := placement.component(kind)) is not None:
                    self._behind.setdefault(component, set()).add(placement.node_id)

    def component_of(self, node_id: str, kind: ComponentKind) -> Component | None:
        placement = self._placements.get(node_id)
        return None if placement is None else placement.component(kind)

    def nodes_behind(self, component: Component) -> frozenset[str]:
        return frozenset(self._behind.get(component, ()))


class FaultObservation(BaseModel):
    """One fault a node showed: a health condition's name (`xid_79`, `nvlink_down`, ...), a lost
    agent, a fabric link down; `signal` is whatever the caller's category is."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    at: AwareDatetime
    signal: str


class CorrelationPolicy(BaseModel):
    """How many nodes, how close together, make a burst. Starting points, tuned per fleet."""

    model_config = ConfigDict(frozen=True)

    window: timedelta = Field(default=timedelta(minutes=5), gt=timedelta(0))
    # Two nodes failing together happen by chance in a large fleet; three behind one switch rarely.
    min_nodes: int = Field(default=3, ge=2)
    min_share: float = Field(default=0.0, ge=0, le=1)

    def threshold(self, component_size: int) -> int:
        return max(self.min_nodes, math.ceil(self.min_share * component_size))


DEFAULT_CORRELATION_POLICY = CorrelationPolicy()


class FleetIncident(BaseModel):
    """Faults on several nodes explained by one shared component."""

    model_config = ConfigDict(frozen=True)

    component: Component
    component_size: int  # nodes behind it in the topology
    nodes: tuple[str, ...]
    observations: tuple[FaultObservation, ...]
    first: AwareDatetime
    last: AwareDatetime

    @property
    def signals(self) -> tuple[str, ...]:
        return tuple(sorted({o.signal for o in self.observations}))

    @property
    def reason(self) -> str:
        return (
            f"{len(self.nodes)} of {self.component_size} nodes behind {self.component} faulted between "
            f"{self.first.isoformat()} and {self.last.isoformat()} ({', '.join(self.signals)}): suspect "
            f"the {_LABEL[self.component.kind]}, not the nodes; their node-level pulls are held"
        )


class NodeFaults(BaseModel):
    """One node's faults, and which of them fleet incidents explain."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    incidents: tuple[Component, ...]  # the components blamed for some of its faults
    unexplained: tuple[FaultObservation, ...]  # its faults left to node-level judgement

    @property
    def pull_suppressed(self) -> bool:
        return bool(self.incidents) and not self.unexplained


class Correlation(BaseModel):
    model_config = ConfigDict(frozen=True)

    incidents: tuple[FleetIncident, ...]
    nodes: tuple[NodeFaults, ...]  # every node with a fault, by node id

    def pull_suppressed(self, node_id: str) -> bool:
        return any(n.node_id == node_id and n.pull_suppressed for n in self.nodes)


def correlate(
    observations: Iterable[FaultObservation],
    topology: Topology,
    *,
    policy: CorrelationPolicy = DEFAULT_CORRELATION_POLICY,
) -> Correlation:
    """Fleet incidents for the bursts behind shared components; everything else node-level."""
    faults = sorted(set(observations), key=_order)
    explained: set[FaultObservation] = set()
    incidents: list[FleetIncident] = []
    for kind in ComponentKind:
        found = []
        for component, behind in sorted(_group_by(faults, topology, kind).items(), key=lambda c: c[0].id):
            size = len(topology.nodes_behind(component))
            unexplained = [o for o in behind if o not in explained]
            for burst in _bursts(unexplained, window=policy.window, threshold=policy.threshold(size)):
                absorbed = [i for i in incidents if _inside(i, component, topology) and _near(i, burst, policy.window)]
                incidents = [i for i in incidents if i not in absorbed]
                found.append(_incident(component, size, burst + [o for i in absorbed for o in i.observations]))
        # Components of one kind share no node, so their bursts cannot overlap: mark them together.
        explained.update(o for incident in found for o in incident.observations)
        incidents.extend(found)
    incidents.sort(key=lambda i: (i.first, _KINDS.index(i.component.kind), i.component.id))
    return Correlation(incidents=tuple(incidents), nodes=_node_faults(faults, incidents, explained))


def _order(o: FaultObservation) -> tuple[datetime, str, str]:
    return (o.at, o.node_id, o.signal)


def _group_by(
    faults: list[FaultObservation], topology: Topology, kind: ComponentKind
) -> dict[Component, list[FaultObservation]]:
    groups: dict[Component, list[FaultObservation]] = {}
    for fault in faults:
        if (component := topology.component_of(fault.node_id, kind)) is not None:
            groups.setdefault(component, []).append(fault)
    return groups


def _bursts(faults: list[FaultObservation], *, window: timedelta, threshold: int) -> list[list[FaultObservation]]:
    """Faults (in time order) in windows [t, t + window] starting at a fault and holding at least
    `threshold` distinct nodes; overlapping windows merge into one burst."""
    bursts: list[list[FaultObservation]] = []
    nodes_in_window: Counter[str] = Counter()
    end = 0  # faults[start:end] lie within `window` of faults[start]
    burst_end = 0  # faults[:burst_end] are in a burst already or in none
    open_until: datetime | None = None  # the end of the last qualifying window
    for start, first in enumerate(faults):
        while end < len(faults) and faults[end].at - first.at <= window:
            nodes_in_window[faults[end].node_id] += 1
            end += 1
        if len(nodes_in_window) >= threshold:
            if open_until is None or first.at > open_until:
                bursts.append([])
                burst_end = start
            bursts[-1].extend(faults[burst_end:end])
            burst_end = end
            open_until = first.at + window
        nodes_in_window[first.node_id] -= 1
        if nodes_in_window[first.node_id] == 0:
            del nodes_in_window[first.node_id]
    return bursts


def _inside(incident: FleetIncident, component: Component, topology: Topology) -> bool:
    return set(incident.nodes) <= topology.nodes_behind(component)


def _near(incident: FleetIncident, burst: list[FaultObservation], window: timedelta) -> bool:
    return incident.first <= burst[-1].at + window and incident.last >= burst[0].at - window


def _incident(component: Component, size: int, faults: list[FaultObservation]) -> FleetIncident:
    ordered = sorted(faults, key=_order)
    return FleetIncident(
        component=component,
        component_size=size,
        nodes=tuple(sorted({o.node_id for o in ordered})),
        observations=tuple(ordered),
        first=ordered[0].at,
        last=ordered[-1].at,
    )


def _node_faults(
    faults: list[FaultObservation], incidents: list[FleetIncident], explained: set[FaultObservation]
) -> tuple[NodeFaults, ...]:
    blamed: dict[str, set[Component]] = {}
    for incident in incidents:
        for node_id in incident.nodes:
            blamed.setdefault(node_id, set()).add(incident.component)
    by_node: dict[str, list[FaultObservation]] = {}
    for fault in faults:
        by_node.setdefault(fault.node_id, []).append(fault)
    return tuple(
        NodeFaults(
            node_id=node_id,
            incidents=tuple(sorted(blamed.get(node_id, ()), key=lambda c: (_KINDS.index(c.kind), c.id))),
            unexplained=tuple(o for o in node_faults if o not in explained),
        )
        for node_id, node_faults in sorted(by_node.items())
    )
