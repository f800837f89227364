"""Tokens the control plane signs for the servers it calls, verified offline by each server.

One mechanism for every hop from the control plane to a component that tenants can reach: a
JWT (RFC 7519, PyJWT) signed with the control plane's Ed25519 issuer key, naming the caller
(`sub`), its `role`, the one server it is for (`aud`, e.g. `agent:<node id>`) and a short
expiry. A server holds only the public half, so a tenant with root on a node can read
everything the node's agent holds and still mint nothing; and because each token names one
node, a token captured on a node a tenant rents opens no other node.

The issuer key is kept 0600 in the control plane's data dir (`issuer_key.pem`), its public half
beside it (`issuer_key.pub`), which is what agents are given (`gpucloud agent --control-plane-key`).

Only the workers (and `gpucloud up`, `gpucloud issue-delegate`) hold the issuer key; they are not
reachable from the internet. An API process, which is, holds a delegate instead: its own Ed25519
key and a certificate the issuer key signed for it (a JWT: the delegate's public key, the
audiences and roles it may mint for, an expiry), kept together in one file (`issue_delegate`).
Every token a delegate mints carries its certificate in the JWT header (`dlg`), and a verifier,
which knows only the issuer's public key, checks the certificate, then the token against the key
it certifies, then that the token's audience and role are among those it allows. So an API
process taken over can mint ledger tokens until its certificate expires, and nothing for agents,
the tracker or swarms.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from starlette.responses import JSONResponse
from typing_extensions import TypedDict, Unpack

from gpucloud.config import load_or_create_secret, write_private
from gpucloud.web import problems

ISSUER = "gpucloud-control-plane"
log = logging.getLogger(__name__)
ALGORITHM = "EdDSA"
DEFAULT_TTL_S = 300.0
LEEWAY_S = 30  # clock skew allowed between the control plane and a server
DELEGATION_AUDIENCE = "gpucloud-delegation"  # a certificate's `aud`: no server takes it as a token
DELEGATION_HEADER = "dlg"  # the JWT header a delegate's token carries its certificate in
_CERTIFICATE_BEGIN = "-----BEGIN GPUCLOUD DELEGATE CERTIFICATE-----"
_CERTIFICATE_END = "-----END GPUCLOUD DELEGATE CERTIFICATE-----"


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
    model: str | None = None  # a registry-read token's model
    versions: tuple[str, ...] = ()  # the version digests a registry-read token opens


@dataclass(frozen=True)
class Delegation:
    """What a certificate the issuer signed lets its delegate's key mint, and until when."""

    public_key: Ed25519PublicKey
    audiences: frozenset[str]
    roles: frozenset[str]
    expires_at: float


LEDGER_AUDIENCE = "ledger"
REGISTRY_READ_AUDIENCE = "registry-read"
"""The API's audience for the token an evaluation pulls with: role `EVALUATION`, naming the
tenant, the model and the versions (the one evaluated and the parent it is compared with) whose
manifests and chunks it may read, and nothing else. Only the issuer key mints it (the workers):
the API's delegate is not certified for it."""
EVALUATION = "evaluation"
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


LOG_READER = "log-reader"
"""The role of a token that reads one node's workload output and nothing else (`agent_logs_audience`):
what the API mints with its delegate to serve a tenant's `.../logs`. It opens no action, no
weights and no peer route, and names one node, so a token captured there opens no other."""
AGENT_LOGS_AUDIENCES = "agent-logs:*"
"""What a delegate's certificate lists to mint `agent_logs_audience` tokens for every node."""


def agent_logs_audience(node_id: str) -> str:
    return f"agent-logs:{node_id}"


def _allows(audiences: frozenset[str], audience: str) -> bool:
    """Whether a certificate's `audiences` hold `audience`: by name, or as `<family>:*`, every
    audience of that family (`agent-logs:*`: each node's output)."""
    family, sep, _ = audience.partition(":")
    return audience in audiences or (bool(sep) and f"{family}:*" in audiences)


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
    model: str | None  # the model a registry-read token opens
    versions: tuple[str, ...]  # the versions a registry-read token opens
    ttl_s: float | None  # the lifetime (default: the issuer's)


class Minter(Protocol):
    """What signs a caller's tokens: the issuer key (`Issuer`) or an API's delegate (`DelegateFile`)."""

    def mint(self, audience: str, **options: Unpack[MintOptions]) -> str: ...

    def mint_until(self, audience: str, **options: Unpack[MintOptions]) -> tuple[str, float]: ...


class Issuer:
    """Mints tokens: with the issuer key (the workers), or with a delegate's key and the
    `certificate` the issuer key signed for it (an API process). Tokens are cached per audience
    and re-minted once half their lifetime is gone."""

    def __init__(
        self,
        private_key: Ed25519PrivateKey,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        key_path: Path | None = None,
        certificate: str | None = None,
    ) -> None:
        self._key = private_key
        self.key_path = key_path  # where the key is kept, if in a file
        self.ttl_s = ttl_s
        self.certificate = certificate
        self._cache: dict[tuple[str, str, str, str, str, str, tuple[str, ...]], tuple[str, float]] = {}

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
        model: str | None = None,
        versions: tuple[str, ...] = (),
        ttl_s: float | None = None,
    ) -> tuple[str, float]:
        """A token and when it expires (Unix seconds); one minted earlier while more than half
        its lifetime is left."""
        now = time.time()
        ttl = ttl_s or self.ttl_s
        key = (audience, role, subject, tenant or "", allocation or "", model or "", versions)
        cached = self._cache.get(key)
        if cached is not None and cached[1] - now > ttl / 2:
            return cached
        expires = now + ttl
        claims = {"iss": ISSUER, "sub": subject, "role": role, "aud": audience, "iat": int(now), "exp": int(expires)}
        if tenant is not None:
            claims["tenant"] = tenant
        if allocation is not None:
            claims["allocation"] = allocation
        if model is not None:
            claims["model"] = model
        if versions:
            claims["versions"] = list(versions)
        headers = {DELEGATION_HEADER: self.certificate} if self.certificate is not None else None
        token = jwt.encode(claims, self._key, algorithm=ALGORITHM, headers=headers)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[key] = (token, float(int(expires)))
        return token, float(int(expires))

    def certify(
        self, delegate: Ed25519PublicKey, *, name: str, audiences: tuple[str, ...], roles: tuple[str, ...], ttl_s: float
    ) -> str:
        """A certificate letting `delegate` mint tokens for `audiences` in `roles` for `ttl_s`;
        only the issuer key certifies (a delegate's certificate would not verify)."""
        if self.certificate is not None:
            raise ValueError("a delegate cannot certify another key: only the issuer key can")
        now = time.time()
        raw = delegate.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        claims = {
            "iss": ISSUER,
            "aud": DELEGATION_AUDIENCE,
            "sub": name,
            "key": base64.urlsafe_b64encode(raw).decode(),
            "audiences": list(audiences),
            "roles": list(roles),
            "iat": int(now),
            "exp": int(now + ttl_s),
        }
        return jwt.encode(claims, self._key, algorithm=ALGORITHM)


class Verifier:
    """Checks tokens against the control plane's public key, offline: signed by the issuer key,
    or by a delegate whose certificate (in the token's header) the issuer key signed, which has
    not expired and allows the token's audience and role."""

    def __init__(self, public_key: Ed25519PublicKey) -> None:
        self._key = public_key
        # Tokens already verified, until they expire: a caller repeats its token for minutes,
        # and a signature check costs far more than a lookup.
        self._verified: dict[tuple[str, str], Claims] = {}
        self._delegations: dict[str, Delegation] = {}  # certificates already checked

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
            certificate = jwt.get_unverified_header(token).get(DELEGATION_HEADER)
            delegation = None if certificate is None else self._delegation(certificate)
            claims = jwt.decode(
                token,
                self._key if delegation is None else delegation.public_key,
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
        expires_at = float(claims["exp"])
        if delegation is not None:
            if not _allows(delegation.audiences, audience) or claims["role"] not in delegation.roles:
                raise InvalidToken(
                    f"the delegate's certificate does not allow {claims['role']!r} tokens for {audience}"
                )
            expires_at = min(expires_at, delegation.expires_at)  # the certificate's end ends its tokens
        tenant, allocation, model = claims.get("tenant"), claims.get("allocation"), claims.get("model")
        versions = claims.get("versions")
        return Claims(
            subject=claims["sub"],
            role=claims["role"],
            audience=audience,
            expires_at=expires_at,
            tenant=tenant if isinstance(tenant, str) else None,
            allocation=allocation if isinstance(allocation, str) else None,
            model=model if isinstance(model, str) else None,
            versions=tuple(v for v in versions if isinstance(v, str)) if isinstance(versions, list) else (),
        )

    def _delegation(self, certificate: object) -> Delegation:
        """The delegation a certificate grants, once the issuer key's signature and its expiry
        are checked (`jwt.PyJWTError` else)."""
        if not isinstance(certificate, str):
            raise jwt.InvalidTokenError("the delegate certificate is not a string")
        known = self._delegations.get(certificate)
        if known is not None and known.expires_at + LEEWAY_S > time.time():
            return known
        try:
            claims = jwt.decode(
                certificate,
                self._key,
                algorithms=[ALGORITHM],
                audience=DELEGATION_AUDIENCE,
                issuer=ISSUER,
                leeway=LEEWAY_S,
                options={"require": ["exp", "aud", "iss", "sub"]},
            )
        except jwt.PyJWTError as exc:
            raise jwt.InvalidTokenError(f"delegate certificate: {exc}") from exc
        try:
            key = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(claims["key"]))
            delegation = Delegation(
                public_key=key,
                audiences=frozenset(claims["audiences"]),
                roles=frozenset(claims["roles"]),
                expires_at=float(claims["exp"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise jwt.InvalidTokenError(f"delegate certificate: malformed ({exc})") from exc
        if len(self._delegations) > 1000:
            self._delegations.clear()
        self._delegations[certificate] = delegation
        return delegation

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


def logs_refusal_reason(verifier: Verifier | None, authorization: str | None, *, node_id: str) -> str | None:
    """Why a node's agent refuses to hand over its workload's output: neither a log reader's token
    for that node nor the control plane's own; None when it may (or there is no `verifier`)."""
    if verifier is None:
        return None
    try:
        verifier.check_header(authorization, audience=agent_logs_audience(node_id), roles=(LOG_READER,))
        return None
    except InvalidToken:
        return refusal_reason(verifier, authorization, node_id=node_id)


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


def issue_delegate(
    issuer: Issuer, path: Path, *, name: str, audiences: tuple[str, ...], roles: tuple[str, ...], ttl_s: float
) -> None:
    """Write to `path` (0600) a new delegate key and the certificate `issuer` signs for it."""
    key = Ed25519PrivateKey.generate()
    certificate = issuer.certify(key.public_key(), name=name, audiences=audiences, roles=roles, ttl_s=ttl_s)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private(path, pem.decode() + f"{_CERTIFICATE_BEGIN}\n{certificate}\n{_CERTIFICATE_END}\n")


def load_delegate(path: Path) -> Issuer:
    """The delegate kept at `path` (`issue_delegate`); ValueError if it is not one, or its
    certificate has expired (tokens it minted would all be refused)."""
    text = path.read_text()
    pem, begin, rest = text.partition(_CERTIFICATE_BEGIN)
    certificate = rest.partition(_CERTIFICATE_END)[0].strip()
    if not begin or not certificate:
        raise ValueError(f"{path} holds no delegate certificate (make one with `gpucloud issue-delegate`)")
    key = serialization.load_pem_private_key(pem.encode(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    # Not verified here: this process holds no issuer key to check it with, and every verifier will.
    expires_at = jwt.decode(certificate, options={"verify_signature": False})["exp"]
    if expires_at <= time.time():
        raise ValueError(f"the delegate certificate in {path} expired; issue a new one (`gpucloud issue-delegate`)")
    return Issuer(key, key_path=path, certificate=certificate)


class DelegateFile:
    """An API process's delegate, kept in step with its file: `gpucloud prepare` (or
    `issue-delegate`) writing a new one takes effect within `check_every_s`, without a restart,
    so a certificate that runs out is replaced rather than waited on. Mints as `Issuer` does."""

    def __init__(self, path: Path, *, check_every_s: float = 10.0) -> None:
        self.path, self.check_every_s = path, check_every_s
        self._issuer = load_delegate(path)  # the first load's error stops the process: nothing to sign with
        self._stat = path.stat().st_mtime_ns
        self._checked = time.monotonic()

    @property
    def expires_at(self) -> float:
        """When its certificate ends (Unix seconds)."""
        claims = jwt.decode(self._current().certificate or "", options={"verify_signature": False})
        return float(claims["exp"])

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._current().public_key

    @property
    def certificate(self) -> str | None:
        return self._current().certificate

    def mint(self, audience: str, **options: Unpack[MintOptions]) -> str:
        return self._current().mint(audience, **options)

    def mint_until(self, audience: str, **options: Unpack[MintOptions]) -> tuple[str, float]:
        return self._current().mint_until(audience, **options)

    def _current(self) -> Issuer:
        now = time.monotonic()
        if now - self._checked >= self.check_every_s:
            self._checked = now
            try:
                changed = self.path.stat().st_mtime_ns != self._stat
                if changed:
                    self._issuer, self._stat = load_delegate(self.path), self.path.stat().st_mtime_ns
            except (OSError, ValueError) as exc:  # half-written or removed: keep the one we have
                log.warning("keeping the API's delegate: %s could not be read again (%s)", self.path, exc)
        return self._issuer


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
