"""The web console's sessions (`models.tables.ConsoleSession`): open one for a credential that
was just checked, find who a session is on each request (checking the credential again, so a
revoked or rotated key ends it), close one.

The browser's cookie holds a random session id; the table holds its SHA-256 only. The session
names the credential (an API key's id, an operator token's id, or the bootstrap token) and the
hash of its secret, never the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col

from gpucloud.models.tables import ApiKey, ConsoleSession, Operator, OperatorToken, utcnow
from gpucloud.services.api_keys import hash_secret, is_live

BOOTSTRAP = "bootstrap"  # the credential id of a session opened with the bootstrap operator token

_FIND = (
    sa.select(
        col(ConsoleSession.role),
        col(ConsoleSession.credential_id),
        col(ConsoleSession.credential_hash),
        col(ConsoleSession.csrf_token),
        col(ConsoleSession.expires_at),
        col(ApiKey.tenant_id),
        col(ApiKey.secret_hash),
        col(ApiKey.revoked_at),
        col(ApiKey.expires_at),
        col(OperatorToken.operator),
        col(OperatorToken.secret_hash),
        col(OperatorToken.revoked_at),
        col(OperatorToken.expires_at),
        col(Operator.role),
        col(Operator.revoked_at),
    )
    .select_from(ConsoleSession)
    .outerjoin(
        ApiKey, sa.and_(col(ConsoleSession.role) == "tenant", col(ApiKey.id) == col(ConsoleSession.credential_id))
    )
    .outerjoin(
        OperatorToken,
        sa.and_(col(ConsoleSession.role) == "operator", col(OperatorToken.id) == col(ConsoleSession.credential_id)),
    )
    .outerjoin(Operator, col(Operator.name) == col(OperatorToken.operator))
    .where(col(ConsoleSession.id_hash) == sa.bindparam("id_hash"))
)


@dataclass(frozen=True)
class Principal:
    """Who a live session is: a tenant (its key) or an operator (its name and role; the
    bootstrap token is the admin `bootstrap`)."""

    role: str
    credential_id: str
    csrf_token: str
    tenant_id: str | None = None
    operator: str | None = None
    operator_role: str | None = None


def id_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def open_session(
    session: Session,
    *,
    role: str,
    credential_id: str,
    secret: str,
    tenant_id: str | None,
    ttl: timedelta,
    now: datetime | None = None,
) -> tuple[str, str]:
    """Record a session for a credential the caller has just checked: (session id, CSRF token).
    Sessions past their expiry are removed on the way."""
    now = now or utcnow()
    session.execute(sa.delete(ConsoleSession).where(col(ConsoleSession.expires_at) <= now))
    session_id, csrf_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    session.add(
        ConsoleSession(
            id_hash=id_hash(session_id),
            role=role,
            credential_id=credential_id,
            credential_hash=hash_secret(secret),
            tenant_id=tenant_id,
            csrf_token=csrf_token,
            created_at=now,
            expires_at=now + ttl,
        )
    )
    return session_id, csrf_token


def find(db: sa.Connection, session_id: str, *, bootstrap_token: str, now: datetime | None = None) -> Principal | None:
    """Who the session is, if it is live and so is its credential; None otherwise."""
    row: Any = db.execute(_FIND, {"id_hash": id_hash(session_id)}).first()
    now = now or utcnow()
    if row is None or row[4] <= now:
        return None
    role, credential_id, credential_hash, csrf_token = row[0], row[1], row[2], row[3]
    if role == "tenant":
        tenant_id, key_hash, revoked_at, expires_at = row[5:9]
        if key_hash is None or not is_live(revoked_at, expires_at, now):
            return None
        if not hmac.compare_digest(key_hash, credential_hash):
            return None
        return Principal(role, credential_id, csrf_token, tenant_id=tenant_id)
    if credential_id == BOOTSTRAP:
        if not hmac.compare_digest(hash_secret(bootstrap_token), credential_hash):
            return None  # the bootstrap token was changed since
        return Principal(role, credential_id, csrf_token, operator=BOOTSTRAP, operator_role="admin")
    operator, token_hash, revoked_at, expires_at, operator_role, operator_revoked_at = row[9:15]
    if token_hash is None or operator_revoked_at is not None or not is_live(revoked_at, expires_at, now):
        return None
    if not hmac.compare_digest(token_hash, credential_hash):
        return None
    return Principal(role, credential_id, csrf_token, operator=operator, operator_role=operator_role)


def close(session: Session, session_id: str) -> None:
    session.execute(sa.delete(ConsoleSession).where(col(ConsoleSession.id_hash) == id_hash(session_id)))
