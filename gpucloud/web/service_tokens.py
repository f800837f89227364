"""Tokens the control plane signs for the servers it calls, verified offline by each server.

One mechanism for every hop from the control plane to a component that tenants can reach: a
JWT (RFC 7519, PyJWT) signed with the control plane's Ed25519 issuer key, naming the caller
(`sub`), its `role`, the one server it is for (`aud`, e.g. `agent:<node id>`) and a short
expiry. A server holds only the public half, so a tenant with root on a node can read
everything the node's agent holds and still mint nothing; and because each token names one
node, a token captured on a node a tenant rents opens no other node.

The issuer key is kept 0600 in the control plane's data dir (`issuer_key.pem`), its public half
beside it (`issuer_key.pub`), which is what agents are given (`gpucloud agent --control-plane-key`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from starlette.responses import JSONResponse
from typing_extensions import TypedDict, Unpack

from gpucloud.config import load_or_create_secret
from gpucloud.web import problems

ISSUER = "gpucloud-control-plane"
ALGORITHM = "EdDSA"
DEFAULT_TTL_S = 300.0
LEEWAY_S = 30  # clock skew allowed between the control plane and a server


class InvalidToken(Exception):
    """Not a token the control plane signed for this server, or no longer valid."""


@dataclass(frozen=True)
class Claims:
    subject: str
    role: str
    audience: str
    expires_at: float
    tenant: str | None = None
    allocation: str | None = None


LEDGER_AUDIENCE = "ledger"
TRACKER_AUDIENCE = "tracker"
SWARM_MEMBER = "swarm-member"
"""The role of a node's token for one fan-out at the tracker and the origin. It names the node
(`sub`), its tenant and the allocation it held when the token was minted; the tracker and the
origin honour it only while the control-plane DB still has the node in that allocation, and only
for that node. The node sends it nowhere else, so no other node ever sees it to replay it."""
SWARM_PEER = "swarm-peer"
"""The role of the token a node shows the tenant's peers when it fetches a chunk from them. Every
peer it asks sees it, so it opens peers only: replayed to the tracker or the origin (as the node
it names) it is refused."""
SWARM_TOKEN_TTL_S = 600.0
"""Both swarm tokens' lifetime. A member token stops at once when its node leaves the allocation
(the tracker reads the DB); a peer token is checked offline, so its life bounds how long a node
that left can still fetch from its former peers. A longer prefetch is retried with fresh ones."""


def agent_audience(node_id: str) -> str:
    return f"agent:{node_id}"


def swarm_audience(swarm: str) -> str:
    """The audience of a node's tokens for one rollout's fan-out (its swarm)."""
    return f"swarm:{swarm}"


def swarm_node(claims: Claims) -> str | None:
    """The node a swarm token was minted for (None: not a node's token)."""
    node = claims.subject.removeprefix("node:")
    return node if node != claims.subject else None


class MintOptions(TypedDict, total=False):
    subject: str  # the caller named (default: the control plane)
    role: str  # what it may do (default: control-plane)
    tenant: str | None  # the tenant a swarm token is scoped to
    allocation: str | None  # the allocation a swarm token's node is in
    ttl_s: float | None  # the lifetime (default: the issuer's)


class Issuer:
    """Mints tokens; only the control plane holds one. Tokens are cached per audience and
    re-minted a minute before they expire."""

    def __init__(
        self, private_key: Ed25519PrivateKey, *, ttl_s: float = DEFAULT_TTL_S, key_path: Path | None = None
    ) -> None:
        self._key = private_key
        self.key_path = key_path  # where the key is kept, if in a file
        self.ttl_s = ttl_s
        self._cache: dict[tuple[str, str, str, str, str], tuple[str, float]] = {}

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def mint(self, audience: str, **options: Unpack[MintOptions]) -> str:
        return self.mint_until(audience, **options)[0]

    def mint_until(
        self,
        audience: str,
        *,
        subject: str = "control-plane",
        role: str = "control-plane",
        tenant: str | None = None,
        allocation: str | None = None,
        ttl_s: float | None = None,
    ) -> tuple[str, float]:
        """A token and when it expires (Unix seconds); one minted earlier while more than half
        its lifetime is left."""
        now = time.time()
        ttl = ttl_s or self.ttl_s
        key = (audience, role, subject, tenant or "", allocation or "")
        cached = self._cache.get(key)
        if cached is not None and cached[1] - now > ttl / 2:
            return cached
        expires = now + ttl
        claims = {"iss": ISSUER, "sub": subject, "role": role, "aud": audience, "iat": int(now), "exp": int(expires)}
        if tenant is not None:
            claims["tenant"] = tenant
        if allocation is not None:
            claims["allocation"] = allocation
        token = jwt.encode(claims, self._key, algorithm=ALGORITHM)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[key] = (token, float(int(expires)))
        return token, float(int(expires))


class Verifier:
    """Checks tokens against the control plane's public key, offline."""

    def __init__(self, public_key: Ed25519PublicKey) -> None:
        self._key = public_key
        # Tokens already verified, until they expire: a caller repeats its token for minutes,
        # and a signature check costs far more than a lookup.
        self._verified: dict[tuple[str, str], Claims] = {}

    def verify(self, token: str, *, audience: str, roles: tuple[str, ...] = ("control-plane",)) -> Claims:
        known = self._verified.get((token, audience))
        if known is not None and known.expires_at + LEEWAY_S > time.time():
            if known.role not in roles:
                raise InvalidToken(f"role {known.role!r} may not call {audience}")
            return known
        claims = self._verify(token, audience=audience, roles=roles)
        if len(self._verified) > 100_000:
            self._verified.clear()
        self._verified[(token, audience)] = claims
        return claims

    def _verify(self, token: str, *, audience: str, roles: tuple[str, ...]) -> Claims:
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=[ALGORITHM],
                audience=audience,
                issuer=ISSUER,
                leeway=LEEWAY_S,
                options={"require": ["exp", "aud", "iss", "sub"]},
            )
        except jwt.PyJWTError as exc:
            raise InvalidToken(str(exc)) from exc
        if claims.get("role") not in roles:
            raise InvalidToken(f"role {claims.get('role')!r} may not call {audience}")
        tenant, allocation = claims.get("tenant"), claims.get("allocation")
        return Claims(
            subject=claims["sub"],
            role=claims["role"],
            audience=audience,
            expires_at=float(claims["exp"]),
            tenant=tenant if isinstance(tenant, str) else None,
            allocation=allocation if isinstance(allocation, str) else None,
        )

    def check_header(
        self, authorization: str | None, *, audience: str, roles: tuple[str, ...] = ("control-plane",)
    ) -> Claims:
        """The claims of an `Authorization: Bearer <token>` header."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise InvalidToken("no bearer token")
        return self.verify(token.strip(), audience=audience, roles=roles)


def refusal_reason(verifier: Verifier | None, authorization: str | None, *, node_id: str) -> str | None:
    """Why a node's agent refuses a call without the control plane's token for that node; None
    when the call may go on (or when there is no `verifier`: an unchecked fleet)."""
    if verifier is None:
        return None
    try:
        verifier.check_header(authorization, audience=agent_audience(node_id))
    except InvalidToken as exc:
        return f"only the control plane calls the agent of {node_id} ({exc})"
    return None


def refusal(verifier: Verifier | None, authorization: str | None, *, node_id: str) -> JSONResponse | None:
    """The 401 a node's agent answers such a call (`refusal_reason`), or None."""
    reason = refusal_reason(verifier, authorization, node_id=node_id)
    return problems.unauthenticated(reason) if reason is not None else None


def load_or_create_issuer(path: Path) -> Issuer:
    """The issuer key kept at `path` (created 0600 the first time, its public half beside it)."""
    pem = load_or_create_secret(path, lambda: _new_private_pem().decode())
    key = serialization.load_pem_private_key(pem.encode(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    public = public_key_path(path)
    if not public.exists():
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
    return Issuer(key, key_path=path)


def _new_private_pem() -> bytes:
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def public_key_path(issuer_key_path: Path) -> Path:
    return issuer_key_path.with_suffix(".pub")


def load_verifier(public_key_file: Path) -> Verifier:
    key = serialization.load_pem_public_key(public_key_file.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{public_key_file} is not an Ed25519 public key")
    return Verifier(key)
