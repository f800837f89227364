"""Activities over the control-plane database: node transitions and allocation status.

Each is one short transaction. Errors are classified here, at the edge: a node that is not where
the workflow expected (StaleNode) or does not exist is permanent (non-retryable); a locked or
unreachable database is transient and retried by Temporal.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import col, select
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup, view_of
from gpucloud.db import Database
from gpucloud.models.messages import (
    AllocationEventInput,
    AllocationInput,
    AllocationStatusInput,
    AllocationView,
    AttachNodeInput,
    DetachNodesInput,
    DetachNodesResult,
    NodeRef,
    NodeRefs,
    NodeTransitionBatch,
    NodeTransitionBatchResult,
    NodeTransitionInput,
    NodeTransitionOutcome,
    NodeTransitionResult,
    NodeView,
    NodeViews,
    RepairPlan,
    ReplacementInput,
    ReplacementResult,
)
from gpucloud.models.node_states import InvalidTransition, NodeState
from gpucloud.models.tables import Allocation, AllocationStatus, Node, utcnow
from gpucloud.protocol.actions import REPAIR_LADDER, Workload
from gpucloud.services import allocations as allocation_service
from gpucloud.services import health as health_service
from gpucloud.services import nodes as node_service
from gpucloud.services import replacement
from gpucloud.web import metrics


class ControlDbActivities(ActivityGroup):
    def __init__(
        self, db: Database, *, deadline_scale: float = 1.0, backoff_base_s: float = 5.0, backoff_cap_s: float = 600.0
    ) -> None:
        self.db = db
        self.deadline_scale = deadline_scale
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s

    @activity.defn
    def transition_node(self, req: NodeTransitionInput) -> NodeTransitionResult:
        changes: dict[str, Any] = {}
        if req.tenant_id is not None:
            changes["tenant_id"] = req.tenant_id
        try:
            with self.db.session() as session:
                before = session.get(Node, req.node_id)
                moves = before is not None and before.state == req.from_state  # not a retry's replay
                node = node_service.transition(
                    session,
                    req.node_id,
                    req.event,
                    from_state=req.from_state,
                    op_id=req.op_id,
                    cause=req.cause,
                    actor=req.actor,
                    deadline_scale=self.deadline_scale,
                    **changes,
                )
                if moves and node.state == NodeState.PROVISIONING and node.allocation_id is not None:
                    allocation_service.record_node_provisioning(session, node.allocation_id, node.id)
                return NodeTransitionResult(node_id=node.id, state=node.state, generation=node.generation)
        except (node_service.StaleNode, node_service.NodeNotFound, InvalidTransition) as exc:
            raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc

    @activity.defn
    def transition_nodes(self, req: NodeTransitionBatch) -> NodeTransitionBatchResult:
        """Many nodes' steps in one transaction (a bring-up batch): the same compare-and-swap as
        `transition_node`, idempotent per op_id, in a few statements (`nodes.transition_many`).
        A step that does not apply (the node moved, or is gone) is reported for that node and
        does not stop the others."""
        with self.db.session() as session:
            outcomes = node_service.transition_many(
                session, req.items, deadline_scale=self.deadline_scale, lease_to_deadline=req.lease_to_deadline
            )
        return NodeTransitionBatchResult(
            outcomes=[
                NodeTransitionOutcome(node_id=node_id, state=state, error=error) for node_id, state, error in outcomes
            ]
        )

    @activity.defn
    def release_bringup_holds(self, req: NodeRefs) -> int:
        """A batch lets go of nodes it could not finish (agent silent): the reconciler takes
        them back after its per-node backoff, which grows with every attempt."""
        with self.db.session() as session:
            return node_service.release_bringup_holds(
                session, req.node_ids, base_s=self.backoff_base_s, cap_s=self.backoff_cap_s
            )

    @activity.defn
    def get_nodes(self, req: NodeRefs) -> NodeViews:
        """The nodes that exist among `node_ids`, in the order asked."""
        with self.db.session() as session:
            found = {n.id: n for n in session.exec(select(Node).where(col(Node.id).in_(req.node_ids))).all()}
            return NodeViews(nodes=[_view(found[i]) for i in req.node_ids if i in found])

    @activity.defn
    def get_node(self, req: NodeRef) -> NodeView:
        with self.db.session() as session:
            return _view(self._node(session, req.node_id))

    @activity.defn
    def load_allocation(self, req: AllocationInput) -> AllocationView:
        with self.db.session() as session:
            alloc = session.exec(select(Allocation).where(col(Allocation.id) == req.allocation_id)).first()
            if alloc is None:
                raise ApplicationError(
                    f"allocation {req.allocation_id} does not exist", type="AllocationNotFound", non_retryable=True
                )
            return _allocation_view(alloc)

    @activity.defn
    def set_allocation_status(self, req: AllocationStatusInput) -> AllocationView:
        with self.db.session() as session:
            previous = session.exec(select(Allocation.status).where(col(Allocation.id) == req.allocation_id)).one()
            alloc = allocation_service.set_status(
                session, req.allocation_id, AllocationStatus(req.status), failure_reason=req.failure_reason
            )
            allocation_service.record_status_event(session, alloc, previous)
            return _allocation_view(alloc)

    # ------------------------------------------------------------ drain-and-replace

    @activity.defn
    def detach_nodes(self, req: DetachNodesInput) -> DetachNodesResult:
        """Reported nodes out of the allocation in one transaction; which were pulled (see
        `replacement.detach_nodes`: a retry answers what the first try did)."""
        with self.db.session() as session:
            alloc, pulled = replacement.detach_nodes(
                session, req.allocation_id, [(n.node_id, n.reason) for n in req.nodes]
            )
            view = _allocation_view(alloc)
        now = utcnow()
        for node in req.nodes:
            if node.node_id in pulled and node.fault_at is not None:
                metrics.FAULT_TO_PULLED.observe(max(0.0, (now - node.fault_at).total_seconds()))
        return DetachNodesResult(pulled=pulled, allocation=view)

    @activity.defn
    def reserve_replacement(self, req: ReplacementInput) -> ReplacementResult:
        with self.db.session() as session:
            node_id, reason = replacement.reserve_replacement(
                session, req.allocation_id, deadline_scale=self.deadline_scale, exclude=frozenset(req.exclude)
            )
            return ReplacementResult(node_id=node_id, reason=reason)

    @activity.defn
    def attach_node(self, req: AttachNodeInput) -> AllocationView:
        with self.db.session() as session:
            return _allocation_view(
                replacement.attach_node(session, req.allocation_id, req.node_id, replaces=req.replaces, ready=req.ready)
            )

    @activity.defn
    def record_allocation_event(self, req: AllocationEventInput) -> None:
        with self.db.session() as session:
            alloc = session.exec(select(Allocation).where(col(Allocation.id) == req.allocation_id)).one()
            allocation_service.record_event(session, alloc, req.kind, reason=req.reason, node_id=req.node_id)

    @activity.defn
    def plan_repair(self, req: NodeRef) -> RepairPlan:
        with self.db.session() as session:
            self._node(session, req.node_id)
            step = health_service.repair_plan(session, req.node_id)
            actions = [] if step.rung is None else list(REPAIR_LADDER[step.rung :])
            return RepairPlan(node_id=req.node_id, actions=actions, reason=step.reason)

    @staticmethod
    def _node(session, node_id: str) -> Node:
        node = session.get(Node, node_id)
        if node is None:
            raise ApplicationError(f"node {node_id} does not exist", type="NodeNotFound", non_retryable=True)
        return node


def _allocation_view(alloc: Allocation) -> AllocationView:
    workload = Workload.model_validate(alloc.workload) if alloc.workload else None
    return view_of(AllocationView, alloc, allocation_id=alloc.id, node_ids=list(alloc.node_ids), workload=workload)


def _view(node: Node) -> NodeView:
    return view_of(NodeView, node, node_id=node.id)  # `has_bmc` is the row's property
