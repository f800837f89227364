"""The codec server: opens sealed Temporal payloads for the Web UI (its "codec endpoint") and for
`temporal ... --codec-endpoint --codec-auth 'Bearer <operator token>'`, so an operator can read
what a workflow carried without the keys ever leaving the control plane.

It runs only where the operator asks (`gpucloud codec-server`), binds loopback unless told
otherwise (and then only with TLS, as every server here), and answers only an operator whose
role may manage operators (scope `operators`: the bootstrap token or a named admin's): a decoded
payload holds tenants' workload environments and SSH keys. The caller is checked by the gate
every server has (`web/gate.py`) before the body is read, and the body is bounded. Only `/decode`
is served: nothing here seals a payload a workflow would then trust. The Web UI calls it from
the browser, so its origin (`temporal.codec_server_ui_origin`) is allowed by CORS, whose
preflight carries no credentials and is answered by the CORS layer alone.
"""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from sqlalchemy import exc as sa_exc
from starlette.types import ASGIApp, Scope
from temporalio.api.common.v1 import Payloads

from gpucloud import bootstrap
from gpucloud.adapters.temporal import EncryptionCodec, codec_keys
from gpucloud.api import auth
from gpucloud.config import RequestBodySettings, Settings
from gpucloud.db import get_read_engine
from gpucloud.models.operator_roles import Scope as OperatorScope
from gpucloud.web import problems
from gpucloud.web.gate import BODY_DEFAULTS, Gate
from gpucloud.web.tls import serve_options


def create_app(
    codec: EncryptionCodec,
    *,
    database_url: str,
    operator_token: str,
    ui_origin: str | None = None,
    request_body: RequestBodySettings = BODY_DEFAULTS,
) -> FastAPI:
    """`database_url`: where named operators' tokens are looked up (`operator_token`: the
    bootstrap admin's)."""
    app = FastAPI(title="gpucloud codec server", openapi_url=None, docs_url=None, redoc_url=None)

    def resolve(token: str) -> auth.Caller | None:
        with get_read_engine(database_url).connect() as connection:
            return auth.resolve(connection, token, operator_token)

    async def admins_only(scope: Scope) -> ASGIApp | None:
        if scope["method"] == "OPTIONS":  # a CORS preflight: answered by CORS, outside this gate
            return None
        kind, _, token = (problems.header(scope, b"authorization") or "").partition(" ")
        try:
            caller = await run_in_threadpool(resolve, token.strip()) if kind.lower() == "bearer" else None
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
            detail = "the database did not answer in time; send it again after Retry-After"
            return problems.response(
                problems.body(503, "database-unavailable", "Try again", detail), 503, headers={"Retry-After": "1"}
            )
        if caller is None or not caller.is_operator:
            return problems.unauthenticated("the codec server answers only operators' tokens")
        if OperatorScope.OPERATORS not in caller.scopes:
            detail = "decoded payloads hold tenants' secrets: it takes an admin's token (scope `operators`)"
            return problems.problem_response(403, "Forbidden", detail)
        return None

    # A batch of payloads as the UI sends them, base64 in JSON, up to `request_body.max_bytes`.
    app.add_middleware(Gate, check=admins_only, body=request_body)

    @app.post("/decode")
    async def decode(request: Request) -> JSONResponse:
        try:
            sealed = json_format.Parse(await request.body(), Payloads())
            opened = Payloads(payloads=[codec.open(p) for p in sealed.payloads])
        except (json_format.ParseError, ValueError) as error:
            return problems.problem_response(400, "Bad request", f"the payloads cannot be decoded: {error}")
        return JSONResponse(json_format.MessageToDict(opened))

    if ui_origin:  # added last: outermost, so a preflight never reaches the gate
        app.add_middleware(
            CORSMiddleware,
            allow_origins=[ui_origin],
            allow_methods=["POST"],
            allow_headers=["authorization", "content-type", "x-namespace"],
            allow_credentials=True,
        )
    return app


def serve(settings: Settings, *, host: str | None = None, port: int | None = None) -> None:
    """Serve the codec server until stopped, on `host` and `port` (else the settings')."""
    bootstrap.trust_configured_ca(settings)
    host = host or settings.temporal.codec_server_host
    secure = serve_options(host, settings.tls.server, insecure=settings.tls.insecure, what="codec server")
    app = create_app(
        EncryptionCodec(codec_keys(settings)),
        database_url=settings.database_url,
        operator_token=settings.operator_token,
        ui_origin=settings.temporal.codec_server_ui_origin,
        request_body=settings.request_body,
    )
    port = port or settings.temporal.codec_server_port
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, **secure)
