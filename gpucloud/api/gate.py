"""Who calls the API, before admission and before anything reads the request's body (the
shared gate, `web/gate.py`).

The gate runs first (outside admission): a request without valid credentials is answered 401
whatever its body holds (a malformed body from a stranger gets 401, not 422). The caller found
here is what admission shares slots by (a tenant with all its keys, a node, the operator: see
`api/admission.py`), and it is handed to the routes' auth dependency (`deps.get_any_caller`), so
credentials are looked up once a request. The body is read only when the route asks for it,
after admission gave the request its slot: up to a limit (413 past it) and within the read
deadline (408).

An evaluation's registry-read token (a JWT, `auth.scoped_caller`) is checked offline against the
issuer's public key (`control_plane_key`, read once it exists: the workers make the key) and is
not kept in that cache: the verifier remembers a token only until it expires, so an expired one
is refused at once.

Credentials are remembered for `api.credential_cache_s` seconds (token digest -> caller, unknown
tokens too), so a client that retries a refused request at once costs no database read and no
thread. A key revoked or rotated through an API process stops there at once; in the others (and
a rotated key past its grace, or a node credential a wipe replaced) it keeps working for at most
that long after the change.

Limits: `api.max_body_bytes` for every body, except a registry chunk upload, which streams to
disk, up to `registry.max_chunk_size`; the read deadline is `request_body`'s, as every server's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from pathlib import Path

from sqlalchemy import exc as sa_exc
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.api import auth
from gpucloud.api.admission import CREDENTIAL_LOOKUPS, OPEN_PATHS, basic_credentials, bearer_token
from gpucloud.config import RequestBodySettings
from gpucloud.console import session as console_session
from gpucloud.db import get_read_engine
from gpucloud.observability.logs import log_context
from gpucloud.services import agent_enrollment
from gpucloud.services.agent_enrollment import CONFIG_DRIVE_PATH, ENROLL_PATH
from gpucloud.web import gate, problems
from gpucloud.web.service_tokens import Verifier, load_verifier

log = logging.getLogger(__name__)

# A re-imaged node's enrollment: its one-time token, nothing else (`_enrolling`).
ENROLLMENT_PATHS = frozenset({CONFIG_DRIVE_PATH, ENROLL_PATH})
CHUNK_UPLOAD = re.compile(r"^/v1/models/[^/]+/chunks/[^/:]+$")
# Tokens remembered at most (a flood of made-up tokens evicts the oldest, never grows memory).
CACHED_CREDENTIALS = 10_000
# The longest a request waits for a credential lookup's turn before it is answered 503.
LOOKUP_WAIT_S = 2.0


class CredentialCache:
    """Who a token was, for `ttl_s` seconds, by the token's digest (never the token in clear).

    Each entry also keeps the credential's public name (`gpc_<key id>`, `gpa_<node id>`,
    `gpo_<token id>`), so the process that revokes a key or an operator's token forgets it at once
    (`forget`); other processes within the TTL."""

    def __init__(self, ttl_s: float, *, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._callers: dict[bytes, tuple[float, str, auth.Caller | None]] = {}

    def get(self, token: str) -> tuple[bool, auth.Caller | None]:
        """(known, caller): `known` is False when the token was not seen within the TTL."""
        found = self._callers.get(_digest(token))
        if found is None or found[0] <= self.clock():
            return False, None
        return True, found[2]

    def put(self, token: str, caller: auth.Caller | None) -> None:
        if self.ttl_s <= 0:
            return
        digest = _digest(token)
        self._callers.pop(digest, None)  # re-inserted: the dict's order stays oldest first
        if len(self._callers) >= CACHED_CREDENTIALS:
            del self._callers[next(iter(self._callers))]
        self._callers[digest] = (self.clock() + self.ttl_s, _credential(token), caller)

    def forget(self, credential: str) -> None:
        """Drop every token of `credential` (`gpc_<key id>`): it was revoked or replaced here."""
        for digest in [d for d, (_, name, _) in self._callers.items() if name == credential]:
            del self._callers[digest]


def _digest(token: str) -> bytes:
    return hashlib.blake2b(token.encode(), digest_size=16).digest()


def _credential(token: str) -> str:
    """A token's public part, before its secret (the whole of an unknown token's digest)."""
    # Parsed as `auth.resolve` parses it: a node id may hold dots, a key's or token's id none.
    name, dot, _ = token.rpartition(".") if token.startswith("gpa_") else token.partition(".")
    return name if dot and name[:4] in ("gpc_", "gpa_", "gpo_") else _digest(token).hex()


class Gate(gate.Gate):
    def __init__(
        self,
        app: ASGIApp,
        *,
        database_url: str,
        operator_token: str,
        cache: CredentialCache,
        max_body_bytes: int,
        max_chunk_bytes: int,
        body: RequestBodySettings,
        control_plane_key: Path | None = None,
    ) -> None:
        super().__init__(_with_caller_logged(app), check=self.authenticate, body=body, max_bytes=self.limit)
        self.control_plane_key = control_plane_key
        self._verifier: Verifier | None = None
        self.database_url = database_url
        self.operator_token = operator_token
        self.cache = cache
        self.max_body_bytes = max_body_bytes
        self.max_chunk_bytes = max_chunk_bytes
        # Lookups share the threads admission's lanes leave free (`api/admission.py`).
        self._lookups = asyncio.Semaphore(CREDENTIAL_LOOKUPS)

    async def authenticate(self, scope: Scope) -> ASGIApp | None:
        if scope["path"] in OPEN_PATHS:
            return None
        if scope["path"] in ENROLLMENT_PATHS:
            return await self._enrolling(scope)
        if console_session.is_console(scope["path"]):
            return await self._console(scope)
        token = bearer_token(scope)
        if not token:
            detail = "send 'Authorization: Bearer <api key>' (operators: the operator token)"
            return _answer(scope, 401, "unauthenticated", "Authentication required", detail)
        try:
            caller = await self._caller(token)
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, TimeoutError) as exc:
            log.warning("database unavailable while authenticating %s: %r", scope["path"], exc)
            detail = "the database did not answer in time; the request changed nothing, send it again after Retry-After"
            return _answer(scope, 503, "database-unavailable", "Try again", detail, retry_after=True)
        if caller is None:
            return _answer(scope, 401, "unauthenticated", "Invalid credentials", "the API key is unknown or revoked")
        scope.setdefault("state", {})["caller"] = caller
        return None

    async def _enrolling(self, scope: Scope) -> ASGIApp | None:
        """The two paths of a re-imaged node's enrollment take only its one-time token: from the
        booted agent as a bearer token, from the BMC fetching the config drive as basic auth
        (user: the node id). Checked without the cache: it is good once."""
        basic = basic_credentials(scope) if scope["path"] == CONFIG_DRIVE_PATH else None
        token = basic[1] if basic else bearer_token(scope)
        parsed = agent_enrollment.parse(token)
        if parsed is None or (basic is not None and basic[0] != parsed[0]):
            detail = "send the node's one-time enrollment token (gpe_<node id>.<secret>) from its config drive"
            return _answer(scope, 401, "unauthenticated", "Enrollment token required", detail)
        try:
            async with asyncio.timeout(LOOKUP_WAIT_S), self._lookups:
                refused = await run_in_threadpool(self._check_enrollment, token)
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, TimeoutError) as exc:
            log.warning("database unavailable while checking an enrollment token: %r", exc)
            detail = "the database did not answer in time; send it again after Retry-After"
            return _answer(scope, 503, "database-unavailable", "Try again", detail, retry_after=True)
        if refused is not None:
            return _answer(scope, 401, "unauthenticated", "Enrollment refused", refused)
        scope.setdefault("state", {})["caller"] = auth.Caller(role="enrollment", node_id=parsed[0])
        scope["state"]["enrollment_token"] = token
        return None

    async def _console(self, scope: Scope) -> ASGIApp | None:
        """The web console's requests carry a session cookie, not a bearer token: its session is
        looked up (and its credential checked again) on every request, with no cache, so signing
        out or revoking the key ends it at once (`console/session.py`)."""
        state = scope.setdefault("state", {})
        if console_session.session_cookie(scope) is None:
            state["caller"], state["console_csrf"] = console_session.VISITOR, None  # no lookup, no thread
            return None
        try:
            async with asyncio.timeout(LOOKUP_WAIT_S), self._lookups:
                caller, csrf = await run_in_threadpool(self._console_caller, scope)
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, TimeoutError) as exc:
            log.warning("database unavailable while finding a console session: %r", exc)
            detail = "the database did not answer in time; reload the page after Retry-After"
            return _answer(scope, 503, "database-unavailable", "Try again", detail, retry_after=True)
        state["caller"], state["console_csrf"] = caller, csrf
        return None

    def _console_caller(self, scope: Scope) -> tuple[auth.Caller, str | None]:
        with get_read_engine(self.database_url).connect() as connection:
            return console_session.resolve(connection, scope, self.operator_token)

    def _check_enrollment(self, token: str) -> str | None:
        with Session(get_read_engine(self.database_url)) as session:
            try:
                agent_enrollment.check(session, token)
            except agent_enrollment.EnrollmentRefused as refused:
                return f"{refused}: the node is re-imaged again to get a fresh one"
        return None

    def limit(self, scope: Scope) -> int:
        chunk = scope["method"] == "PUT" and CHUNK_UPLOAD.match(scope["path"]) is not None
        return self.max_chunk_bytes if chunk else self.max_body_bytes

    def verifier(self) -> Verifier | None:
        """The issuer's public key, once the workers have made it (None before: no evaluation's
        token is valid yet)."""
        if self._verifier is None and self.control_plane_key is not None and self.control_plane_key.exists():
            self._verifier = load_verifier(self.control_plane_key)
        return self._verifier

    async def _caller(self, token: str) -> auth.Caller | None:
        if auth.is_signed_token(token):
            return auth.scoped_caller(token, self.verifier())
        if not auth.has_credential_shape(token, self.operator_token):
            return None  # no credential looks like that: no lookup, no thread, no cache entry
        known, caller = self.cache.get(token)
        if not known:
            # Bounded: the gate runs before admission, so a flood of made-up keys must not hold
            # callers here longer than admission would (a timeout is the database's 503).
            async with asyncio.timeout(LOOKUP_WAIT_S), self._lookups:
                known, caller = self.cache.get(token)  # a burst of one token: one lookup
                if not known:
                    caller = await run_in_threadpool(self._resolve, token)
                    self.cache.put(token, caller)
        return caller

    def _resolve(self, token: str) -> auth.Caller | None:
        # Credentials are only read: a reader's connection, no ORM session around one select.
        with get_read_engine(self.database_url).connect() as connection:
            return auth.resolve(connection, token, self.operator_token)


def _with_caller_logged(app: ASGIApp) -> ASGIApp:
    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        caller = scope.get("state", {}).get("caller")
        if caller is None:
            await app(scope, receive, send)
            return
        # Every line logged while serving the request names who asked (and follows it into threads).
        with log_context(tenant_id=caller.tenant_id, node_id=caller.node_id):
            await app(scope, receive, send)

    return logged


def _answer(scope: Scope, status: int, type_: str, title: str, detail: str, *, retry_after: bool = False) -> ASGIApp:
    document = problems.body(status, type_, title, detail, instance=scope["path"])
    headers = {"Retry-After": "1"} if retry_after else {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return problems.response(document, status, headers=headers)
