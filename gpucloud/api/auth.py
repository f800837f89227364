"""Callers: a tenant's API key (`gpc_<key id>.<secret>`, see `services.api_keys`), a node's
agent credential (`gpa_<node id>.<secret>`, see `services.agent_credentials`), a named
operator's token (`gpo_<token id>.<secret>`, see `services.operators`), the bootstrap operator
token (the admin named `bootstrap`), or an evaluation's registry-read token (a JWT the issuer key
signed, `web/service_tokens.py`: it reads one tenant's versions named in it, see
`scoped_caller`). A revoked key, agent credential or operator token, or a rotated one past its
grace period, resolves to no one."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import sqlalchemy as sa
from sqlmodel import col, select

from gpucloud.models.operator_roles import ROLE_SCOPES, Role, Scope
from gpucloud.models.tables import AgentCredential, ApiKey, Operator, OperatorToken, utcnow
from gpucloud.services import operators
from gpucloud.services.api_keys import hash_secret, is_live
from gpucloud.web.service_tokens import EVALUATION, REGISTRY_READ_AUDIENCE, InvalidToken, Verifier

# Core selects of the columns a check needs: a credential is checked on every request, and the
# ORM's identity map and objects would cost several times the read itself.
# A revoked credential (its node's allocation ended, no wipe since) resolves to no one.
_AGENT_SECRET = select(col(AgentCredential.secret_hash)).where(
    col(AgentCredential.node_id) == sa.bindparam("id"), col(AgentCredential.revoked_at).is_(None)
)
_API_KEY = select(col(ApiKey.tenant_id), col(ApiKey.secret_hash), col(ApiKey.revoked_at), col(ApiKey.expires_at)).where(
    col(ApiKey.id) == sa.bindparam("id")
)
_OPERATOR_TOKEN = (
    sa.select(
        col(OperatorToken.operator),
        col(Operator.role),
        col(OperatorToken.secret_hash),
        col(OperatorToken.revoked_at),
        col(OperatorToken.expires_at),
    )
    .join(Operator, col(Operator.name) == col(OperatorToken.operator))
    # A revoked account's tokens are no one's, whatever a rotation racing the revocation wrote.
    .where(col(OperatorToken.id) == sa.bindparam("id"), col(Operator.revoked_at).is_(None))
)
_BOOTSTRAP_SCOPES = ROLE_SCOPES[Role.ADMIN]


@dataclass(frozen=True)
class Caller:
    # "operator" | "tenant" | "agent" | "evaluation" | "enrollment" (a re-imaged node's image) |
    # "visitor" (the web console before sign-in: its sign-in page and static files only)
    role: str
    tenant_id: str | None = None
    node_id: str | None = None  # an agent's node
    operator: str | None = None  # an operator's account name
    scopes: frozenset[Scope] = frozenset()  # what an operator's role allows
    key_id: str | None = None  # the API key a tenant called with
    model: str | None = None  # the model an evaluation's token reads
    versions: frozenset[str] = frozenset()  # the version digests an evaluation's token reads

    @property
    def id(self) -> str:
        """Who calls, as idempotency records and admission count them (`operator:<name>`, a
        tenant's keys all as one `tenant:<id>`, ...)."""
        if self.role in ("agent", "enrollment"):
            return f"{self.role}:{self.node_id}"
        if self.role == "visitor":
            return "visitor"  # every console visitor shares one caller's share of the tenants' lane
        return f"operator:{self.operator}" if self.role == "operator" else f"tenant:{self.tenant_id}"

    @property
    def actor(self) -> str:
        """Who acted, as operations and events record it: `id`, and for a tenant the key it
        used (`tenant:<id>/key:<key id>`), so a leaked key's doings can be told apart."""
        return f"{self.id}/key:{self.key_id}" if self.role == "tenant" and self.key_id else self.id

    @property
    def is_tenant(self) -> bool:
        return self.role == "tenant" and self.tenant_id is not None

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"

    @property
    def tenant_scope(self) -> str | None:
        """Whose rows it reads: None (everyone's) for an operator, else its tenant's."""
        return None if self.is_operator else (self.tenant_id or "")


@dataclass(frozen=True)
class TenantCaller(Caller):
    """A caller known to act for a tenant (what `TenantDep` hands a handler)."""

    role: str = "tenant"
    tenant_id: str = ""


def is_signed_token(token: str) -> bool:
    """A JWT (`header.claims.signature`, base64url): no API key, agent credential or operator
    token has that shape (theirs is `gp?_<id>.<secret>`)."""
    return token.startswith("eyJ") and token.count(".") == 2


def scoped_caller(token: str, verifier: Verifier | None) -> Caller | None:
    """The evaluation a registry-read token was minted for, checked offline against the issuer's
    public key (`verifier`; None: this API trusts none, and the token is no one)."""
    if verifier is None:
        return None
    try:
        claims = verifier.verify(token, audience=REGISTRY_READ_AUDIENCE, roles=(EVALUATION,))
    except InvalidToken:
        return None
    if not claims.tenant or not claims.model or not claims.versions:
        return None
    return Caller(role=EVALUATION, tenant_id=claims.tenant, model=claims.model, versions=frozenset(claims.versions))


def has_credential_shape(token: str, operator_token: str) -> bool:
    """Whether `token` could be a credential `resolve` knows (a key, an agent credential, an
    operator's token, the bootstrap token): anything else is no one, without a lookup."""
    prefixed = token.startswith(("gpc_", "gpa_", operators.TOKEN_PREFIX)) and "." in token
    return prefixed or hmac.compare_digest(token.encode(), operator_token.encode())


def resolve(db: sa.Connection, token: str, operator_token: str) -> Caller | None:
    """Who `token` is, read on the connection `db`; None for no one."""
    if hmac.compare_digest(token.encode(), operator_token.encode()):
        return Caller(role="operator", operator=operators.BOOTSTRAP, scopes=_BOOTSTRAP_SCOPES)
    if token.startswith(operators.TOKEN_PREFIX) and "." in token:
        return _operator(db, token)
    if token.startswith("gpa_") and "." in token:
        node_id, secret = token[4:].rsplit(".", 1)
        secret_hash = db.execute(_AGENT_SECRET, {"id": node_id}).scalar()
        if secret_hash is None or not hmac.compare_digest(secret_hash, hash_secret(secret)):
            return None
        return Caller(role="agent", node_id=node_id)
    if not token.startswith("gpc_") or "." not in token:
        return None
    key_id, secret = token[4:].split(".", 1)
    key = db.execute(_API_KEY, {"id": key_id}).first()
    if key is None:
        return None
    tenant_id, key_hash, revoked_at, expires_at = key
    if not is_live(revoked_at, expires_at, utcnow()):
        return None
    if not hmac.compare_digest(key_hash, hash_secret(secret)):
        return None
    return Caller(role="tenant", tenant_id=tenant_id, key_id=key_id)


def _operator(db: sa.Connection, token: str) -> Caller | None:
    token_id, secret = token[len(operators.TOKEN_PREFIX) :].split(".", 1)
    row = db.execute(_OPERATOR_TOKEN, {"id": token_id}).first()
    if row is None:
        return None
    name, role, secret_hash, revoked_at, expires_at = row
    if not is_live(revoked_at, expires_at, utcnow()) or not hmac.compare_digest(secret_hash, hash_secret(secret)):
        return None
    return Caller(role="operator", operator=name, scopes=ROLE_SCOPES[Role(role)])
