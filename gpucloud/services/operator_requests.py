"""What admins ask of operator accounts through the API: create one with its first token, list
them with their tokens, rotate an account's token, revoke an account (`services.operators` keeps
the rules). Refusals are domain errors (`services/errors.py`)."""

from __future__ import annotations

from datetime import timedelta

from sqlmodel import Session, col, select

from gpucloud.db import Database
from gpucloud.models.api_schemas import OperatorList, OperatorTokenIssued, OperatorView
from gpucloud.models.operator_roles import Role
from gpucloud.models.tables import Operator, OperatorPublic, OperatorToken, OperatorTokenPublic
from gpucloud.services import operators as service
from gpucloud.services.errors import Conflict, NotFound


def _issued(
    account: Operator, token: OperatorToken, plaintext: str, *, replaced: OperatorToken | None = None
) -> OperatorTokenIssued:
    body = OperatorTokenIssued(
        operator=OperatorPublic.model_validate(account, from_attributes=True),
        token_id=token.id,
        token=plaintext,
        expires_at=token.expires_at,
    )
    if replaced is not None:
        body.replaces, body.replaced_token_expires_at = replaced.id, replaced.expires_at
    return body


def _view(session: Session, account: Operator) -> OperatorView:
    tokens = [
        OperatorTokenPublic.model_validate(t, from_attributes=True) for t in service.tokens(session, account.name)
    ]
    return OperatorView(**OperatorPublic.model_validate(account, from_attributes=True).model_dump(), tokens=tokens)


def create(db: Database, name: str, role: Role, *, admin: str, lifetime: timedelta) -> OperatorTokenIssued:
    try:
        with db.session() as session:
            account, token, plaintext = service.create(session, name, role, created_by=admin, lifetime=lifetime)
            return _issued(account, token, plaintext)
    except service.OperatorExists as exc:
        raise Conflict(
            str(exc), type_="operator-exists", title="Operator exists", errors=[{"field": "name", "message": "taken"}]
        ) from exc


def list_all(db: Database) -> OperatorList:
    with db.session() as session:
        accounts = session.exec(select(Operator).order_by(col(Operator.created_at))).all()
        return OperatorList(items=[_view(session, a) for a in accounts])


def rotate(db: Database, name: str, *, grace: timedelta, lifetime: timedelta) -> OperatorTokenIssued:
    try:
        with db.session() as session:
            old, new, plaintext = service.rotate(session, name, grace=grace, lifetime=lifetime)
            return _issued(service.get(session, name), new, plaintext, replaced=old)
    except service.OperatorNotFound as exc:
        raise NotFound("operator", name) from exc
    except service.TokenNotRotatable as exc:
        raise Conflict(str(exc), type_="token-not-rotatable", title="Token cannot be rotated") from exc


def revoke(db: Database, name: str) -> OperatorView:
    try:
        with db.session() as session:
            return _view(session, service.revoke(session, name))
    except service.OperatorNotFound as exc:
        raise NotFound("operator", name) from exc
