"""API keys and callers. Keys are `gpc_<key id>.<secret>`; only SHA-256 of the secret is kept
(the secret is 256 random bits, so a slow hash buys nothing). Operators use the operator token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlmodel import Session

from gpucloud.models.tables import ApiKey


@dataclass(frozen=True)
class Caller:
    role: str  # "operator" | "tenant"
    tenant_id: str | None = None

    @property
    def id(self) -> str:
        return "operator" if self.role == "operator" else f"tenant:{self.tenant_id}"

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_key(session: Session, tenant_id: str) -> tuple[ApiKey, str]:
    """Create a key; the plaintext is returned once and never stored."""
    key_id = "key_" + secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    key = ApiKey(id=key_id, tenant_id=tenant_id, secret_hash=hash_secret(secret))
    session.add(key)
    return key, f"gpc_{key_id}.{secret}"


def resolve(session: Session, token: str, operator_token: str) -> Caller | None:
    if hmac.compare_digest(token.encode(), operator_token.encode()):
        return Caller(role="operator")
    if not token.startswith("gpc_") or "." not in token:
        return None
    key_id, secret = token[4:].split(".", 1)
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        return None
    if not hmac.compare_digest(key.secret_hash, hash_secret(secret)):
        return None
    return Caller(role="tenant", tenant_id=key.tenant_id)
