"""Who calls the API, before anything reads the request's body (the shared gate, `web/gate.py`).

Runs inside admission (a request holds its lane's slot), before routing: a request without
valid credentials is answered 401 whatever its body holds (a malformed body from a stranger
gets 401, not 422), and only an authenticated caller's body is read, up to a limit (413 past
it) and within the read deadline (408). The caller found here is handed to the routes' auth
dependency (`deps.get_any_caller`), so credentials are looked up once a request.

Limits: `api.max_body_bytes` for every body, except a registry chunk upload, which streams to
disk, up to `registry.max_chunk_size`; the read deadline is `request_body`'s, as every server's.
"""

from __future__ import annotations

import logging
import re

from sqlalchemy import exc as sa_exc
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.api import auth
from gpucloud.api.admission import OPEN_PATHS, bearer_token
from gpucloud.config import RequestBodySettings
from gpucloud.db import get_read_engine
from gpucloud.observability.logs import log_context
from gpucloud.web import gate, problems

log = logging.getLogger(__name__)

CHUNK_UPLOAD = re.compile(r"^/v1/models/[^/]+/chunks/[^/:]+$")


class Gate(gate.Gate):
    def __init__(
        self,
        app: ASGIApp,
        *,
        database_url: str,
        operator_token: str,
        max_body_bytes: int,
        max_chunk_bytes: int,
        body: RequestBodySettings,
    ) -> None:
        super().__init__(_with_caller_logged(app), check=self.authenticate, body=body, max_bytes=self.limit)
        self.database_url = database_url
        self.operator_token = operator_token
        self.max_body_bytes = max_body_bytes
        self.max_chunk_bytes = max_chunk_bytes

    async def authenticate(self, scope: Scope) -> ASGIApp | None:
        if scope["path"] in OPEN_PATHS:
            return None
        token = bearer_token(scope)
        if not token:
            detail = "send 'Authorization: Bearer <api key>' (operators: the operator token)"
            return _answer(scope, 401, "unauthenticated", "Authentication required", detail)
        try:
            caller = await run_in_threadpool(self._resolve, token)
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as exc:
            log.warning("database unavailable while authenticating %s: %s", scope["path"], exc)
            detail = "the database did not answer in time; the request changed nothing, send it again after Retry-After"
            return _answer(scope, 503, "database-unavailable", "Try again", detail, retry_after=True)
        if caller is None:
            return _answer(scope, 401, "unauthenticated", "Invalid credentials", "the API key is unknown or revoked")
        scope.setdefault("state", {})["caller"] = caller
        return None

    def limit(self, scope: Scope) -> int:
        chunk = scope["method"] == "PUT" and CHUNK_UPLOAD.match(scope["path"]) is not None
        return self.max_chunk_bytes if chunk else self.max_body_bytes

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
