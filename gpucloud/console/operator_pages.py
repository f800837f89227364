"""The operator's pages beyond the fleet: the tenants (each with its quotas and what it holds
against them, its fair-share weights and its API keys) and the alerts. Each reads through the
service the API's router of the same data calls (`services/tenant_requests.quota_report`,
`services/scheduling.shares_of`, `services/api_key_requests.list_keys`)."""

from __future__ import annotations

from fastapi import Request, Response
from sqlmodel import col, select

from gpucloud.api.deps import DbDep, ReadsDep
from gpucloud.api.deps import ReadOperatorDep as ReadOperator
from gpucloud.console import web
from gpucloud.models.health_tables import OperatorAlertRecord
from gpucloud.models.tables import Allocation, Tenant, TenantStatus
from gpucloud.services import api_key_requests, scheduling, tenant_requests

router = web.pages_router()
LISTED = 200


@router.get("/tenants")
def tenants_page(request: Request, operator: ReadOperator, reads: ReadsDep, status: str = "") -> Response:
    status = status.strip() if status.strip() in {s.value for s in TenantStatus} else ""
    with reads() as session:
        query = select(Tenant).order_by(col(Tenant.seq).desc()).limit(LISTED)
        if status:
            query = query.where(col(Tenant.status) == status)
        rows = session.exec(query).all()
    return web.page(
        request,
        "tenants.html",
        tenants=rows,
        status_filter=status,
        statuses=[s.value for s in TenantStatus],
        listed=LISTED,
    )


@router.get("/tenants/{tenant_id}")
def tenant_page(request: Request, tenant_id: str, operator: ReadOperator, reads: ReadsDep, db: DbDep) -> Response:
    with reads(snapshot=True) as session:  # the quotas and the usage against them, at one moment
        tenant = tenant_requests.visible_tenant(session, tenant_id, caller_tenant_id=None, operator=True)
        report = tenant_requests.quota_report(session, tenant_id)
        shares = scheduling.shares_of(session, tenant_id)
        live = session.exec(
            select(Allocation)
            .where(col(Allocation.tenant_id) == tenant_id, col(Allocation.status).not_in(["released", "failed"]))
            .order_by(col(Allocation.seq).desc())
            .limit(LISTED)
        ).all()
    keys = api_key_requests.list_keys(db, tenant_id).items
    return web.page(request, "tenant.html", tenant=tenant, report=report, shares=shares, allocations=live, keys=keys)


@router.get("/alerts")
def alerts_page(request: Request, operator: ReadOperator, reads: ReadsDep, kind: str = "") -> Response:
    """The operator alerts (what `GET /v1/alerts` lists), newest first."""
    with reads() as session:
        query = select(OperatorAlertRecord).order_by(col(OperatorAlertRecord.seq).desc()).limit(LISTED)
        if kind.strip():
            query = query.where(col(OperatorAlertRecord.kind) == kind.strip())
        rows = session.exec(query).all()
        kinds = sorted(session.exec(select(col(OperatorAlertRecord.kind)).distinct()).all())
    return web.page(request, "alerts.html", alerts=rows, kind=kind.strip(), kinds=kinds, listed=LISTED)
