"""Tenants and their API keys (operator only). A new key's secret is shown once."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlmodel import select

from gpucloud.api import auth, pagination
from gpucloud.api.deps import OperatorDep, SessionDep, SettingsDep
from gpucloud.api.idempotency import run_idempotent
from gpucloud.api.problems import Problem, not_found
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.tables import Tenant, TenantCreate, TenantPublic

router = APIRouter(prefix="/v1", tags=["tenants"])


class ApiKeyCreated(BaseModel):
    id: str
    tenant_id: str
    key: str
    created_at: datetime


class TenantPage(BaseModel):
    items: list[TenantPublic]
    next_page_token: str


def _create_tenant(settings: Settings, req: TenantCreate) -> Tenant:
    try:
        with session_scope(settings.db_url) as session:
            tenant = Tenant(name=req.name)
            session.add(tenant)
            return tenant
    except sa.exc.IntegrityError as exc:
        raise Problem(409, "tenant-exists", "Tenant exists", f"a tenant named {req.name!r} already exists") from exc


@router.post("/tenants", status_code=201, response_model=TenantPublic)
async def create_tenant(request: Request, req: TenantCreate, operator: OperatorDep, settings: SettingsDep,
                        idempotency_key: Annotated[str | None, Header()] = None):
    async def handler() -> JSONResponse:
        tenant = await run_in_threadpool(_create_tenant, settings, req)
        body = TenantPublic.model_validate(tenant, from_attributes=True).model_dump(mode="json")
        return JSONResponse(body, status_code=201, headers={"Location": f"/v1/tenants/{tenant.id}"})

    return await run_idempotent(db_url=settings.db_url, caller=operator.id, key=idempotency_key, method="POST",
                                path=request.url.path, body=await request.body(), handler=handler)


@router.get("/tenants", response_model=TenantPage)
def list_tenants(operator: OperatorDep, session: SessionDep,
                 page_size: Annotated[int, Query(ge=1, le=pagination.MAX_PAGE_SIZE)] = pagination.DEFAULT_PAGE_SIZE,
                 page_token: str | None = None):
    cursor = pagination.decode(page_token, {})
    query = select(Tenant).order_by(Tenant.seq).limit(page_size + 1)
    if cursor.after is not None:
        query = query.where(Tenant.seq > cursor.after)
    rows, token = pagination.page(list(session.exec(query).all()), page_size, lambda t: t.seq, {})
    return TenantPage(items=[TenantPublic.model_validate(t, from_attributes=True) for t in rows],
                      next_page_token=token)


@router.get("/tenants/{tenant_id}", response_model=TenantPublic)
def get_tenant(tenant_id: str, operator: OperatorDep, session: SessionDep):
    tenant = session.exec(select(Tenant).where(Tenant.id == tenant_id)).first()
    if tenant is None:
        raise not_found("tenant", tenant_id)
    return tenant


@router.post("/tenants/{tenant_id}/api-keys", status_code=201, response_model=ApiKeyCreated)
def create_api_key(tenant_id: str, operator: OperatorDep, settings: SettingsDep):
    with session_scope(settings.db_url) as session:
        if session.exec(select(Tenant.id).where(Tenant.id == tenant_id)).first() is None:
            raise not_found("tenant", tenant_id)
        key, plaintext = auth.issue_key(session, tenant_id)
        return ApiKeyCreated(id=key.id, tenant_id=tenant_id, key=plaintext, created_at=key.created_at)
