"""`GET /v1/whoami`: who the credential in use is, and for a tenant what it may hold and holds.

A tenant's key answers the tenant, the key (its id and prefix: the secret is never shown again),
the quotas an operator granted with the GPUs held against them now, and what the ledger has
metered this billing period (null with `usage_note` where there is no ledger, or it does not
answer: the rest does not wait on billing). An operator's token answers its name, role and scopes.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from gpucloud.api.auth import Caller
from gpucloud.api.deps import CallerDep, Reads, ReadsDep
from gpucloud.api.routers.tenants import visible_tenant
from gpucloud.ledger.client import LedgerClient, LedgerRefused, LedgerUnavailable
from gpucloud.ledger.periods import period_bounds, period_of
from gpucloud.models.api_schemas import PeriodUsage, Whoami, WhoamiKey
from gpucloud.models.tables import TenantPublic
from gpucloud.services import api_keys as key_service
from gpucloud.services import operators as operator_service
from gpucloud.services.tenant_requests import quota_report

router = APIRouter(prefix="/v1", tags=["whoami"])


def _tenant(reads: Reads, caller: Caller) -> Whoami:
    assert caller.tenant_id is not None and caller.key_id is not None  # a tenant's key names both
    with reads(snapshot=True) as session:  # the quotas and the usage against them, at one moment
        tenant = visible_tenant(session, caller, caller.tenant_id)
        key = key_service.key_of(session, caller.key_id)
        return Whoami(
            kind="tenant",
            tenant=TenantPublic.model_validate(tenant, from_attributes=True),
            api_key=WhoamiKey(id=key.id, prefix=f"gpc_{key.id}.", created_at=key.created_at, expires_at=key.expires_at),
            quotas=quota_report(session, caller.tenant_id),
        )


async def _period_usage(ledger: LedgerClient | None, tenant_id: str) -> tuple[PeriodUsage | None, str | None]:
    if ledger is None:
        return None, "billing is not configured (no ledger)"
    period = period_of(time.time_ns() // 1_000_000)
    start_ms, end_ms = period_bounds(period)
    try:
        summary = await ledger.usage(tenant_id=tenant_id, start_ms=start_ms, end_ms=end_ms)
    except LedgerUnavailable:
        return None, "the billing ledger did not answer; ask again later (`gpucloud whoami`)"
    except LedgerRefused as exc:
        return None, f"the billing ledger refused the usage query: {exc}"
    return PeriodUsage(
        period=period,
        net_gpu_ms=summary.net_gpu_ms,
        net_amount_micro=summary.net_amount_micro,
        by_gpu_type=summary.by_gpu_type,
    ), None


def _operator_role(reads: Reads, name: str) -> str:
    with reads() as session:
        return operator_service.role_of(session, name)


@router.get("/whoami", response_model=Whoami)
async def whoami(request: Request, caller: CallerDep, reads: ReadsDep):
    """Who calls: the tenant, key, quotas and usage; or the operator and its role."""
    if caller.is_operator:
        assert caller.operator is not None  # an operator's token names its account
        role = await run_in_threadpool(_operator_role, reads, caller.operator)
        return Whoami(kind="operator", operator=caller.operator, role=role, scopes=sorted(caller.scopes))
    answer = await run_in_threadpool(_tenant, reads, caller)
    usage, note = await _period_usage(getattr(request.app.state, "ledger", None), answer.tenant.id)  # type: ignore[union-attr]
    return answer.model_copy(update={"usage_this_period": usage, "usage_note": note})
