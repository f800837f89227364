"""Tenant records through their life: created `onboarding`, then `active` or `failed`; then
`offboarding` and `offboarded`.

`create` writes, in one transaction, everything onboarding needs from the DB alone: the account
(the tenant row), its quotas, its first API key and the operation; the onboarding workflow does
the rest (VNI, storage) and settles the tenant. Status moves are compare-and-swaps on the
status, idempotent when the tenant is already where it was asked to go, so a retried activity
cannot move a tenant twice or out of a state another step put it in.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.db import rowcount
from gpucloud.fabric.interface import MAX_VNI, MIN_VNI
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import (
    TERMINAL_ALLOCATION,
    Allocation,
    ApiKey,
    Node,
    Operation,
    Tenant,
    TenantQuota,
    TenantQuotaBase,
    TenantStatus,
    utcnow,
)
from gpucloud.models.workflow_ids import offboarding_workflow_id, onboarding_workflow_id
from gpucloud.services import api_keys

CREATE_OPERATION = "create_tenant"
DELETE_OPERATION = "delete_tenant"
VNI_ATTEMPTS = 8

# Nodes that may hold a tenant's data and are still on their way to a wipe.
IN_FLIGHT = (
    NodeState.RESERVED,
    NodeState.PROVISIONING,
    NodeState.ACTIVE,
    NodeState.RELEASING,
    NodeState.WIPING,
    NodeState.DRAINING,
)
# Nodes that hold data until their repair wipes them; nobody gets them before.
PARKED = (NodeState.QUARANTINED, NodeState.REPAIRING, NodeState.RMA)


class TenantExists(Exception):
    pass


class TenantNotFound(LookupError):
    pass


class TenantStateConflict(Exception):
    def __init__(self, tenant_id: str, status: str, wanted: str) -> None:
        super().__init__(f"tenant {tenant_id} is {status}, cannot become {wanted}")
        self.status = status


def get(session: Session, tenant_id: str) -> Tenant:
    tenant = session.exec(select(Tenant).where(col(Tenant.id) == tenant_id)).first()
    if tenant is None:
        raise TenantNotFound(tenant_id)
    return tenant


def create(
    session: Session, *, name: str, quotas: list[TenantQuotaBase], actor: str
) -> tuple[Tenant, Operation, ApiKey, str]:
    """The tenant (`onboarding`), its quotas, first key and onboarding operation (asked for by
    `actor`); the key's plaintext is returned once. Raises `TenantExists` when the name is taken
    (ever)."""
    if session.exec(select(col(Tenant.id)).where(col(Tenant.name) == name)).first() is not None:
        raise TenantExists(name)
    tenant = Tenant(name=name, status=TenantStatus.ONBOARDING)
    session.add(tenant)
    try:
        session.flush()  # the unique name decides a race between two creates
    except sa.exc.IntegrityError as exc:
        raise TenantExists(name) from exc
    session.add_all(
        [TenantQuota(tenant_id=tenant.id, gpu_type=q.gpu_type, region=q.region, max_gpus=q.max_gpus) for q in quotas]
    )
    key, plaintext = api_keys.issue_key(session, tenant.id)
    op = Operation(
        tenant_id=tenant.id,
        kind=CREATE_OPERATION,
        resource_id=tenant.id,
        workflow_id=onboarding_workflow_id(tenant.id),
        actor=actor,
    )
    session.add(op)
    session.flush()
    return tenant, op, key, plaintext


def discard(session: Session, tenant_id: str) -> None:
    """Onboarding never started (the workflow engine refused it): remove every row `create`
    wrote, so the name is free again and nothing half-made is left."""
    for table, column in (
        (ApiKey, col(ApiKey.tenant_id)),
        (TenantQuota, col(TenantQuota.tenant_id)),
        (Operation, col(Operation.tenant_id)),
        (Tenant, col(Tenant.id)),
    ):
        session.execute(sa.delete(table).where(column == tenant_id))


def move(
    session: Session, tenant_id: str, *, source: Iterable[TenantStatus], target: TenantStatus, reason: str | None = None
) -> Tenant:
    """Compare-and-swap the status from one of `source` to `target` (a no-op when there already)."""
    tenant = get(session, tenant_id)
    if tenant.status == target:
        return tenant
    allowed = [s.value for s in source]
    values = {"status": target.value, "updated_at": utcnow(), **({"failure_reason": reason} if reason else {})}
    result = session.execute(
        sa.update(Tenant).where(col(Tenant.id) == tenant_id, col(Tenant.status).in_(allowed)).values(**values)
    )
    session.refresh(tenant)
    if rowcount(result) != 1 and tenant.status != target:
        raise TenantStateConflict(tenant_id, tenant.status, target.value)
    return tenant


def begin_offboarding(session: Session, tenant_id: str, *, actor: str) -> tuple[Tenant, Operation, bool]:
    """Move the tenant to `offboarding` (under its row lock, which allocation admission takes
    too) and return its delete operation (asked for by `actor`, or by whoever asked first); the
    flag says whether it was created just now."""
    tenant = session.exec(select(Tenant).where(col(Tenant.id) == tenant_id).with_for_update()).first()
    if tenant is None:
        raise TenantNotFound(tenant_id)
    existing = offboarding_operation(session, tenant_id)
    if existing is not None:
        return tenant, existing, False
    if tenant.status not in (TenantStatus.ACTIVE, TenantStatus.FAILED):
        raise TenantStateConflict(tenant_id, tenant.status, TenantStatus.OFFBOARDING.value)
    tenant = move(
        session, tenant_id, source=(TenantStatus.ACTIVE, TenantStatus.FAILED), target=TenantStatus.OFFBOARDING
    )
    op = Operation(
        tenant_id=tenant_id,
        kind=DELETE_OPERATION,
        resource_id=tenant_id,
        workflow_id=offboarding_workflow_id(tenant_id),
        actor=actor,
    )
    session.add(op)
    session.flush()
    return tenant, op, True


def offboarding_operation(session: Session, tenant_id: str) -> Operation | None:
    """The tenant's delete operation, if it is being (or was) offboarded: what offboarding does
    on its way (its allocations' cancels) is done for that operation's actor."""
    return session.exec(
        select(Operation).where(col(Operation.resource_id) == tenant_id, col(Operation.kind) == DELETE_OPERATION)
    ).first()


def record_vni(session: Session, tenant_id: str, vni: int | None) -> None:
    session.execute(sa.update(Tenant).where(col(Tenant.id) == tenant_id).values(vni=vni, updated_at=utcnow()))


def allocate_db_vni(session: Session, tenant_id: str) -> int:
    """A VNI no other tenant holds, kept on the tenant's row (idempotent). Without an SDN
    controller the unique index on `tenant.vni` is what makes the VNI the tenant's alone."""
    for _ in range(VNI_ATTEMPTS):
        tenant = get(session, tenant_id)
        if tenant.vni is not None:
            return tenant.vni
        highest = session.exec(select(sa.func.max(col(Tenant.vni)))).one()
        candidate = MIN_VNI if highest is None else highest + 1
        if candidate > MAX_VNI:
            taken = set(session.exec(select(col(Tenant.vni)).where(col(Tenant.vni).is_not(None))).all())
            candidate = next(v for v in range(MIN_VNI, MAX_VNI + 1) if v not in taken)
        try:
            with session.begin_nested():
                session.execute(
                    sa.update(Tenant)
                    .where(col(Tenant.id) == tenant_id, col(Tenant.vni).is_(None))
                    .values(vni=candidate, updated_at=utcnow())
                )
        except sa.exc.IntegrityError:
            continue  # another tenant took it first: look again
        session.expire_all()
    raise RuntimeError(f"could not allocate a VNI for tenant {tenant_id} after {VNI_ATTEMPTS} attempts")


def live_allocations(session: Session, tenant_id: str) -> list[Allocation]:
    return list(
        session.exec(
            select(Allocation).where(
                col(Allocation.tenant_id) == tenant_id,
                col(Allocation.status).not_in([s.value for s in TERMINAL_ALLOCATION]),
            )
        ).all()
    )


def release_progress(session: Session, tenant_id: str) -> tuple[int, int, int]:
    """(live allocations, nodes with the tenant's data on their way to a wipe, nodes with its
    data parked until a repair wipes them)."""
    open_allocations = len(live_allocations(session, tenant_id))
    states = session.exec(select(col(Node.state)).where(col(Node.tenant_id) == tenant_id)).all()
    in_flight = sum(1 for s in states if s in {x.value for x in IN_FLIGHT})
    parked = sum(1 for s in states if s in {x.value for x in PARKED})
    return open_allocations, in_flight, parked
