"""Activities of tenant onboarding and offboarding over the control-plane DB, the tenant's VNI
and the ledger. Storage steps are in `storage`; the offboarding workflow signals the allocation
workflows itself.

The VNI comes from the SDN controller when fabric managers are configured
(`FabricSettings.manager_urls`): the tenant's VPC, found again by tenant on a retry. Without
them the DB hands out a VNI that no other tenant holds (a unique index). Either way the tenant
row records it.

Errors are classified here: a tenant that does not exist, or a fabric manager's refusal, is
permanent (non-retryable); a locked DB or an unreachable manager is transient. A VPC that still
has nodes attached is transient too: the allocations' releases detach them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlmodel import col
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup, view_of
from gpucloud.activities.faults import FaultHook, reach
from gpucloud.db import Database
from gpucloud.fabric.http_clients import HttpFabricController
from gpucloud.fabric.interface import FabricError
from gpucloud.fabric.membership import delete_tenant_vpc, ensure_tenant_vpc
from gpucloud.ledger.client import LedgerClient, LedgerRefused
from gpucloud.models.tables import SYSTEM_ACTOR, Tenant, TenantStatus
from gpucloud.models.tenant_messages import (
    ActivateTenantInput,
    AllocationCancel,
    CancelledAllocations,
    RevokedKeys,
    SettleTenantInput,
    TenantBilling,
    TenantRef,
    TenantReleaseProgress,
    TenantView,
    TenantVni,
)
from gpucloud.services import allocations as allocation_service
from gpucloud.services import api_keys
from gpucloud.services import tenants as tenant_service
from gpucloud.services.operations import settle_operation


def _view(tenant: Tenant) -> TenantView:
    return view_of(TenantView, tenant, tenant_id=tenant.id)


class TenantActivities(ActivityGroup):
    def __init__(
        self,
        db: Database,
        *,
        fabric: Callable[[], HttpFabricController] | None,
        ledger: LedgerClient | None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        """`fabric` makes a client of the fabric managers (None: none configured, VNIs come from
        the DB); without a `ledger` nothing is billed."""
        self.db = db
        self.fabric = fabric
        self.ledger = ledger
        self.fault_hook = fault_hook

    @contextmanager
    def _db(self) -> Iterator:
        try:
            with self.db.session() as session:
                yield session
        except tenant_service.TenantNotFound as exc:
            raise ApplicationError(f"tenant {exc} does not exist", type="TenantNotFound", non_retryable=True) from exc
        except tenant_service.TenantStateConflict as exc:
            raise ApplicationError(str(exc), type="TenantStateConflict", non_retryable=True) from exc

    @contextmanager
    def _fabric(self) -> Iterator[HttpFabricController]:
        assert self.fabric is not None
        try:
            with self.fabric() as controller:
                yield controller
        except FabricError as exc:
            if exc.constraint == "vpc_not_empty":
                raise  # an allocation's release still has to detach its nodes: retry
            raise ApplicationError(str(exc), type="FabricRefused", non_retryable=True) from exc

    def _fault(self, step: str, phase: str, tenant_id: str) -> None:
        reach(self.fault_hook, step, phase, tenant_id)

    # ------------------------------------------------------------ the tenant record

    @activity.defn
    def load_tenant(self, req: TenantRef) -> TenantView:
        with self._db() as session:
            return _view(tenant_service.get(session, req.tenant_id))

    @activity.defn
    def activate_tenant(self, req: ActivateTenantInput) -> TenantView:
        self._fault("activate_tenant", "before", req.tenant_id)
        with self._db() as session:
            session.execute(
                sa.update(Tenant).where(col(Tenant.id) == req.tenant_id).values(storage_prefix=req.storage_prefix)
            )
            tenant = tenant_service.move(
                session, req.tenant_id, source=(TenantStatus.ONBOARDING,), target=TenantStatus.ACTIVE
            )
            settle_operation(session, req.operation_id, error=None)
            return _view(tenant)

    @activity.defn
    def fail_tenant(self, req: SettleTenantInput) -> TenantView:
        """The last step of undoing an onboarding: the tenant shows `failed`, with the reason."""
        self._fault("fail_tenant", "before", req.tenant_id)
        with self._db() as session:
            session.execute(sa.update(Tenant).where(col(Tenant.id) == req.tenant_id).values(storage_prefix=None))
            tenant = tenant_service.move(
                session, req.tenant_id, source=(TenantStatus.ONBOARDING,), target=TenantStatus.FAILED, reason=req.error
            )
            settle_operation(session, req.operation_id, error=req.error)
            return _view(tenant)

    @activity.defn
    def finish_offboarding(self, req: SettleTenantInput) -> TenantView:
        with self._db() as session:
            tenant = tenant_service.move(
                session, req.tenant_id, source=(TenantStatus.OFFBOARDING,), target=TenantStatus.OFFBOARDED
            )
            settle_operation(session, req.operation_id, error=None)
            return _view(tenant)

    @activity.defn
    def revoke_tenant_keys(self, req: TenantRef) -> RevokedKeys:
        self._fault("revoke_tenant_keys", "before", req.tenant_id)
        with self._db() as session:
            revoked = api_keys.revoke_all(session, req.tenant_id)
        self._fault("revoke_tenant_keys", "after", req.tenant_id)
        return RevokedKeys(revoked=revoked)

    # ------------------------------------------------------------ the VPC's VNI

    @activity.defn
    def allocate_tenant_vni(self, req: TenantRef) -> TenantVni:
        self._fault("allocate_tenant_vni", "before", req.tenant_id)
        with self._db() as session:
            tenant_service.get(session, req.tenant_id)
        if self.fabric is not None:
            with self._fabric() as controller:
                vni = ensure_tenant_vpc(controller, req.tenant_id).vni
            with self._db() as session:
                # A unique-index clash means another tenant's row still names this VNI: its
                # release has not finished recording yet. Transient: retried.
                tenant_service.record_vni(session, req.tenant_id, vni)
            source = "sdn"
        else:
            with self._db() as session:
                vni = tenant_service.allocate_db_vni(session, req.tenant_id)
            source = "db"
        self._fault("allocate_tenant_vni", "after", req.tenant_id)
        return TenantVni(tenant_id=req.tenant_id, vni=vni, source=source)

    @activity.defn
    def release_tenant_vni(self, req: TenantRef) -> TenantVni:
        """Delete the tenant's VPC (it must be empty by now), then forget the VNI (idempotent)."""
        self._fault("release_tenant_vni", "before", req.tenant_id)
        if self.fabric is not None:
            with self._fabric() as controller:
                delete_tenant_vpc(controller, req.tenant_id)
        with self._db() as session:
            tenant_service.record_vni(session, req.tenant_id, None)
        self._fault("release_tenant_vni", "after", req.tenant_id)
        return TenantVni(tenant_id=req.tenant_id, vni=None, source="sdn" if self.fabric is not None else "db")

    # ------------------------------------------------------------ offboarding

    def _record_cancels(self, tenant_id: str) -> list[tuple[str, str]]:
        with self._db() as session:
            cancels = []
            offboarding = tenant_service.offboarding_operation(session, tenant_id)
            actor = offboarding.actor if offboarding is not None else SYSTEM_ACTOR
            for alloc in tenant_service.live_allocations(session, tenant_id):
                op = allocation_service.record_cancel_intent(session, alloc, tenant_id=tenant_id, actor=actor)
                if op is not None:
                    cancels.append((alloc.id, op.id))
            return cancels

    @activity.defn
    def cancel_tenant_allocations(self, req: TenantRef) -> CancelledAllocations:
        """Record the cancel intent of every live allocation, as the cancel endpoint does; the
        workflow then signals each allocation's workflow."""
        cancels = self._record_cancels(req.tenant_id)
        return CancelledAllocations(cancels=[AllocationCancel(allocation_id=a, operation_id=o) for a, o in cancels])

    @activity.defn
    def tenant_release_progress(self, req: TenantRef) -> TenantReleaseProgress:
        with self._db() as session:
            open_allocations, in_flight, parked = tenant_service.release_progress(session, req.tenant_id)
        return TenantReleaseProgress(open_allocations=open_allocations, nodes_in_flight=in_flight, nodes_parked=parked)

    @activity.defn
    async def close_tenant_billing(self, req: TenantRef) -> TenantBilling:
        """The tenant's last billing step. The ledger closes periods for everyone at once (the
        billing schedule), so the final invoice is the one of the period still open now, which
        holds the tenant's last usage: this names it and reads the usage it holds so far."""
        if self.ledger is None:
            return TenantBilling(tenant_id=req.tenant_id, skipped="no ledger configured")
        try:
            periods = await self.ledger.periods()
            usage = await self.ledger.usage(tenant_id=req.tenant_id)
        except LedgerRefused as exc:
            raise ApplicationError(str(exc), type="LedgerRefused", non_retryable=True) from exc
        open_periods = sorted(p.period_id for p in periods if p.closed_ms is None)
        return TenantBilling(
            tenant_id=req.tenant_id,
            final_period_id=open_periods[-1] if open_periods else None,
            usage_gpu_ms=usage.net_gpu_ms,
        )
