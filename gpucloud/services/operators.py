"""Operator accounts: named operators, each with a role, and their tokens.

A role is a set of scopes (`models.operator_roles`), and every operator route declares the one
scope it needs (`api.deps`). The roles:

- `read-only`: read;
- `fleet-operator`: read, fleet;
- `billing-admin`: read, billing, tenants (customer accounts are the billing side's);
- `admin`: everything, operator accounts included.

Tokens are `gpo_<token id>.<secret>`; only SHA-256 of the secret is kept (as for API keys) and
the plaintext exists only in the answer that created it. Every token expires. A rotation issues
a successor and leaves the old token valid for a grace period (compare-and-swap on
`replaced_by IS NULL`, as for API keys); revoking an account ends all its tokens at once.

The bootstrap token (`settings.operator_token`, the data dir's `operator_token`) is the first
admin, named `bootstrap`: it is not in the database (it must work on an empty one, and the
settings, not an API call, say what it is), and the name can never be taken by an account.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.db import rowcount
from gpucloud.models.operator_roles import Role
from gpucloud.models.tables import MAX_OPERATOR_TOKEN_LIFETIME, Operator, OperatorToken, utcnow
from gpucloud.services.api_keys import hash_secret, is_live

BOOTSTRAP = "bootstrap"
TOKEN_PREFIX = "gpo_"
MAX_LIFETIME = MAX_OPERATOR_TOKEN_LIFETIME


class OperatorExists(Exception):
    """The name is taken (now or once: names are never reused), or is the bootstrap's."""


class OperatorNotFound(LookupError):
    pass


class TokenNotRotatable(Exception):
    """The account is revoked, or has no live token left to rotate."""


def _new_token(session: Session, name: str, *, lifetime: timedelta, now: datetime) -> tuple[OperatorToken, str]:
    token_id = "opt_" + secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    token = OperatorToken(
        id=token_id, operator=name, secret_hash=hash_secret(secret), created_at=now, expires_at=now + lifetime
    )
    session.add(token)
    return token, f"{TOKEN_PREFIX}{token_id}.{secret}"


def create(
    session: Session, name: str, role: Role, *, created_by: str, lifetime: timedelta, now: datetime | None = None
) -> tuple[Operator, OperatorToken, str]:
    """A new account and its first token (the plaintext is returned once and never stored)."""
    now = now or utcnow()
    if name == BOOTSTRAP or session.get(Operator, name) is not None:
        raise OperatorExists(f"name: an operator named {name!r} exists or existed; names are never reused")
    account = Operator(name=name, role=role, created_at=now, created_by=created_by)
    session.add(account)
    token, plaintext = _new_token(session, name, lifetime=lifetime, now=now)
    session.flush()
    return account, token, plaintext


def get(session: Session, name: str) -> Operator:
    account = session.get(Operator, name)
    if account is None:
        raise OperatorNotFound(name)
    return account


def role_of(session: Session, name: str) -> str:
    """The role of the operator `name` (an authenticated one: its account exists); the
    bootstrap operator, which has no account, is an admin."""
    if name == BOOTSTRAP:
        return Role.ADMIN.value
    return session.exec(select(col(Operator.role)).where(col(Operator.name) == name)).one()


def tokens(session: Session, name: str) -> list[OperatorToken]:
    query = select(OperatorToken).where(col(OperatorToken.operator) == name).order_by(col(OperatorToken.created_at))
    return list(session.exec(query).all())


def rotate(
    session: Session, name: str, *, grace: timedelta, lifetime: timedelta, now: datetime | None = None
) -> tuple[OperatorToken, OperatorToken, str]:
    """A successor for the account's newest live token; the old one stays valid for `grace`
    (never longer than it had left). (old, new, plaintext)."""
    now = now or utcnow()
    account = get(session, name)
    if account.revoked_at is not None:
        raise TokenNotRotatable(f"operator {name} is revoked; create another account")
    live = [t for t in tokens(session, name) if t.replaced_by is None and is_live(t.revoked_at, t.expires_at, now)]
    if not live:
        raise TokenNotRotatable(f"operator {name} has no live token to rotate (expired); revoke it and create another")
    old = live[-1]
    new, plaintext = _new_token(session, name, lifetime=lifetime, now=now)
    session.flush()
    result = session.execute(
        sa.update(OperatorToken)
        .where(
            col(OperatorToken.id) == old.id,
            col(OperatorToken.replaced_by).is_(None),
            col(OperatorToken.revoked_at).is_(None),
        )
        .values(replaced_by=new.id, expires_at=min(old.expires_at, now + grace))
    )
    if rowcount(result) != 1:
        raise TokenNotRotatable(f"operator {name}'s token {old.id} was rotated meanwhile")
    session.refresh(old)
    return old, new, plaintext


def revoke(session: Session, name: str, *, now: datetime | None = None) -> Operator:
    """End the account and every token of it now (idempotent: the first revocation time stays)."""
    now = now or utcnow()
    account = get(session, name)
    session.execute(
        sa.update(OperatorToken)
        .where(col(OperatorToken.operator) == name, col(OperatorToken.revoked_at).is_(None))
        .values(revoked_at=now)
    )
    if account.revoked_at is None:
        account.revoked_at = now
        session.add(account)
    session.flush()
    return account
