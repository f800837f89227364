"""Activities over the control-plane database: node transitions and allocation status.

Each is one short transaction. Errors are classified here, at the edge: a node that is not where
the workflow expected (StaleNode) or does not exist is permanent (non-retryable); a locked or
unreachable database is transient and retried by Temporal.
"""

from __future__ import annotations

from sqlmodel import select
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.db import session_scope
from gpucloud.models.messages import (
    AllocationInput,
    AllocationStatusInput,
    AllocationView,
    NodeRef,
    NodeTransitionInput,
    NodeTransitionResult,
    NodeView,
)
from gpucloud.models.node_states import InvalidTransition
from gpucloud.models.tables import Allocation, AllocationStatus, Node
from gpucloud.services import allocations as allocation_service
from gpucloud.services import nodes as node_service


class ControlDbActivities:
    def __init__(self, db_url: str, *, deadline_scale: float = 1.0) -> None:
        self.db_url = db_url
        self.deadline_scale = deadline_scale

    @activity.defn
    def transition_node(self, req: NodeTransitionInput) -> NodeTransitionResult:
        changes: dict[str, object] = {}
        if req.tenant_id is not None:
            changes["tenant_id"] = req.tenant_id
        try:
            with session_scope(self.db_url) as session:
                node = node_service.transition(
                    session, req.node_id, req.event, from_state=req.from_state, op_id=req.op_id,
                    cause=req.cause, actor=req.actor, deadline_scale=self.deadline_scale, **changes,
                )
                return NodeTransitionResult(node_id=node.id, state=node.state, generation=node.generation)
        except (node_service.StaleNode, node_service.NodeNotFound, InvalidTransition) as exc:
            raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc

    @activity.defn
    def get_node(self, req: NodeRef) -> NodeView:
        with session_scope(self.db_url) as session:
            return _view(self._node(session, req.node_id))

    @activity.defn
    def load_allocation(self, req: AllocationInput) -> AllocationView:
        with session_scope(self.db_url) as session:
            alloc = session.exec(select(Allocation).where(Allocation.id == req.allocation_id)).first()
            if alloc is None:
                raise ApplicationError(f"allocation {req.allocation_id} does not exist",
                                       type="AllocationNotFound", non_retryable=True)
            return AllocationView(allocation_id=alloc.id, tenant_id=alloc.tenant_id, status=alloc.status,
                                  desired=alloc.desired, node_ids=list(alloc.node_ids))

    @activity.defn
    def set_allocation_status(self, req: AllocationStatusInput) -> AllocationView:
        with session_scope(self.db_url) as session:
            alloc = allocation_service.set_status(session, req.allocation_id, AllocationStatus(req.status),
                                                  failure_reason=req.failure_reason)
            return AllocationView(allocation_id=alloc.id, tenant_id=alloc.tenant_id, status=alloc.status,
                                  desired=alloc.desired, node_ids=list(alloc.node_ids))

    @staticmethod
    def _node(session, node_id: str) -> Node:
        node = session.get(Node, node_id)
        if node is None:
            raise ApplicationError(f"node {node_id} does not exist", type="NodeNotFound", non_retryable=True)
        return node

    def all(self) -> list:
        return [self.transition_node, self.get_node, self.load_allocation,
                self.set_allocation_status]


def _view(node: Node) -> NodeView:
    return NodeView(node_id=node.id, state=node.state, generation=node.generation, agent_url=node.agent_url,
                    allocation_id=node.allocation_id, tenant_id=node.tenant_id)
