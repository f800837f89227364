"""Who calls, before anything reads the request's body; then how large the body may be.

Runs inside admission (a request holds its lane's slot), before routing: a request without
valid credentials is answered 401 whatever its body holds (a malformed body from a stranger
gets 401, not 422), and only an authenticated caller's body is read, up to a limit (413 past
it). The caller found here is handed to the routes' auth dependency (`deps.get_any_caller`),
so credentials are looked up once a request.

Limits: `api.max_body_bytes` for every body, except a registry chunk upload, which streams to
disk and holds itself to `registry.max_chunk_size`. A body sent without Content-Length is read
here up to the limit and handed on.
"""

from __future__ import annotations

import logging
import re

from sqlalchemy import exc as sa_exc
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpucloud.api import auth
from gpucloud.api.admission import OPEN_PATHS, bearer_token
from gpucloud.db import get_read_engine
from gpucloud.observability.logs import log_context
from gpucloud.web import problems

log = logging.getLogger(__name__)

CHUNK_UPLOAD = re.compile(r"^/v1/models/[^/]+/chunks/[^/:]+$")


class Gate:
    def __init__(
        self, app: ASGIApp, *, database_url: str, operator_token: str, max_body_bytes: int, max_chunk_bytes: int
    ) -> None:
        self.app = app
        self.database_url = database_url
        self.operator_token = operator_token
        self.max_body_bytes = max_body_bytes
        self.max_chunk_bytes = max_chunk_bytes

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
            caller = await run_in_threadpool(self._resolve, token)
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
        # Every line logged while serving the request names who asked (and follows it into threads).
        with log_context(tenant_id=caller.tenant_id, node_id=caller.node_id):
            await self.app(scope, receive, send)

    def _resolve(self, token: str) -> auth.Caller | None:
        # Credentials are only read: a reader's connection, no ORM session around one select.
        with get_read_engine(self.database_url).connect() as connection:
            return auth.resolve(connection, token, self.operator_token)


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
