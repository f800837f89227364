"""Quotas: how many GPUs of a type a tenant may hold in a region, checked when it allocates.

Usage is counted, not kept: the GPUs of the tenant's live (not released, not failed)
allocations of that type in that region, so no counter can drift. Admission first locks the
tenant's row (`SELECT ... FOR UPDATE` on Postgres; SQLite's `BEGIN IMMEDIATE` already lets one
writer in at a time) and only then counts. Two concurrent creates of one tenant therefore run
one after the other: under Postgres' READ COMMITTED the second's count, a new statement after
the first committed, includes the first's allocation. Offboarding takes the same lock when it
moves the tenant out of `active`, so no allocation slips in behind it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.models.catalog import GPU_TYPES
from gpucloud.models.tables import (
    TERMINAL_ALLOCATION,
    Allocation,
    Tenant,
    TenantQuota,
    TenantQuotaBase,
    TenantStatus,
)

ANY = "*"


@dataclass(frozen=True)
class Limit:
    gpu_type: str
    region: str
    max_gpus: int
    source: str  # "tenant" (a quota row) or "default" (the control plane's default)


class QuotaExceeded(Exception):
    def __init__(self, limit: Limit, *, gpu_type: str, region: str, usage_gpus: int, requested_gpus: int) -> None:
        super().__init__(
            f"quota for {gpu_type} GPUs in {region} ({limit.gpu_type}/{limit.region}, {limit.source}) is "
            f"{limit.max_gpus}; {usage_gpus} in use, {requested_gpus} requested"
        )
        self.limit, self.gpu_type, self.region = limit, gpu_type, region
        self.usage_gpus, self.requested_gpus = usage_gpus, requested_gpus


class TenantNotActive(Exception):
    def __init__(self, tenant_id: str, status: str | None) -> None:
        super().__init__(f"tenant {tenant_id} is {status or 'unknown'}; only an active tenant allocates")
        self.status = status


def _specificity(row: TenantQuotaBase, gpu_type: str, region: str) -> int | None:
    if row.gpu_type not in (gpu_type, ANY) or row.region not in (region, ANY):
        return None
    return 2 * (row.gpu_type != ANY) + (row.region != ANY)


def effective_limit(rows: Sequence[TenantQuotaBase], *, gpu_type: str, region: str, default_gpus: int) -> Limit:
    """The most specific matching row (exact type beats exact region beats `*`), else the default."""
    ranked = [(rank, row) for row in rows if (rank := _specificity(row, gpu_type, region)) is not None]
    if not ranked:
        return Limit(gpu_type=ANY, region=ANY, max_gpus=default_gpus, source="default")
    _, row = max(ranked, key=lambda item: item[0])
    return Limit(gpu_type=row.gpu_type, region=row.region, max_gpus=row.max_gpus, source="tenant")


def _live(query, tenant_id: str):
    return query.where(
        col(Allocation.tenant_id) == tenant_id, col(Allocation.status).not_in([s.value for s in TERMINAL_ALLOCATION])
    )


def usage_gpus(session: Session, tenant_id: str, *, gpu_type: str, region: str) -> int:
    nodes = session.exec(
        _live(select(sa.func.coalesce(sa.func.sum(col(Allocation.node_count)), 0)), tenant_id).where(
            col(Allocation.gpu_type) == gpu_type, col(Allocation.region) == region
        )
    ).one()
    return int(nodes) * GPU_TYPES.get(gpu_type, 0)


def quota_rows(session: Session, tenant_id: str) -> list[TenantQuota]:
    return list(
        session.exec(
            select(TenantQuota)
            .where(col(TenantQuota.tenant_id) == tenant_id)
            .order_by(col(TenantQuota.gpu_type), col(TenantQuota.region))
        ).all()
    )


def admit(session: Session, tenant_id: str, *, gpu_type: str, region: str, node_count: int, default_gpus: int) -> None:
    """Raise unless the tenant is active and `node_count` more nodes fit its quota. Call inside
    the transaction that creates the allocation: the row lock it takes lasts until the commit."""
    status = session.exec(select(col(Tenant.status)).where(col(Tenant.id) == tenant_id).with_for_update()).first()
    if status != TenantStatus.ACTIVE:
        raise TenantNotActive(tenant_id, status)
    limit = effective_limit(quota_rows(session, tenant_id), gpu_type=gpu_type, region=region, default_gpus=default_gpus)
    used = usage_gpus(session, tenant_id, gpu_type=gpu_type, region=region)
    requested = node_count * GPU_TYPES[gpu_type]
    if used + requested > limit.max_gpus:
        raise QuotaExceeded(limit, gpu_type=gpu_type, region=region, usage_gpus=used, requested_gpus=requested)


def replace_quotas(session: Session, tenant_id: str, quotas: list[TenantQuotaBase]) -> list[TenantQuota]:
    """The tenant's quotas become exactly `quotas` (lowering one below usage blocks new
    allocations only; nothing running is taken away)."""
    session.execute(sa.delete(TenantQuota).where(col(TenantQuota.tenant_id) == tenant_id))
    rows = [TenantQuota(tenant_id=tenant_id, gpu_type=q.gpu_type, region=q.region, max_gpus=q.max_gpus) for q in quotas]
    session.add_all(rows)
    session.flush()
    return rows


@dataclass(frozen=True)
class Usage:
    gpu_type: str
    region: str
    usage_gpus: int
    limit: Limit


def usage_report(session: Session, tenant_id: str, *, default_gpus: int) -> list[Usage]:
    """Each type and region the tenant holds GPUs in, with the limit that applies there."""
    held: dict[tuple[str, str], int] = defaultdict(int)
    rows = session.exec(
        _live(select(col(Allocation.gpu_type), col(Allocation.region), col(Allocation.node_count)), tenant_id)
    ).all()
    for gpu_type, region, nodes in rows:
        held[(gpu_type, region)] += nodes * GPU_TYPES.get(gpu_type, 0)
    quotas = quota_rows(session, tenant_id)
    return [
        Usage(
            gpu_type=t,
            region=r,
            usage_gpus=used,
            limit=effective_limit(quotas, gpu_type=t, region=r, default_gpus=default_gpus),
        )
        for (t, r), used in sorted(held.items())
    ]
