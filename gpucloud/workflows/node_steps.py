"""What each node operation does in each state (`NodeOperationWorkflow`, and the bring-up
batches, which take the bring-up's steps a round at a time): a table, passed through Temporal's
sandbox. A workflow's own module runs anew for every workflow instance the sandbox starts or
replays; these two frozen dataclasses built there cost more than the rest of the module.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.activities.host_agent import HostAgentActivities
from gpucloud.models.messages import NodeOperationKind
from gpucloud.models.node_states import NodeEvent, NodeState
from gpucloud.protocol.actions import AgentAction

Op, S, E, A = NodeOperationKind, NodeState, NodeEvent, AgentAction


@dataclass(frozen=True)
class Move:
    event: NodeEvent


@dataclass(frozen=True)
class Act:
    action: AgentAction  # success -> OK, permanent failure -> FAIL
    # Agent actions to run first. A node reaches wiping from failure paths too (a provisioning
    # failure or deadline skips releasing), so a wipe first makes sure nothing still runs.
    before: tuple[AgentAction, ...] = ()


WIPE = Act(A.WIPE, before=(A.RELEASE,))

# The agent action behind each name, called by reference.
AGENT_ACTIONS = {
    A.INSPECT: HostAgentActivities.inspect_node,
    A.BURN_IN: HostAgentActivities.burn_in_node,
    A.PROVISION: HostAgentActivities.provision_node,
    A.RELEASE: HostAgentActivities.release_node,
    A.WIPE: HostAgentActivities.wipe_node,
    A.RESET: HostAgentActivities.reset_node,
    A.REBOOT: HostAgentActivities.reboot_node,
    A.REFLASH: HostAgentActivities.reflash_node,
    A.DIAGNOSE: HostAgentActivities.diagnose_node,
}


# What each state calls for, per operation. A state missing here for an operation is one that
# operation may not touch: the workflow stops and reports it rather than guessing.
STEPS: dict[NodeOperationKind, dict[NodeState, Move | Act]] = {
    # A node's first wipe: nothing of a tenant's runs there yet, so no release first.
    Op.BRINGUP: {
        S.ENROLLED: Move(E.INSPECT),
        S.INSPECTING: Act(A.INSPECT),
        S.WIPING: Act(A.WIPE),
        S.BURN_IN: Act(A.BURN_IN),
    },
    Op.PROVISION: {
        S.RESERVED: Move(E.PROVISION),
        S.PROVISIONING: Act(A.PROVISION),
        # A failed provision leaves the node wiping: finish its way back to the pool.
        S.WIPING: WIPE,
        S.BURN_IN: Act(A.BURN_IN),
    },
    Op.RELEASE: {S.RESERVED: Move(E.UNRESERVE), S.ACTIVE: Move(E.RELEASE), S.RELEASING: Act(A.RELEASE)},
    Op.RECYCLE: {S.WIPING: WIPE, S.BURN_IN: Act(A.BURN_IN)},
    Op.DRAIN: {S.AVAILABLE: Move(E.DRAIN), S.ACTIVE: Move(E.DRAIN), S.DRAINING: Act(A.RELEASE)},
    # After its rung of the repair ladder (`NodeOperationWorkflow._repair_rung`).
    Op.REPAIR: {S.WIPING: WIPE, S.BURN_IN: Act(A.BURN_IN)},
}

SUCCESS: dict[NodeOperationKind, frozenset[NodeState]] = {
    Op.BRINGUP: frozenset({S.AVAILABLE}),
    Op.PROVISION: frozenset({S.ACTIVE}),
    # Once the node is wiping (or later) the tenant is off it; available = unreserved untouched.
    Op.RELEASE: frozenset({S.WIPING, S.BURN_IN, S.AVAILABLE, S.QUARANTINED}),
    Op.RECYCLE: frozenset({S.AVAILABLE}),
    Op.DRAIN: frozenset({S.QUARANTINED}),
    Op.REPAIR: frozenset({S.AVAILABLE}),
}
