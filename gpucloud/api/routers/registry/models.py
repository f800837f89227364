"""Registry models, their evaluation gates, and the tenant's signing keys."""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from nacl.signing import VerifyKey
from sqlmodel import col, select

from gpucloud.api import pagination
from gpucloud.api.deps import ReadsDep, SettingsDep, TenantDep
from gpucloud.api.idempotency import IdempotencyKey, idempotent
from gpucloud.api.routers.registry.common import (
    model_row,
)
from gpucloud.config import Settings
from gpucloud.db import session_scope
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
from gpucloud.models.tables import utcnow
from gpucloud.registry import promotion
from gpucloud.registry.evaluators import never_run
from gpucloud.registry.manifest import (
    check_possession,
    key_id_of,
)
from gpucloud.web.problems import Problem, invalid, not_found

router = APIRouter(prefix="/v1", tags=["registry"])


def _runnable(settings: Settings, command: EvaluationCommand, *, field: str) -> EvaluationCommand:
    """The command, if the platform's evaluation worker would ever run it as configured; else a
    422 naming why and what it would run (see `evaluators.never_run`)."""
    if (why := never_run(command, host_commands=settings.registry.evaluation_host_commands)) is not None:
        raise invalid(field, why, "evaluation-command-not-runnable", title="The platform would not run this command")
    return command


def _create_model(settings: Settings, tenant_id: str, req: RegistryModelCreate) -> ModelPublic:
    if req.evaluation is not None:
        _runnable(settings, req.evaluation, field="evaluation.image")
    try:
        with session_scope(settings.database_url) as session:
            evaluation = req.evaluation.model_dump(mode="json") if req.evaluation else None
            model = RegistryModel(
                tenant_id=tenant_id, name=req.name, description=req.description, evaluation=evaluation
            )
            session.add(model)
            session.flush()
            promotion.replace_gates(session, model, req.gates)
            session.flush()
            return promotion.publish_models(session, [model])[0]
    except sa.exc.IntegrityError as exc:
        raise Problem(409, "model-exists", "Model exists", f"a model named {req.name!r} already exists") from exc


@router.post("/models", status_code=201, response_model=ModelPublic)
async def create_model(
    request: Request,
    req: RegistryModelCreate,
    tenant: TenantDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        model = await run_in_threadpool(_create_model, settings, tenant.tenant_id, req)
        return JSONResponse(
            model.model_dump(mode="json"), status_code=201, headers={"Location": f"/v1/models/{model.name}"}
        )

    return await idempotent(request, settings.database_url, tenant.id, idempotency_key, handler)


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
def set_gates(name: str, req: GatesUpdate, tenant: TenantDep, settings: SettingsDep):
    with session_scope(settings.database_url) as session:
        model = model_row(session, tenant.tenant_id, name, for_update=True)
        promotion.replace_gates(session, model, req.gates)
        session.flush()
        return promotion.publish_models(session, [model])[0]


@router.put("/models/{name}/evaluation", response_model=ModelPublic)
def set_evaluation(name: str, req: EvaluationCommand, tenant: TenantDep, settings: SettingsDep):
    """Register the model's evaluation command: the platform runs it (the `command` evaluator) on a
    version when asked, and on a rollout's canary nodes. A command the platform is configured
    never to run (no image where host commands are off) is a 422 `evaluation-command-not-runnable`."""
    _runnable(settings, req, field="image")
    with session_scope(settings.database_url) as session:
        model = model_row(session, tenant.tenant_id, name, for_update=True)
        model.evaluation = req.model_dump(mode="json")
        session.add(model)
        session.flush()
        return promotion.publish_models(session, [model])[0]


@router.delete("/models/{name}/evaluation", response_model=ModelPublic)
def remove_evaluation(name: str, tenant: TenantDep, settings: SettingsDep):
    with session_scope(settings.database_url) as session:
        model = model_row(session, tenant.tenant_id, name, for_update=True)
        model.evaluation = None
        session.add(model)
        session.flush()
        return promotion.publish_models(session, [model])[0]


@router.get("/registry/evaluator-key", response_model=EvaluatorKey)
def evaluator_key(tenant: TenantDep, settings: SettingsDep):
    """The public key the platform signs the evaluations it runs with."""
    from gpucloud.bootstrap import evaluator_signer

    signer = evaluator_signer(settings)
    return EvaluatorKey(public_key=bytes(signer.verify_key).hex(), key_id=signer.key_id)


# ---------------------------------------------------------------- signing keys


def _register_key(settings: Settings, tenant_id: str, req: SigningKeyRegistration) -> tuple[SigningKey, bool]:
    if not check_possession(tenant_id, req.public_key, req.proof):
        raise invalid(
            "proof",
            "not this key's signature of its registration for this tenant; sign "
            "'gpucloud.registry.key-possession.v1\\n<tenant id>\\n<public key hex>' with the private key",
            "proof-of-possession-failed",
        )
    key_id = key_id_of(VerifyKey(bytes.fromhex(req.public_key)))
    query = select(SigningKey).where(col(SigningKey.tenant_id) == tenant_id, col(SigningKey.key_id) == key_id)
    try:
        with session_scope(settings.database_url) as session:
            existing = session.exec(query).first()
            if existing is None:
                key = SigningKey(tenant_id=tenant_id, key_id=key_id, public_key=req.public_key)
                session.add(key)
                return key, True
    except sa.exc.IntegrityError:  # registered concurrently: the other request's row is the answer
        with session_scope(settings.database_url) as session:
            existing = session.exec(query).one()
    if existing.revoked_at is not None:
        raise Problem(
            409,
            "signing-key-revoked",
            "Signing key revoked",
            f"key {key_id} was revoked and cannot be registered again; generate a new key",
        )
    return existing, False


@router.post("/signing-keys", status_code=201, response_model=SigningKeyPublic)
async def register_signing_key(
    request: Request,
    req: SigningKeyRegistration,
    tenant: TenantDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
):
    async def handler() -> JSONResponse:
        key, created = await run_in_threadpool(_register_key, settings, tenant.tenant_id, req)
        body = SigningKeyPublic.model_validate(key, from_attributes=True).model_dump(mode="json")
        return JSONResponse(body, status_code=201 if created else 200)

    return await idempotent(request, settings.database_url, tenant.id, idempotency_key, handler)


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
def revoke_signing_key(key_id: str, tenant: TenantDep, settings: SettingsDep):
    """Revoke a key: versions it signed no longer verify on pull and cannot be promoted."""
    with session_scope(settings.database_url) as session:
        key = session.exec(
            select(SigningKey).where(col(SigningKey.tenant_id) == tenant.tenant_id, col(SigningKey.key_id) == key_id)
        ).first()
        if key is None:
            raise not_found("signing key", key_id)
        key.revoked_at = key.revoked_at or utcnow()
        session.add(key)
        return SigningKeyPublic.model_validate(key, from_attributes=True)
