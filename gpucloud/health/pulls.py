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


def pulls(action: Action) -> bool:
    """Whether the action takes the node out (drain, drain now, RMA)."""
    return action_rank(action) >= action_rank(Action.DRAIN)


def replace_at_once(state: NodeState, action: Action) -> bool:
    """A node the tenant's job has not started on leaves nothing to checkpoint; a fault that is
    already fatal to the job leaves nothing to wait for."""
    return state != NodeState.ACTIVE or action_rank(action) >= action_rank(Action.DRAIN_NOW)


def stored_action(conditions: Iterable[dict]) -> Action:
    """The worst action among conditions as stored on a node (`Node.health_conditions`)."""
    known = set(Action)
    return worst_action(Action(c["action"]) for c in conditions if c.get("action") in known)
