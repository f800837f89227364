"""API keys: issue, rotate, revoke. Keys are `gpc_<key id>.<secret>`; only SHA-256 of the secret
is kept (the secret is 256 random bits, so a slow hash buys nothing), and the plaintext exists
only in the response that created the key.

Rotation issues a new key and leaves the old one valid for a grace period (zero: not at all),
recorded as the old key's `expires_at` and `replaced_by`. A key is rotated once: the update is a
compare-and-swap on `replaced_by IS NULL`, so two concurrent rotations cannot both mint a
successor. Revocation ends a key at once, whatever its grace period said.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.db import rowcount
from gpucloud.models.tables import MAX_ROTATION_GRACE, ApiKey, utcnow

MAX_GRACE = MAX_ROTATION_GRACE


class KeyNotFound(LookupError):
    """No such key for this tenant (another tenant's key is not found either)."""


class KeyNotRotatable(Exception):
    """The key is revoked, expired or already rotated."""


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_key(session: Session, tenant_id: str) -> tuple[ApiKey, str]:
    """Create a key; the plaintext is returned once and never stored."""
    key_id = "key_" + secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    key = ApiKey(id=key_id, tenant_id=tenant_id, secret_hash=hash_secret(secret))
    session.add(key)
    return key, f"gpc_{key_id}.{secret}"


def is_valid(key: ApiKey, now: datetime) -> bool:
    return is_live(key.revoked_at, key.expires_at, now)


def is_live(revoked_at: datetime | None, expires_at: datetime | None, now: datetime) -> bool:
    """A key not revoked and, if it was rotated, still inside its grace period."""
    return revoked_at is None and (expires_at is None or expires_at > now)


def live_count(session: Session, tenant_id: str, now: datetime) -> int:
    """The tenant's keys that still authenticate (not revoked, not past a rotation's grace)."""
    expires = col(ApiKey.expires_at)
    live = (
        select(sa.func.count())
        .select_from(ApiKey)
        .where(col(ApiKey.tenant_id) == tenant_id, col(ApiKey.revoked_at).is_(None))
        .where(sa.or_(expires.is_(None), expires > now))
    )
    return session.exec(live).one()


def _get(session: Session, tenant_id: str, key_id: str) -> ApiKey:
    key = session.exec(select(ApiKey).where(col(ApiKey.id) == key_id, col(ApiKey.tenant_id) == tenant_id)).first()
    if key is None:
        raise KeyNotFound(key_id)
    return key


def key_of(session: Session, key_id: str) -> ApiKey:
    """The key a caller was authenticated with (it exists: the caller's credential named it)."""
    return session.exec(select(ApiKey).where(col(ApiKey.id) == key_id)).one()


def list_keys(session: Session, tenant_id: str) -> list[ApiKey]:
    return list(
        session.exec(select(ApiKey).where(col(ApiKey.tenant_id) == tenant_id).order_by(col(ApiKey.created_at))).all()
    )


def rotate_key(
    session: Session, tenant_id: str, key_id: str, *, grace: timedelta, now: datetime | None = None
) -> tuple[ApiKey, ApiKey, str]:
    """A successor for the key; the old one stays valid for `grace`. (old, new, plaintext)."""
    now = now or utcnow()
    old = _get(session, tenant_id, key_id)
    if old.replaced_by is not None:
        raise KeyNotRotatable(f"key {key_id} was already rotated; its successor is {old.replaced_by}")
    if not is_valid(old, now):
        raise KeyNotRotatable(f"key {key_id} is revoked or expired; create a new key instead")
    new, plaintext = issue_key(session, tenant_id)
    session.flush()
    result = session.execute(
        sa.update(ApiKey)
        .where(col(ApiKey.id) == key_id, col(ApiKey.replaced_by).is_(None), col(ApiKey.revoked_at).is_(None))
        .values(replaced_by=new.id, expires_at=now + grace)
    )
    if rowcount(result) != 1:
        raise KeyNotRotatable(f"key {key_id} was rotated or revoked meanwhile")
    session.refresh(old)
    return old, new, plaintext


def revoke_key(session: Session, tenant_id: str, key_id: str, *, now: datetime | None = None) -> ApiKey:
    """End the key now (idempotent: a revoked key keeps its first revocation time)."""
    key = _get(session, tenant_id, key_id)
    session.execute(
        sa.update(ApiKey)
        .where(col(ApiKey.id) == key_id, col(ApiKey.revoked_at).is_(None))
        .values(revoked_at=now or utcnow())
    )
    session.refresh(key)
    return key


def revoke_all(session: Session, tenant_id: str, *, now: datetime | None = None) -> int:
    """End every key of the tenant now; how many were still unrevoked."""
    result = session.execute(
        sa.update(ApiKey)
        .where(col(ApiKey.tenant_id) == tenant_id, col(ApiKey.revoked_at).is_(None))
        .values(revoked_at=now or utcnow())
    )
    return rowcount(result)
