"""What tenants ask of their registry models through the API: create one with its gates and
evaluation command, change those, and register or revoke the keys its versions are signed with.
Refusals are domain errors (`services/errors.py`)."""

from __future__ import annotations

import sqlalchemy as sa
from nacl.signing import VerifyKey
from sqlmodel import Session, col, select

from gpucloud.db import Database
from gpucloud.models.registry_tables import (
    EvaluationCommand,
    GateSpec,
    ModelPublic,
    RegistryModel,
    RegistryModelCreate,
    SigningKey,
    SigningKeyPublic,
    SigningKeyRegistration,
)
from gpucloud.models.tables import utcnow
from gpucloud.registry import promotion
from gpucloud.registry.evaluators import never_run
from gpucloud.registry.manifest import check_possession, key_id_of
from gpucloud.services.errors import Conflict, Invalid, NotFound


def model_row(session: Session, tenant_id: str, name: str, *, for_update: bool = False) -> RegistryModel:
    """The tenant's model of this name (locked, `for_update`); `NotFound` otherwise."""
    query = select(RegistryModel).where(col(RegistryModel.tenant_id) == tenant_id, col(RegistryModel.name) == name)
    model = session.exec(query.with_for_update() if for_update else query).first()
    if model is None:
        raise NotFound("model", name)
    return model


def runnable(command: EvaluationCommand, *, field: str, host_commands: bool) -> EvaluationCommand:
    """The command, if the platform's evaluation worker would ever run it as configured; else
    `Invalid` naming why and what it would run (see `evaluators.never_run`)."""
    if (why := never_run(command, host_commands=host_commands)) is not None:
        raise Invalid(field, why, "evaluation-command-not-runnable", title="The platform would not run this command")
    return command


def create_model(db: Database, tenant_id: str, req: RegistryModelCreate, *, host_commands: bool) -> ModelPublic:
    if req.evaluation is not None:
        runnable(req.evaluation, field="evaluation.image", host_commands=host_commands)
    try:
        with db.session() as session:
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
        raise Conflict(
            f"a model named {req.name!r} already exists", type_="model-exists", title="Model exists"
        ) from exc


def set_gates(db: Database, tenant_id: str, name: str, gates: list[GateSpec]) -> ModelPublic:
    with db.session() as session:
        model = model_row(session, tenant_id, name, for_update=True)
        promotion.replace_gates(session, model, gates)
        session.flush()
        return promotion.publish_models(session, [model])[0]


def set_evaluation(db: Database, tenant_id: str, name: str, command: EvaluationCommand | None) -> ModelPublic:
    """Register the model's evaluation command (None: remove it)."""
    with db.session() as session:
        model = model_row(session, tenant_id, name, for_update=True)
        model.evaluation = command.model_dump(mode="json") if command is not None else None
        session.add(model)
        session.flush()
        return promotion.publish_models(session, [model])[0]


def register_key(db: Database, tenant_id: str, req: SigningKeyRegistration) -> tuple[SigningKey, bool]:
    """The tenant's signing key, registered once its proof of possession checks (True: new)."""
    if not check_possession(tenant_id, req.public_key, req.proof):
        raise Invalid(
            "proof",
            "not this key's signature of its registration for this tenant; sign "
            "'gpucloud.registry.key-possession.v1\\n<tenant id>\\n<public key hex>' with the private key",
            "proof-of-possession-failed",
        )
    key_id = key_id_of(VerifyKey(bytes.fromhex(req.public_key)))
    query = select(SigningKey).where(col(SigningKey.tenant_id) == tenant_id, col(SigningKey.key_id) == key_id)
    try:
        with db.session() as session:
            existing = session.exec(query).first()
            if existing is None:
                key = SigningKey(tenant_id=tenant_id, key_id=key_id, public_key=req.public_key)
                session.add(key)
                return key, True
    except sa.exc.IntegrityError:  # registered concurrently: the other request's row is the answer
        with db.session() as session:
            existing = session.exec(query).one()
    if existing.revoked_at is not None:
        raise Conflict(
            f"key {key_id} was revoked and cannot be registered again; generate a new key",
            type_="signing-key-revoked",
            title="Signing key revoked",
        )
    return existing, False


def revoke_key(db: Database, tenant_id: str, key_id: str) -> SigningKeyPublic:
    """Revoke a key: versions it signed no longer verify on pull and cannot be promoted."""
    with db.session() as session:
        key = session.exec(
            select(SigningKey).where(col(SigningKey.tenant_id) == tenant_id, col(SigningKey.key_id) == key_id)
        ).first()
        if key is None:
            raise NotFound("signing key", key_id)
        key.revoked_at = key.revoked_at or utcnow()
        session.add(key)
        return SigningKeyPublic.model_validate(key, from_attributes=True)
