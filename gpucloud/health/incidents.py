"""An incident's phases, read off what happened (pure: no I/O, no clock).

A node incident (`models.health_tables.Incident`) opens when the health loop pulls a node and
follows it through six phases; each timestamp is the moment the node's history shows, never
the moment somebody looked:

- **detected**: the first fault (the pull's `fault_at`, or the pulling condition's `since`);
- **stabilized**: the node pulled (cordoned or drained) and, if an allocation held it, the
  allocation whole again (the `replaced` event naming the node: its replacement is active);
- **diagnosed**: the repair ladder took the node (`quarantined -> repairing`: the plan picked a
  rung, or the lemon rule / a used-up ladder sent it to RMA);
- **repaired**: the rung that ran last before the node passed burn-in (`repairing -> wiping`,
  whose cause names the rung: "repair attempt 2: reboot");
- **gated**: burn-in passed and the node is `available` again (`burn_in -> available`); RMA (or
  retirement) ends the incident instead;
- **write-up**: `health.incident_writeup`, once it ended.

A fleet incident (kind `fleet`) is a correlated burst behind one leaf switch, rack or PDU
(`fleet_phases`) or a circuit-breaker trip in one pool (`breaker_phases`); its phases are the
component's, not a node's:

- burst: **detected** the burst's first fault; **stabilized** its nodes cordoned (the last to
  join; correlation replaces no node, so tenants keep theirs); **diagnosed** the component
  suspected (the correlation's moment); **repaired** an operator resolved it (the note says what
  fixed it); **gated** every node back to normal judgement (healthy and uncordoned, pulled on
  its own afterwards, or gone);
- trip: **detected**, **stabilized** and **diagnosed** the first refused pull (the breaker held
  the pool's nodes in, and its alert names the pool and the share pulled); **repaired** and
  **gated** the window let pulls through again, or an operator resolved it (the refused nodes
  are judged normally again from then on).

`classify` names the category (`health.categories.FaultCategory`) and the suspected component
of the conditions that pulled the node; `burst_category` a burst's from its component and signals.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from gpucloud.health.categories import FaultCategory
from gpucloud.health.signals import SIGNAL_TABLE
from gpucloud.models.node_states import NodeState

# A fault's timestamp is the node's clock, the history's the control plane's: an agent may run
# this far ahead (`api_schemas.MAX_READING_CLOCK_SKEW`), so steps this much earlier still count.
CLOCK_SKEW = timedelta(minutes=5)


class Phase(StrEnum):
    """The phase an incident waits for next (`closed` once its write-up is written)."""

    STABILIZE = "stabilize"
    DIAGNOSE = "diagnose"
    REPAIR = "repair"
    GATE = "gate"
    WRITE_UP = "write_up"
    CLOSED = "closed"


class IncidentStatus(StrEnum):
    OPEN = "open"
    RESOLVED = "resolved"  # gated: the node is back in the pool
    RMA = "rma"  # the node went to RMA (or was retired)
    ABANDONED = "abandoned"  # the workflow stopped waiting (`health.incident_max_wait_s`)


@dataclass(frozen=True)
class Step:
    """One entry of the node's history (`NodeTransition`), as the incident reads it."""

    at: datetime
    event: str
    from_state: str
    to_state: str
    cause: str = ""
    actor: str = ""

    def as_action(self) -> dict:
        return {
            "at": self.at.isoformat(),
            "event": self.event,
            "from": self.from_state,
            "to": self.to_state,
            "cause": self.cause,
            "actor": self.actor,
        }


@dataclass(frozen=True)
class Replacement:
    """An allocation's `replaced` event: `node_id` left, `replacement_node_id` took its place."""

    at: datetime
    node_id: str
    replacement_node_id: str | None


@dataclass(frozen=True)
class Phases:
    pulled_at: datetime | None = None
    stabilized_at: datetime | None = None
    diagnosed_at: datetime | None = None
    repaired_at: datetime | None = None
    repaired_by: str | None = None
    gated_at: datetime | None = None
    ended: IncidentStatus | None = None  # resolved or rma; None while open
    ended_at: datetime | None = None
    replacement_node_id: str | None = None

    @property
    def phase(self) -> Phase:
        if self.ended is not None:
            return Phase.WRITE_UP
        if self.stabilized_at is None:
            return Phase.STABILIZE
        if self.diagnosed_at is None:
            return Phase.DIAGNOSE
        if self.repaired_at is None:
            return Phase.REPAIR
        return Phase.GATE


_PULLED_BY = frozenset({"cordon", "drain"})
_OUT = frozenset({NodeState.DRAINING, NodeState.QUARANTINED, NodeState.REPAIRING, NodeState.RMA})
_GONE = frozenset({NodeState.RMA, NodeState.RETIRED})
_RUNG = re.compile(r"repair attempt \d+: (\w+)")


def rung_of(cause: str) -> str:
    """The rung a `repairing -> wiping` move names ("repair attempt 2: reboot" -> "reboot")."""
    found = _RUNG.search(cause)
    if found:
        return found.group(1)
    return "power_cycle" if "power" in cause or "cycle" in cause else (cause[:80] or "repair")


def phases(
    *,
    node_id: str,
    detected_at: datetime,
    held: bool,
    steps: Sequence[Step],
    replacements: Iterable[Replacement] = (),
    allocation_ended_at: datetime | None = None,
) -> Phases:
    """Each phase's timestamp as far as the history goes (`held`: an allocation held the node
    when it was pulled; `allocation_ended_at`: that allocation ended without replacing it)."""
    after = detected_at - CLOCK_SKEW
    history = sorted((s for s in steps if s.at >= after), key=lambda s: s.at)
    pulled = next(
        (s for s in history if s.event in _PULLED_BY or (s.to_state in _OUT and s.from_state != s.to_state)), None
    )
    if pulled is None:
        return Phases()
    stabilized_at: datetime | None = pulled.at
    replacement_id = None
    if held:
        replaced = next(
            (r for r in sorted(replacements, key=lambda r: r.at) if r.node_id == node_id and r.at >= after), None
        )
        if replaced is not None:
            stabilized_at, replacement_id = max(replaced.at, pulled.at), replaced.replacement_node_id
        elif allocation_ended_at is not None:
            stabilized_at = max(allocation_ended_at, pulled.at)  # nothing left to make whole
        else:
            stabilized_at = None
    rest = [s for s in history if s.at >= pulled.at]
    diagnosed = next(
        (s for s in rest if s.to_state in (NodeState.REPAIRING, *_GONE) and s.from_state != s.to_state), None
    )
    found = Phases(pulled_at=pulled.at, stabilized_at=stabilized_at, replacement_node_id=replacement_id)
    if diagnosed is None:
        return found
    repaired: Step | None = None

    def so_far(**ended: object) -> Phases:
        """The phases up to the last repair rung seen, with how (and whether) the incident ended."""
        return Phases(
            pulled_at=pulled.at,
            stabilized_at=stabilized_at or ended.get("ended_at"),  # type: ignore[arg-type]
            diagnosed_at=diagnosed.at,
            repaired_at=repaired.at if repaired else None,
            repaired_by=rung_of(repaired.cause) if repaired else None,
            replacement_node_id=replacement_id,
            **ended,  # type: ignore[arg-type]
        )

    for step in rest:
        if step.at < diagnosed.at:
            continue
        if step.from_state == NodeState.REPAIRING and step.to_state == NodeState.WIPING:
            repaired = step
        elif step.from_state == NodeState.BURN_IN and step.to_state == NodeState.AVAILABLE:
            return so_far(gated_at=step.at, ended=IncidentStatus.RESOLVED, ended_at=step.at)
        elif step.to_state in _GONE and step.from_state != step.to_state:
            return so_far(ended=IncidentStatus.RMA, ended_at=step.at)
    return so_far()


@dataclass(frozen=True)
class BurstNode:
    """One node of a correlated burst as its record and history show it: when it joined the
    incident (cordoned), and when it was back to normal judgement after the incident was
    resolved (None: not yet)."""

    node_id: str
    joined_at: datetime | None = None
    back_at: datetime | None = None


def fleet_phases(
    *,
    opened_at: datetime,
    resolved_at: datetime | None,
    resolved_by: str | None,
    nodes: Sequence[BurstNode],
) -> Phases:
    """A correlated burst's phases (its `detected_at` is the burst's first fault)."""
    joined = [n.joined_at for n in nodes if n.joined_at is not None]
    stabilized_at = max([opened_at, *joined])
    if resolved_at is None:
        return Phases(stabilized_at=stabilized_at, diagnosed_at=opened_at)
    backs = [n.back_at for n in nodes]
    if not nodes or any(b is None for b in backs):
        return Phases(
            stabilized_at=stabilized_at, diagnosed_at=opened_at, repaired_at=resolved_at, repaired_by=resolved_by
        )
    gated_at = max([resolved_at, *(b for b in backs if b is not None)])
    return Phases(
        stabilized_at=stabilized_at,
        diagnosed_at=opened_at,
        repaired_at=resolved_at,
        repaired_by=resolved_by,
        gated_at=gated_at,
        ended=IncidentStatus.RESOLVED,
        ended_at=gated_at,
    )


def breaker_phases(*, detected_at: datetime, closed_at: datetime | None, closed_by: str | None) -> Phases:
    """A breaker trip's phases: held at once; over when its window let pulls through again or
    an operator resolved it (`closed_at`, `closed_by`: "breaker window" or the operator)."""
    if closed_at is None:
        return Phases(stabilized_at=detected_at, diagnosed_at=detected_at)
    closed_at = max(closed_at, detected_at)
    return Phases(
        stabilized_at=detected_at,
        diagnosed_at=detected_at,
        repaired_at=closed_at,
        repaired_by=closed_by,
        gated_at=closed_at,
        ended=IncidentStatus.RESOLVED,
        ended_at=closed_at,
    )


def fleet_gpu_hours_lost(*, gpu_count: int, detected_at: datetime, until: datetime | None, now: datetime) -> float:
    """A fleet incident's GPU-hours: its nodes' GPUs from the first fault until the component was
    fixed (or the trip over), counted up to `now` while it is not."""
    end = until or now
    return round(max(0.0, (end - detected_at).total_seconds()) / 3600 * gpu_count, 4)


def gpu_hours_lost(*, gpu_count: int, detected_at: datetime, held: bool, phases_: Phases, now: datetime) -> float:
    """The GPU-hours the fault took: a held node's GPUs from detection until its allocation was
    whole again (the tenant's loss); an idle node's until it was back in the pool or gone (the
    pool's). Counted up to `now` while that moment has not come."""
    until = phases_.stabilized_at if held else (phases_.gated_at or phases_.ended_at)
    end = until or now
    return round(max(0.0, (end - detected_at).total_seconds()) / 3600 * gpu_count, 4)


# ----------------------------------------------------------------- classification

# XIDs by the fault category the Llama 3 run filed them under (`sim/faults.py` draws them so).
_XID_CATEGORY = {
    48: FaultCategory.HBM3,
    63: FaultCategory.HBM3,
    64: FaultCategory.HBM3,
    74: FaultCategory.NETWORK,
    79: FaultCategory.FAULTY_GPU,
    94: FaultCategory.GPU_SRAM,
    95: FaultCategory.GPU_SRAM,
    119: FaultCategory.GSP,
    120: FaultCategory.GSP,
    13: FaultCategory.SOFTWARE,
    31: FaultCategory.SOFTWARE,
    43: FaultCategory.SOFTWARE,
    45: FaultCategory.SOFTWARE,
    68: FaultCategory.SOFTWARE,
}
# Counter-trend and probe conditions (`health/trends.py`, `health/rules.py`), by name prefix.
_NAME_CATEGORY = (
    ("ecc", FaultCategory.HBM3),
    ("remap", FaultCategory.HBM3),
    ("row_remap", FaultCategory.HBM3),
    ("nvlink", FaultCategory.NETWORK),
    ("link", FaultCategory.NETWORK),
    ("gpu_lost", FaultCategory.FAULTY_GPU),
    ("probe_fatal", FaultCategory.FAULTY_GPU),
    ("lemon", FaultCategory.FAULTY_GPU),
    ("gpu_missing", FaultCategory.FAULTY_GPU),
    ("reset_required", FaultCategory.FAULTY_GPU),
    ("driver", FaultCategory.SOFTWARE),
    ("application", FaultCategory.SOFTWARE),
)


def category_of(condition: dict) -> FaultCategory:
    xid = condition.get("xid")
    if isinstance(xid, int):
        return _XID_CATEGORY.get(xid, FaultCategory.FAULTY_GPU)
    name = str(condition.get("name", ""))
    for signal, row in SIGNAL_TABLE.items():
        if name == signal.value or name.startswith(f"{signal.value}"):
            return row.category
    for prefix, category in _NAME_CATEGORY:
        if prefix in name:
            return category
    return FaultCategory.OTHER


def component_of(condition: dict) -> str | None:
    """The part suspected first: the GPU a condition names, the links of a link condition."""
    if condition.get("gpu_index") is not None:
        return f"GPU {condition['gpu_index']}"
    name = str(condition.get("name", ""))
    if "nvlink" in name:
        return "NVLink"
    if name.startswith("ib_"):
        return "InfiniBand port"
    if name.startswith("pcie"):
        return "PCIe link"
    if name.startswith("nic"):
        return "NIC"
    return None


_COMPONENT_CATEGORY = {"leaf_switch": FaultCategory.NETWORK}


def burst_category(component_kind: str, signals: Sequence[str]) -> FaultCategory:
    """A burst's category: a leaf switch's is the network's; a rack's or PDU's that of the signals
    its nodes showed, most common first (a power loss shows as lost GPUs, a faulty GPU's)."""
    if component_kind in _COMPONENT_CATEGORY:
        return _COMPONENT_CATEGORY[component_kind]
    found: dict[FaultCategory, int] = {}
    for signal in signals:
        xid = signal.removeprefix("xid_")
        condition: dict = {"xid": int(xid)} if signal.startswith("xid_") and xid.isdigit() else {"name": signal}
        category = category_of(condition)
        found[category] = found.get(category, 0) + 1
    return max(found, key=lambda c: found[c]) if found else FaultCategory.OTHER


def classify(conditions: Sequence[dict]) -> tuple[FaultCategory, str | None]:
    """The category and suspected component of the conditions that pulled the node: the first
    (the rules' worst) decides, unless it is the lemon rule, which only says the fault recurred."""
    if not conditions:
        return FaultCategory.OTHER, None
    faults = [c for c in conditions if c.get("name") != "lemon"] or list(conditions)
    first = faults[0]
    # Conditions as bad and as old as the first one, seen together: the more specific cause
    # explains the other (a NIC's fatal error takes its port's link down with it).
    tied = [c for c in faults if (c.get("action"), c.get("since")) == (first.get("action"), first.get("since"))]
    explains = _EXPLAINED_BY.get(category_of(first), ())
    first = next((c for c in tied if category_of(c) in explains), first)
    return category_of(first), component_of(first)


# A category a more specific one explains when both show at once.
_EXPLAINED_BY: dict[FaultCategory, tuple[FaultCategory, ...]] = {FaultCategory.NETWORK: (FaultCategory.NIC,)}
