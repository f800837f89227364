"""The gate in front of every server the project runs: who calls, then how much body, then how fast.

Every server (the API, the ledger, the tracker and origin, a node's agent and peer service, the
simulated fleet and fabric managers) puts one `Gate` in front of its routes. For each request:

1. **Credentials first.** The server's own `Check` looks at the headers, path and query only,
   and either lets the request on (leaving what it learnt in `scope["state"]`) or returns the
   answer that refuses it (401, 403, 503). A refused request's body is never read, whatever it
   holds: a stranger's malformed body is 401, not 422, and a 64 MiB one is not taken off the
   socket (the refusal closes the connection instead of draining it).
2. **Then the size.** A declared Content-Length past the limit is answered 413 before a byte is
   read; a body without one is counted as the route reads it and cut off at the limit (413).
3. **Then the read deadline.** uvicorn has no body-read timeout: a client that sends its headers
   and then stalls holds whatever the request holds (an admission slot, a worker thread) for as
   long as it keeps the socket open. Here the time a route spends waiting for body bytes is
   bounded: `read_deadline_s`, plus one second for each `min_bytes_per_s` already received (so a
   64 MiB chunk at a steady pace gets the time it needs, and a trickle does not). Past it the
   request is answered 408 and the connection closed, and the route sees the client disconnect,
   so it returns and frees its slot. Time spent before the route asks for the body (admission,
   a database lookup, a disk write between pieces) is not the client's and is not counted.

A refusal sent from inside the body's reading (413, 408) is the request's only answer: whatever
the route sends or raises after it is dropped. Once the body is complete, `receive` is the
server's own again (a streaming response listens on it for the client going away).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpucloud.config import RequestBodySettings
from gpucloud.web import problems

log = logging.getLogger(__name__)

Check = Callable[[Scope], Awaitable[ASGIApp | None]]
"""A server's credential check: None lets the request on; otherwise the ASGI app that answers
it (a problem response). It sees the scope only, never the body."""

BODY_DEFAULTS = RequestBodySettings()
"""How a server reads bodies when whoever starts it passes no settings (a node's agent)."""
CLOSE = {"Connection": "close"}
# Open on every server (`/metrics` checks its own token, the scraper's).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class Gate:
    """ASGI middleware: `check`, then the body's size and read deadline (module doc). `max_bytes`
    picks a request's limit where one route needs another (default: `body.max_bytes`)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        check: Check,
        body: RequestBodySettings,
        max_bytes: Callable[[Scope], int] | None = None,
    ) -> None:
        self.app = app
        self.check = check
        self.body = body
        self.max_bytes = max_bytes or (lambda _scope: body.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = await self.check(scope)
        if refusal is not None:
            # The body stays unread; closing the connection spares the server draining it.
            await refusal(scope, receive, _closing(send) if has_body(scope) else send)
            return
        limit = self.max_bytes(scope)
        declared = problems.header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _too_large(scope, send, limit)
            return
        reading = BoundedBody(scope, receive, send, max_bytes=limit, settings=self.body)
        try:
            await self.app(scope, reading.receive, reading.send)
        except Exception:
            if not reading.refused:
                raise
            # What the route raised is its reaction to the body we cut off, answered already.
            log.debug("%s %s ended after its body was refused", scope["method"], scope["path"], exc_info=True)


class BoundedBody:
    """One request's `receive` and `send`, holding the body to a size and a read deadline."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, *, max_bytes: int, settings: RequestBodySettings):
        self._scope, self._receive, self._send = scope, receive, send
        self.max_bytes = max_bytes
        self.deadline_s, self.min_rate = settings.read_deadline_s, settings.min_bytes_per_s
        self.received = 0
        self.waited_s = 0.0
        self.complete = False
        self.refused = False
        self.started = False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        if self.complete:
            return await self._receive()
        allowed = self.deadline_s + self.received / self.min_rate - self.waited_s
        began = time.monotonic()
        try:
            async with asyncio.timeout(max(allowed, 0.0)):
                message = await self._receive()
        except TimeoutError:
            await self._refuse(408, "body-timeout", "Request body too slow", self._too_slow())
            return {"type": "http.disconnect"}
        finally:
            self.waited_s += time.monotonic() - began
        if message["type"] != "http.request":
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.max_bytes:
            await self._refuse(413, "body-too-large", "Request body too large", _limit_detail(self.max_bytes))
            return {"type": "http.disconnect"}
        self.complete = not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    def _too_slow(self) -> str:
        return (
            f"{self.received} bytes of the body arrived in {self.waited_s:.1f} s; the server waits "
            f"{self.deadline_s:g} s for a body, and 1 s more per {self.min_rate} bytes received"
        )

    async def _refuse(self, status: int, type_: str, title: str, detail: str) -> None:
        self.refused = True
        if self.started:  # too late to answer: closing is all that is left
            log.warning("%s %s: %s after the response started", self._scope["method"], self._scope["path"], title)
            return
        document = problems.body(status, type_, title, detail, instance=self._scope["path"])
        await problems.send(self._scope, self._send, document, status, headers=CLOSE)


async def _too_large(scope: Scope, send: Send, limit: int) -> None:
    document = problems.body(413, "body-too-large", "Request body too large", _limit_detail(limit))
    await problems.send(scope, send, document, 413, headers=CLOSE if has_body(scope) else None)


def _limit_detail(limit: int) -> str:
    return f"the request body may have at most {limit} bytes"


def has_body(scope: Scope) -> bool:
    """Whether a body may follow the request's head: a refusal then closes the connection, so
    the server never reads (or drains) what it refused."""
    declared = problems.header(scope, b"content-length")
    return declared not in (None, "0") or problems.header(scope, b"transfer-encoding") is not None


def _closing(send: Send) -> Send:
    async def closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return closing


def holds_token(scope: Scope, token: str) -> bool:
    """Whether the request carries `Authorization: Bearer <token>` (compared in constant time)."""
    scheme, _, given = (problems.header(scope, b"authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def query_value(scope: Scope, name: str) -> str | None:
    """The first value of a query parameter, read straight from the scope (checks run before routing)."""
    return parse_qs(scope.get("query_string", b"").decode("latin-1")).get(name, [None])[0]
