"""Recovery: every resource the DB says is in flight gets its workflow back.

The API commits a resource first and starts its workflow second; a crash in between (or a
Temporal server that lost its state) would leave it orphaned. The worker resumes everything at
start-up (`resume_orphans`), and every full sweep of the reconciler adopts what has no running
workflow (`adopt_orphans`). Starting with the `USE_EXISTING` conflict policy makes both
idempotent: a workflow that is running is left alone.
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from sqlmodel import col, select
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from gpucloud.adapters.temporal_gateway import (
    running_workflow_ids,
    start_allocation_workflow,
    start_bringup_batches,
    start_node_operation,
    start_tenant_offboarding,
    start_tenant_onboarding,
    start_version_evaluation,
)
from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.models import workflow_ids as ids
from gpucloud.models.messages import NodeOperationInput, NodeOperationKind
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import TERMINAL_ALLOCATION, Allocation, Node, Operation, OperationStatus, utcnow
from gpucloud.models.workflow_ids import (
    allocation_workflow_id,
    evaluation_workflow_id,
    node_workflow_id,
    offboarding_workflow_id,
    onboarding_workflow_id,
)
from gpucloud.services import tenants as tenant_service
from gpucloud.services.evaluations import OPERATION_PREFIX as EVALUATION_OPERATION_PREFIX
from gpucloud.services.evaluations import evaluation_input_for
from gpucloud.services.nodes import lease_for_bringup
from gpucloud.services.operations import settle


async def resume_orphans(client: Client, db: Database, settings: Settings) -> dict[str, int]:
    with db.session() as session:
        allocations = session.exec(
            select(Allocation).where(col(Allocation.status).not_in([s.value for s in TERMINAL_ALLOCATION]))
        ).all()
        enrolled = list(session.exec(select(col(Node.id)).where(col(Node.state) == NodeState.ENROLLED)).all())
        # Nodes a live batch holds are skipped; a hold whose batch was lost runs out on its own.
        enrolled = lease_for_bringup(session, enrolled, deadline_scale=settings.reconciler.deadline_scale)
        tenant_ops = session.exec(
            select(col(Operation.resource_id), col(Operation.id), col(Operation.kind)).where(
                col(Operation.kind).in_([tenant_service.CREATE_OPERATION, tenant_service.DELETE_OPERATION]),
                col(Operation.status) == OperationStatus.RUNNING,
            )
        ).all()
    for alloc in allocations:
        await start_allocation_workflow(client, settings, alloc, conflict=WorkflowIDConflictPolicy.USE_EXISTING)
    await start_bringup_batches(client, settings, enrolled)
    for tenant_id, operation_id, kind in tenant_ops:
        start = start_tenant_onboarding if kind == tenant_service.CREATE_OPERATION else start_tenant_offboarding
        await start(client, settings, tenant_id, operation_id)
    return {"allocations": len(allocations), "enrolled_nodes": len(enrolled), "tenants": len(tenant_ops)}


# What adoption looks for: the workflows of in-flight allocations, tenant operations and version
# evaluations.
_ADOPTED_TYPES = (
    ids.ALLOCATION_WORKFLOW,
    ids.TENANT_ONBOARDING_WORKFLOW,
    ids.TENANT_OFFBOARDING_WORKFLOW,
    ids.VERSION_EVALUATION_WORKFLOW,
    ids.NODE_OPERATION_WORKFLOW,
)

# A node on its way back to the pool whose operation was lost: the operation that finishes the
# job. Wiping and burn-in are the node's own (`RECYCLE`); a node still reserved or releasing for
# an allocation that has ended is let go (`RELEASE`: unreserve, or release then wipe).
_NODE_ORPHANS = {
    NodeState.WIPING: NodeOperationKind.RECYCLE,
    NodeState.BURN_IN: NodeOperationKind.RECYCLE,
    NodeState.RESERVED: NodeOperationKind.RELEASE,
    NodeState.RELEASING: NodeOperationKind.RELEASE,
}


async def adopt_orphans(
    client: Client, db: Database, settings: Settings, *, older_than: timedelta = timedelta(seconds=30)
) -> int:
    """Start the workflow of every in-flight allocation and tenant operation (older than
    `older_than`, so a create between its commit and its start is left to the API) that has no
    running workflow; how many were started. One visibility query, then one start per orphan."""
    cutoff = utcnow() - older_than
    with db.session() as session:
        allocations = session.exec(
            select(Allocation).where(
                col(Allocation.status).not_in([s.value for s in TERMINAL_ALLOCATION]),
                col(Allocation.created_at) < cutoff,
            )
        ).all()
        tenant_ops = session.exec(
            select(col(Operation.resource_id), col(Operation.id), col(Operation.kind)).where(
                col(Operation.kind).in_([tenant_service.CREATE_OPERATION, tenant_service.DELETE_OPERATION]),
                col(Operation.status) == OperationStatus.RUNNING,
                col(Operation.created_at) < cutoff,
            )
        ).all()
        evaluations = [
            (
                evaluation_workflow_id(op.tenant_id or "", op.id),
                evaluation_input_for(session, op.tenant_id or "", op.resource_id, op.kind, op.id),
                op.id,
            )
            for op in session.exec(
                select(Operation).where(
                    col(Operation.kind).startswith(EVALUATION_OPERATION_PREFIX),
                    col(Operation.status) == OperationStatus.RUNNING,
                    col(Operation.created_at) < cutoff,
                )
            )
        ]
        nodes = _orphan_node_candidates(session, cutoff)
    if not allocations and not tenant_ops and not evaluations and not nodes:
        return 0
    running = await running_workflow_ids(client, _ADOPTED_TYPES)
    adopted = await _adopt_nodes(client, settings, nodes, running)
    for alloc in allocations:
        if allocation_workflow_id(alloc.id) not in running:
            await start_allocation_workflow(client, settings, alloc, conflict=WorkflowIDConflictPolicy.USE_EXISTING)
            adopted += 1
    for tenant_id, operation_id, kind in tenant_ops:
        onboarding = kind == tenant_service.CREATE_OPERATION
        workflow_id = onboarding_workflow_id(tenant_id) if onboarding else offboarding_workflow_id(tenant_id)
        if workflow_id not in running:
            start = start_tenant_onboarding if onboarding else start_tenant_offboarding
            await start(client, settings, tenant_id, operation_id)
            adopted += 1
    for workflow_id, evaluation, operation_id in evaluations:
        if workflow_id in running:
            continue
        if evaluation is None:  # its version or model was deleted since
            settle(db, operation_id, error="the version or its model no longer exists")
            continue
        await start_version_evaluation(client, settings, evaluation)
        adopted += 1
    return adopted


def _orphan_node_candidates(session, cutoff) -> list[tuple[str, NodeState, str | None, str | None]]:
    """Nodes in a state some operation must finish, there since before `cutoff`, that no
    bring-up batch holds (its hold is `next_reconcile_at` in the future) and whose allocation, if
    any, has ended: (node, state, allocation, tenant)."""
    now = utcnow()
    rows = session.exec(
        select(Node, Allocation.status)
        .join(Allocation, col(Allocation.id) == col(Node.allocation_id), isouter=True)
        .where(
            col(Node.state).in_([s.value for s in _NODE_ORPHANS]),
            col(Node.state_entered_at) < cutoff,
            sa.or_(col(Node.next_reconcile_at).is_(None), col(Node.next_reconcile_at) <= now),
        )
    ).all()
    terminal = {s.value for s in TERMINAL_ALLOCATION}
    found = []
    for node, allocation_status in rows:
        state = NodeState(node.state)
        held_by_allocation = node.allocation_id is not None and allocation_status not in terminal
        if held_by_allocation:
            continue  # the allocation's workflow (adopted above if lost) owns it
        if state in (NodeState.RESERVED, NodeState.RELEASING) and node.allocation_id is None:
            continue
        found.append((node.id, state, node.allocation_id, node.tenant_id))
    return found


async def _adopt_nodes(
    client: Client, settings: Settings, nodes: list[tuple[str, NodeState, str | None, str | None]], running: set[str]
) -> int:
    """Start the operation that finishes each orphaned node's way back to the pool. A node's
    operations are single-flight (one workflow id per node), so one started meanwhile wins."""
    adopted = 0
    for node_id, state, allocation_id, tenant_id in nodes:
        if node_workflow_id(node_id) in running:
            continue
        operation = _NODE_ORPHANS[state]
        try:
            await start_node_operation(
                client,
                settings,
                NodeOperationInput(
                    node_id=node_id,
                    operation=operation,
                    allocation_id=allocation_id if operation == NodeOperationKind.RELEASE else None,
                    tenant_id=tenant_id,
                ),
            )
        except WorkflowAlreadyStartedError:
            continue
        adopted += 1
    return adopted
