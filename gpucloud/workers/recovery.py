"""Start-up recovery: every resource the DB says is in flight gets its workflow back.

The API commits a resource first and starts its workflow second; a crash in between (or a
Temporal server that lost its state) would leave it orphaned. Starting with the `USE_EXISTING`
conflict policy makes this idempotent: a workflow that is running is left alone.
"""

from __future__ import annotations

from sqlmodel import select
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import TERMINAL_ALLOCATION, Allocation, Node
from gpucloud.services.workflows import start_allocation_workflow, start_bringup


async def resume_orphans(client: Client, settings: Settings) -> dict[str, int]:
    with session_scope(settings.db_url) as session:
        allocations = session.exec(
            select(Allocation).where(Allocation.status.not_in([s.value for s in TERMINAL_ALLOCATION]))
        ).all()
        enrolled = session.exec(select(Node.id).where(Node.state == NodeState.ENROLLED)).all()
    for alloc in allocations:
        await start_allocation_workflow(client, settings, alloc,
                                        conflict=WorkflowIDConflictPolicy.USE_EXISTING)
    for node_id in enrolled:
        await start_bringup(client, settings, node_id)
    return {"allocations": len(allocations), "enrolled_nodes": len(enrolled)}
