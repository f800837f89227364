"""Who calls, before admission and before anything reads the request's body; then how large
the body may be.

`Gate` runs first (outside admission): a request without valid credentials is answered 401
whatever its body holds (a malformed body from a stranger gets 401, not 422). The caller found
here is what admission shares slots by (a tenant with all its keys, a node, the operator: see
`api/admission.py`), and it is handed to the routes' auth dependency (`deps.get_any_caller`), so
credentials are looked up once a request. `BodyLimit` runs inside admission: only an admitted
caller's body is read, up to a limit (413 past it).

Credentials are remembered for `api.credential_cache_s` seconds (token digest -> caller, unknown
tokens too), so a client that retries a refused request at once costs no database read and no
thread. A key revoked or rotated through an API process stops there at once; in the others (and
a rotated key past its grace, or a node credential a wipe replaced) it keeps working for at most
that long after the change.

Limits: `api.max_body_bytes` for every body, except a registry chunk upload, which streams to
disk and holds itself to `registry.max_chunk_size`. A body sent without Content-Length is read
here up to the limit and handed on.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time

from sqlalchemy import exc as sa_exc
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpucloud.api import auth
from gpucloud.api.admission import CREDENTIAL_LOOKUPS, OPEN_PATHS, bearer_token
from gpucloud.db import get_read_engine
from gpucloud.observability.logs import log_context
from gpucloud.web import problems

log = logging.getLogger(__name__)

CHUNK_UPLOAD = re.compile(r"^/v1/models/[^/]+/chunks/[^/:]+$")
# Tokens remembered at most (a flood of made-up tokens evicts the oldest, never grows memory).
CACHED_CREDENTIALS = 10_000


class CredentialCache:
    """Who a token was, for `ttl_s` seconds, by the token's digest (never the token in clear).

    Each entry also keeps the credential's public name (`gpc_<key id>`, `gpa_<node id>`), so the
    process that revokes a key forgets it at once (`forget`); other processes within the TTL."""

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
    name, dot, _ = token.partition(".")
    return name if dot and name[:4] in ("gpc_", "gpa_") else _digest(token).hex()


class Gate:
    def __init__(self, app: ASGIApp, *, database_url: str, operator_token: str, cache: CredentialCache) -> None:
        self.app = app
        self.database_url = database_url
        self.operator_token = operator_token
        self.cache = cache
        # Lookups share the threads admission's lanes leave free (`api/admission.py`).
        self._lookups = asyncio.Semaphore(CREDENTIAL_LOOKUPS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if not token:
            detail = "send 'Authorization: Bearer <api key>' (operators: the operator token)"
            await _answer(scope, send, 401, "unauthenticated", "Authentication required", detail)
            return
        try:
            caller = await self._caller(token)
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as exc:
            log.warning("database unavailable while authenticating %s: %s", scope["path"], exc)
            detail = "the database did not answer in time; the request changed nothing, send it again after Retry-After"
            await _answer(scope, send, 503, "database-unavailable", "Try again", detail, retry_after=True)
            return
        if caller is None:
            await _answer(
                scope, send, 401, "unauthenticated", "Invalid credentials", "the API key is unknown or revoked"
            )
            return
        scope.setdefault("state", {})["caller"] = caller
        # Every line logged while serving the request names who asked (and follows it into threads).
        with log_context(tenant_id=caller.tenant_id, node_id=caller.node_id):
            await self.app(scope, receive, send)

    async def _caller(self, token: str) -> auth.Caller | None:
        known, caller = self.cache.get(token)
        if not known:
            async with self._lookups:
                known, caller = self.cache.get(token)  # a burst of one token: one lookup
                if not known:
                    caller = await run_in_threadpool(self._resolve, token)
                    self.cache.put(token, caller)
        return caller

    def _resolve(self, token: str) -> auth.Caller | None:
        # Credentials are only read: a reader's connection, no ORM session around one select.
        with get_read_engine(self.database_url).connect() as connection:
            return auth.resolve(connection, token, self.operator_token)


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_chunk_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_chunk_bytes = max_chunk_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        chunk = scope["method"] == "PUT" and CHUNK_UPLOAD.match(scope["path"]) is not None
        limit = self.max_chunk_bytes if chunk else self.max_body_bytes
        declared = problems.header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _too_large(scope, send, limit)
            return
        if declared is None and not chunk and scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_at_most(receive, limit)
            if body is None:
                await _too_large(scope, send, limit)
                return
            receive = _replay(body)
        await self.app(scope, receive, send)


async def _read_at_most(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return bytes(body)
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _too_large(scope: Scope, send: Send, limit: int) -> None:
    detail = f"the request body may have at most {limit} bytes"
    await _answer(scope, send, 413, "body-too-large", "Request body too large", detail)


async def _answer(
    scope: Scope, send: Send, status: int, type_: str, title: str, detail: str, *, retry_after: bool = False
) -> None:
    document = problems.body(status, type_, title, detail, instance=scope["path"])
    headers = {"Retry-After": "1"} if retry_after else {"WWW-Authenticate": "Bearer"} if status == 401 else None
    await problems.send(scope, send, document, status, headers=headers)
