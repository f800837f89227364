"""Registry models, their evaluation gates, and the tenant's signing keys."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlmodel import col, select

from gpucloud.api import pagination
from gpucloud.api.deps import DbDep, ReadsDep, SettingsDep, TenantDep
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.models.registry_tables import (
    EvaluationCommand,
    EvaluatorKey,
    GatesUpdate,
    ModelPage,
    ModelPublic,
    RegistryModel,
    RegistryModelCreate,
    SigningKey,
    SigningKeyList,
    SigningKeyPublic,
    SigningKeyRegistration,
)
from gpucloud.registry import promotion
from gpucloud.services import registry_models as service
from gpucloud.services.registry_models import model_row

router = APIRouter(prefix="/v1", tags=["registry"])


@router.post("/models", status_code=201, response_model=ModelPublic)
async def create_model(
    request: Request,
    req: RegistryModelCreate,
    tenant: TenantDep,
    db: DbDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        host_commands = settings.registry.evaluation_host_commands
        create = partial(service.create_model, db, tenant.tenant_id, req, host_commands=host_commands)
        model = await run_in_threadpool(create)
        return JSONResponse(
            model.model_dump(mode="json"), status_code=201, headers={"Location": f"/v1/models/{model.name}"}
        )

    return await idempotent(request, db, tenant.id, idempotency_key, handler)


@router.get("/models", response_model=ModelPage)
def list_models(tenant: TenantDep, reads: ReadsDep, page: pagination.PageDep):
    with reads() as session:
        rows, token = pagination.fetch(session, RegistryModel, "seq", page=page, equal={"tenant_id": tenant.tenant_id})
        return ModelPage(items=promotion.publish_models(session, rows), next_page_token=token)


@router.get("/models/{name}", response_model=ModelPublic)
def get_model(name: str, tenant: TenantDep, reads: ReadsDep):
    with reads() as session:
        return promotion.publish_models(session, [model_row(session, tenant.tenant_id, name)])[0]


@router.put("/models/{name}/gates", response_model=ModelPublic)
def set_gates(name: str, req: GatesUpdate, tenant: TenantDep, db: DbDep):
    return service.set_gates(db, tenant.tenant_id, name, req.gates)


@router.put("/models/{name}/evaluation", response_model=ModelPublic)
def set_evaluation(name: str, req: EvaluationCommand, tenant: TenantDep, db: DbDep, settings: SettingsDep):
    """Register the model's evaluation command: the platform runs it (the `command` evaluator) on a
    version when asked, and on a rollout's canary nodes. A command the platform is configured
    never to run (no image where host commands are off) is a 422 `evaluation-command-not-runnable`."""
    service.runnable(req, field="image", host_commands=settings.registry.evaluation_host_commands)
    return service.set_evaluation(db, tenant.tenant_id, name, req)


@router.delete("/models/{name}/evaluation", response_model=ModelPublic)
def remove_evaluation(name: str, tenant: TenantDep, db: DbDep):
    return service.set_evaluation(db, tenant.tenant_id, name, None)


@router.get("/registry/evaluator-key", response_model=EvaluatorKey)
def evaluator_key(tenant: TenantDep, settings: SettingsDep):
    """The public key the platform signs the evaluations it runs with."""
    from gpucloud.bootstrap import evaluator_signer

    signer = evaluator_signer(settings)
    return EvaluatorKey(public_key=bytes(signer.verify_key).hex(), key_id=signer.key_id)


# ---------------------------------------------------------------- signing keys


@router.post("/signing-keys", status_code=201, response_model=SigningKeyPublic)
async def register_signing_key(
    request: Request,
    req: SigningKeyRegistration,
    tenant: TenantDep,
    db: DbDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        key, created = await run_in_threadpool(service.register_key, db, tenant.tenant_id, req)
        body = SigningKeyPublic.model_validate(key, from_attributes=True).model_dump(mode="json")
        return JSONResponse(body, status_code=201 if created else 200)

    return await idempotent(request, db, tenant.id, idempotency_key, handler)


@router.get("/signing-keys", response_model=SigningKeyList)
def list_signing_keys(tenant: TenantDep, reads: ReadsDep):
    """The public keys the registry trusts for this tenant: what a pull verifies manifests against."""
    with reads() as session:
        keys = session.exec(
            select(SigningKey)
            .where(col(SigningKey.tenant_id) == tenant.tenant_id, col(SigningKey.revoked_at).is_(None))
            .order_by(col(SigningKey.seq))
        )
        return SigningKeyList(
            tenant_id=tenant.tenant_id, items=[SigningKeyPublic.model_validate(k, from_attributes=True) for k in keys]
        )


@router.delete("/signing-keys/{key_id}", response_model=SigningKeyPublic)
def revoke_signing_key(key_id: str, tenant: TenantDep, db: DbDep):
    """Revoke a key: versions it signed no longer verify on pull and cannot be promoted."""
    return service.revoke_key(db, tenant.tenant_id, key_id)
