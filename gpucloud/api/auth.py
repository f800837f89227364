"""Callers: a tenant's API key (`gpc_<key id>.<secret>`, see `services.api_keys`) or the
operator token. A revoked key, or a rotated one past its grace period, resolves to no one."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from sqlmodel import Session

from gpucloud.models.tables import ApiKey, utcnow
from gpucloud.services.api_keys import hash_secret, is_valid


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


def resolve(session: Session, token: str, operator_token: str) -> Caller | None:
    if hmac.compare_digest(token.encode(), operator_token.encode()):
        return Caller(role="operator")
    if not token.startswith("gpc_") or "." not in token:
        return None
    key_id, secret = token[4:].split(".", 1)
    key = session.get(ApiKey, key_id)
    if key is None or not is_valid(key, utcnow()):
        return None
    if not hmac.compare_digest(key.secret_hash, hash_secret(secret)):
        return None
    return Caller(role="tenant", tenant_id=key.tenant_id)
