"""Quotas: how many GPUs of a type a tenant may hold in a region, checked when it allocates.

A tenant may hold exactly what an operator granted: a quota row for the type and region, or a
row with `*` for either that the operator wrote. Nothing is implicit: a type and region no row
matches may not be allocated (`NoQuotaGranted`), so a cap on one type never leaves the others
open.

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
    QUOTA_ANY,
    TERMINAL_ALLOCATION,
    Allocation,
    Tenant,
    TenantQuota,
    TenantQuotaBase,
    TenantStatus,
)
from gpucloud.services.errors import Conflict, DomainError
from gpucloud.services.errors import QuotaExceeded as QuotaExceededError

ANY = QUOTA_ANY


# What an operator runs to grant a quota (`gpucloud/cli/catalog.py`); refusals name it.
GRANT_COMMAND = "gpucloud tenants quota {tenant_id} {gpu_type}:{region}=GPUS"


@dataclass(frozen=True)
class Limit:
    """The granted quota row that applies to a type and region."""

    gpu_type: str
    region: str
    max_gpus: int


def nodes_and_gpus(gpus: int, gpus_per_node: int) -> str:
    """`2 nodes (16 GPUs)`: tenants ask in nodes and quotas count GPUs, so refusals say both."""
    nodes = gpus // gpus_per_node if gpus_per_node else 0
    return f"{nodes} node{'' if nodes == 1 else 's'} ({gpus} GPU{'' if gpus == 1 else 's'})"


class QuotaExceeded(Exception):
    def __init__(
        self, limit: Limit, *, gpu_type: str, region: str, usage_gpus: int, requested_gpus: int, gpus_per_node: int
    ) -> None:
        self.limit, self.gpu_type, self.region = limit, gpu_type, region
        self.usage_gpus, self.requested_gpus, self.gpus_per_node = usage_gpus, requested_gpus, gpus_per_node
        self.left_gpus = max(0, limit.max_gpus - usage_gpus)
        super().__init__(
            f"{nodes_and_gpus(requested_gpus, gpus_per_node)} of {gpu_type} requested in {region}; the quota "
            f"({limit.gpu_type}/{limit.region}) is {limit.max_gpus} GPUs, {nodes_and_gpus(usage_gpus, gpus_per_node)} "
            f"in use, {nodes_and_gpus(self.left_gpus, gpus_per_node)} left: ask for fewer nodes, release an "
            "allocation, or ask an operator for more"
        )


class NoQuotaGranted(Exception):
    """No quota row matches the type and region: the tenant may not allocate there at all."""

    def __init__(self, tenant_id: str, *, gpu_type: str, region: str, granted: Sequence[TenantQuotaBase]) -> None:
        self.tenant_id, self.gpu_type, self.region = tenant_id, gpu_type, region
        self.granted = [Limit(gpu_type=q.gpu_type, region=q.region, max_gpus=q.max_gpus) for q in granted]
        held = ", ".join(f"{q.gpu_type}/{q.region}: {q.max_gpus} GPUs" for q in self.granted) or "none"
        command = GRANT_COMMAND.format(tenant_id=tenant_id, gpu_type=gpu_type, region=region)
        super().__init__(
            f"no quota is granted for {gpu_type} in {region} (granted: {held}); an operator grants one with `{command}`"
        )


class TenantNotActive(Exception):
    def __init__(self, tenant_id: str, status: str | None) -> None:
        super().__init__(f"tenant {tenant_id} is {status or 'unknown'}; only an active tenant allocates")
        self.status = status


def _specificity(row: TenantQuotaBase, gpu_type: str, region: str) -> int | None:
    if row.gpu_type not in (gpu_type, ANY) or row.region not in (region, ANY):
        return None
    return 2 * (row.gpu_type != ANY) + (row.region != ANY)


def effective_limit(rows: Sequence[TenantQuotaBase], *, gpu_type: str, region: str) -> Limit | None:
    """The most specific matching row (exact type beats exact region beats `*`), or None where
    no row matches: nothing is granted there."""
    ranked = [(rank, row) for row in rows if (rank := _specificity(row, gpu_type, region)) is not None]
    if not ranked:
        return None
    _, row = max(ranked, key=lambda item: item[0])
    return Limit(gpu_type=row.gpu_type, region=row.region, max_gpus=row.max_gpus)


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


def admit(
    session: Session, tenant_id: str, *, gpu_type: str, region: str, node_count: int, beside_usage: bool = True
) -> None:
    """Raise unless the tenant is active, holds a quota for the type and region, and
    `node_count` more nodes fit it (beside what it holds now; `beside_usage=False`: alone, as for
    a capacity reservation's future window). Call inside the transaction that creates the
    allocation: the row lock it takes lasts until the commit."""
    status = session.exec(select(col(Tenant.status)).where(col(Tenant.id) == tenant_id).with_for_update()).first()
    if status != TenantStatus.ACTIVE:
        raise TenantNotActive(tenant_id, status)
    rows = quota_rows(session, tenant_id)
    limit = effective_limit(rows, gpu_type=gpu_type, region=region)
    if limit is None:
        raise NoQuotaGranted(tenant_id, gpu_type=gpu_type, region=region, granted=rows)
    used = usage_gpus(session, tenant_id, gpu_type=gpu_type, region=region) if beside_usage else 0
    per_node = GPU_TYPES[gpu_type]
    requested = node_count * per_node
    if used + requested > limit.max_gpus:
        raise QuotaExceeded(
            limit, gpu_type=gpu_type, region=region, usage_gpus=used, requested_gpus=requested, gpus_per_node=per_node
        )


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
    usage_nodes: int
    usage_gpus: int
    limit: Limit | None  # None: held, though no quota is granted there now (an operator removed it)


def usage_report(session: Session, tenant_id: str) -> list[Usage]:
    """Each type and region the tenant holds nodes in, with the limit that applies there."""
    held: dict[tuple[str, str], int] = defaultdict(int)
    rows = session.exec(
        _live(select(col(Allocation.gpu_type), col(Allocation.region), col(Allocation.node_count)), tenant_id)
    ).all()
    for gpu_type, region, nodes in rows:
        held[(gpu_type, region)] += nodes
    quotas = quota_rows(session, tenant_id)
    return [
        Usage(
            gpu_type=t,
            region=r,
            usage_nodes=nodes,
            usage_gpus=nodes * GPU_TYPES.get(t, 0),
            limit=effective_limit(quotas, gpu_type=t, region=r),
        )
        for (t, r), nodes in sorted(held.items())
    ]


def refusal(exc: TenantNotActive | NoQuotaGranted | QuotaExceeded) -> DomainError:
    """The domain error (and so the problem document) for an admission `admit` refused."""
    if isinstance(exc, TenantNotActive):
        return Conflict(str(exc), type_="tenant-not-active", title="Tenant is not active", tenant_status=exc.status)
    if isinstance(exc, NoQuotaGranted):
        granted = [vars(limit) for limit in exc.granted]
        return Conflict(str(exc), type_="quota-not-granted", title="No quota granted", granted=granted)
    return QuotaExceededError(
        str(exc),
        quota=vars(exc.limit),
        gpus_per_node=exc.gpus_per_node,
        usage_gpus=exc.usage_gpus,
        requested_gpus=exc.requested_gpus,
        left_gpus=exc.left_gpus,
    )


REFUSED = (TenantNotActive, NoQuotaGranted, QuotaExceeded)
