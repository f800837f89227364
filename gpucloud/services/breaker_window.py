"""The circuit breaker's window as the DB holds it (`services.health` asks the breaker with it;
a breaker trip's incident, `services.fleet_kind_incidents`, reads it to see the window let pulls
through again): the pulls recorded in a pool's window, and the nodes whose pulls spend an owner's
budget."""

from __future__ import annotations

from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, func, or_, select

from gpucloud.models.health_tables import QuarantinePull
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node


def owned_by(tenant: str | None):
    """The nodes whose pulls spend `tenant`'s budget (the platform's for None): `budget_of` in SQL."""
    if tenant is None:
        return or_(col(Node.allocation_id).is_(None), col(Node.tenant_id).is_(None))
    return sa.and_(col(Node.allocation_id).is_not(None), col(Node.tenant_id) == tenant)


def recent_pulls(session: Session, pool: str, *, now: datetime, window: timedelta) -> list[QuarantinePull]:
    return list(
        session.exec(
            select(QuarantinePull).where(col(QuarantinePull.pool) == pool, col(QuarantinePull.at) > now - window)
        ).all()
    )


def pool_size(session: Session, *, gpu_type: str, region: str, tenant: str | None) -> int:
    """The nodes of the pool (retired aside) whose pulls spend `tenant`'s budget."""
    return session.exec(
        select(func.count())
        .select_from(Node)
        .where(
            col(Node.gpu_type) == gpu_type,
            col(Node.region) == region,
            col(Node.state) != NodeState.RETIRED.value,
            owned_by(tenant),
        )
    ).one()
