"""Pulling a bad node out, decided once: what kind of pull the health rules' worst action asks
for, whether it waits for the tenant's checkpoint, and the typed decision that carries it out
(`services.pulls.carry_out`).

The health service decides as it judges a node (from its verdict); the reconciler decides again
from the conditions stored on the node (so a lost signal is sent again). Both read the same rule
here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from gpucloud.health.verdict import Action, action_rank, worst_action
from gpucloud.models.node_states import NodeState


class PullKind(StrEnum):
    NONE = "none"
    # The node's allocation holds it: its workflow replaces it inside the allocation.
    REPLACE = "replace"
    # No allocation holds it: the reconciler drains it out of the pool.
    DRAIN = "drain"


# A node its allocation holds: pulled by the allocation's workflow, which replaces it. One still
# reserved or provisioning is pulled too, before the tenant is handed a node known to be bad.
HELD = frozenset({NodeState.ACTIVE, NodeState.RESERVED, NodeState.PROVISIONING})


@dataclass(frozen=True)
class PullDecision:
    node_id: str
    kind: PullKind
    allocation_id: str | None = None
    reason: str = ""
    immediate: bool = False  # the fault is already fatal to the job: no grace period
    fault_at: datetime | None = None  # when the fault happened, as its node reported it
    # When the pulling condition began, as the rules judged it (stored on the node, so the API's
    # pull and the reconciler's re-sent one read the same): the incident's key.
    since: datetime | None = None

    @property
    def detected_at(self) -> datetime | None:
        """The first fault: the earlier of the reported fault and the condition's start."""
        known = [t for t in (self.fault_at, self.since) if t is not None]
        return min(known) if known else None


def pulls(action: Action) -> bool:
    """Whether the action takes the node out (drain, drain now, RMA)."""
    return action_rank(action) >= action_rank(Action.DRAIN)


def replace_at_once(state: NodeState, action: Action) -> bool:
    """A node the tenant's job has not started on leaves nothing to checkpoint; a fault that is
    already fatal to the job leaves nothing to wait for."""
    return state != NodeState.ACTIVE or action_rank(action) >= action_rank(Action.DRAIN_NOW)


def pulling_since(conditions: Iterable[dict | object]) -> datetime | None:
    """When the earliest of the conditions that take the node out began (conditions as stored on
    a node, or `health.verdict.Condition`s); None without one."""
    found: list[datetime] = []
    for c in conditions:
        action = c.get("action") if isinstance(c, dict) else getattr(c, "action", None)
        since = c.get("since") if isinstance(c, dict) else getattr(c, "since", None)
        if action not in set(Action) or not pulls(Action(action)) or since is None:
            continue
        found.append(since if isinstance(since, datetime) else datetime.fromisoformat(str(since)))
    return min(found) if found else None


def stored_action(conditions: Iterable[dict]) -> Action:
    """The worst action among conditions as stored on a node (`Node.health_conditions`)."""
    known = set(Action)
    return worst_action(Action(c["action"]) for c in conditions if c.get("action") in known)
