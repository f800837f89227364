"""The pools' queues (`services/scheduling.py`, docs/scheduling.md): the queued allocations with
their positions and estimated starts (a tenant sees its own), and the tenants' fair-share
weights per pool (operators)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool

from gpucloud.api.deps import CallerDep, DbDep, ReadOperatorDep, ReadsDep, TenantsOperatorDep
from gpucloud.models.api_schemas import PoolSharePublic, PoolShareRequest, PoolShares, QueueEntryPublic, QueuePage
from gpucloud.models.scheduling_tables import TenantPoolShare
from gpucloud.models.tables import Allocation
from gpucloud.services import scheduling

router = APIRouter(prefix="/v1", tags=["queue"])


def _entry(a: Allocation) -> QueueEntryPublic:
    return QueueEntryPublic(
        allocation_id=a.id,
        tenant_id=a.tenant_id,
        gpu_type=a.gpu_type,
        region=a.region,
        node_count=a.node_count,
        position=a.queue_position,
        estimated_start_at=a.estimated_start_at,
        queued_at=a.created_at,
        max_wait_s=a.max_wait_s,
        expected_duration_s=a.expected_duration_s,
    )


def _share(s: TenantPoolShare) -> PoolSharePublic:
    return PoolSharePublic(
        tenant_id=s.tenant_id, gpu_type=s.gpu_type, region=s.region, weight=s.weight, updated_at=s.updated_at
    )


@router.get("/queue", response_model=QueuePage)
def list_queue(
    caller: CallerDep,
    reads: ReadsDep,
    gpu_type: Annotated[str | None, Query(max_length=64, description="only this GPU type's pools")] = None,
    region: Annotated[str | None, Query(max_length=64, description="only this region's pools")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 1000,
) -> QueuePage:
    """Queued allocations by pool, in each pool's order (position 1 is placed first); a tenant's
    own only (positions still count everyone's requests ahead of them)."""
    scope = None if caller.is_operator else caller.tenant_id
    with reads() as session:
        rows = scheduling.queue_of(session, gpu_type, region, tenant_id=scope, limit=limit)
        return QueuePage(items=[_entry(a) for a in rows])


@router.get("/tenants/{tenant_id}/shares", response_model=PoolShares)
def list_shares(tenant_id: str, operator: ReadOperatorDep, reads: ReadsDep) -> PoolShares:
    """A tenant's fair-share weights (pools without one weigh 1)."""
    with reads() as session:
        return PoolShares(items=[_share(s) for s in scheduling.shares_of(session, tenant_id)])


@router.put("/tenants/{tenant_id}/shares", response_model=PoolSharePublic)
async def set_share(tenant_id: str, req: PoolShareRequest, operator: TenantsOperatorDep, db: DbDep) -> PoolSharePublic:
    """Set a tenant's fair-share weight in one pool."""

    def write() -> PoolSharePublic:
        with db.session() as session:
            return _share(scheduling.set_share(session, tenant_id, req.gpu_type, req.region, req.weight))

    return await run_in_threadpool(write)
