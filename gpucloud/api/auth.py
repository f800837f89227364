"""Callers: a tenant's API key (`gpc_<key id>.<secret>`, see `services.api_keys`), a node's
agent credential (`gpa_<node id>.<secret>`, see `services.agent_credentials`) or the operator
token. A revoked key, or a rotated one past its grace period, resolves to no one."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from sqlmodel import Session

from gpucloud.models.tables import AgentCredential, ApiKey, utcnow
from gpucloud.services.api_keys import hash_secret, is_valid


@dataclass(frozen=True)
class Caller:
    role: str  # "operator" | "tenant" | "agent"
    tenant_id: str | None = None
    node_id: str | None = None  # an agent's node

    @property
    def id(self) -> str:
        if self.role == "agent":
            return f"agent:{self.node_id}"
        return "operator" if self.role == "operator" else f"tenant:{self.tenant_id}"

    @property
    def is_tenant(self) -> bool:
        return self.role == "tenant" and self.tenant_id is not None

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"


@dataclass(frozen=True)
class TenantCaller(Caller):
    """A caller known to act for a tenant (what `TenantDep` hands a handler)."""

    role: str = "tenant"
    tenant_id: str = ""


def resolve(session: Session, token: str, operator_token: str) -> Caller | None:
    if hmac.compare_digest(token.encode(), operator_token.encode()):
        return Caller(role="operator")
    if token.startswith("gpa_") and "." in token:
        node_id, secret = token[4:].rsplit(".", 1)
        credential = session.get(AgentCredential, node_id)
        if credential is None or not hmac.compare_digest(credential.secret_hash, hash_secret(secret)):
            return None
        return Caller(role="agent", node_id=node_id)
    if not token.startswith("gpc_") or "." not in token:
        return None
    key_id, secret = token[4:].split(".", 1)
    key = session.get(ApiKey, key_id)
    if key is None or not is_valid(key, utcnow()):
        return None
    if not hmac.compare_digest(key.secret_hash, hash_secret(secret)):
        return None
    return Caller(role="tenant", tenant_id=key.tenant_id)
