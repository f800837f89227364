"""The codec server: opens sealed Temporal payloads for the Web UI (its "codec endpoint") and for
`temporal ... --codec-endpoint --codec-auth 'Bearer <operator token>'`, so an operator can read
what a workflow carried without the keys ever leaving the control plane.

It runs only where the operator asks (`gpucloud codec-server`), binds loopback unless told
otherwise (and then only with TLS, as every server here), and answers only the operator token:
a decoded payload holds tenants' workload environments and SSH keys. The caller is
authenticated before the body is read, and the body is bounded. Only `/decode` is served: nothing
here seals a payload a workflow would then trust. The Web UI calls it from the browser, so its
origin (`temporal.codec_server_ui_origin`) is allowed by CORS.
"""

from __future__ import annotations

import hmac

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from gpucloud.adapters.temporal import EncryptionCodec
from gpucloud.web import problems
from gpucloud.web.tls import ServerTLS, serve_options

# A batch of payloads as the UI sends them (each payload up to Temporal's 2 MB), base64 in JSON.
MAX_BODY_BYTES = 16 * 1024 * 1024


def create_app(codec: EncryptionCodec, *, operator_token: str, ui_origin: str | None = None) -> FastAPI:
    app = FastAPI(title="gpucloud codec server", openapi_url=None, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def operator_only(request: Request, call_next):
        if request.method == "OPTIONS":  # a CORS preflight carries no credentials; CORS answers it
            return await call_next(request)
        scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), operator_token.encode()):
            return problems.unauthenticated("the codec server answers only the operator token")
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit():
            return problems.problem_response(411, "Length required", "a decode request says its Content-Length")
        if int(declared) > MAX_BODY_BYTES:
            return problems.problem_response(
                413, "Payload too large", f"a decode request has a Content-Length of at most {MAX_BODY_BYTES} bytes"
            )
        return await call_next(request)

    @app.post("/decode")
    async def decode(request: Request) -> JSONResponse:
        try:
            sealed = json_format.Parse(await request.body(), Payloads())
            opened = Payloads(payloads=[codec.open(p) for p in sealed.payloads])
        except (json_format.ParseError, ValueError) as error:
            return problems.problem_response(400, "Bad request", f"the payloads cannot be decoded: {error}")
        return JSONResponse(json_format.MessageToDict(opened))

    if ui_origin:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=[ui_origin],
            allow_methods=["POST"],
            allow_headers=["authorization", "content-type", "x-namespace"],
            allow_credentials=True,
        )
    return app


def main(
    codec: EncryptionCodec,
    *,
    operator_token: str,
    host: str,
    port: int,
    ui_origin: str | None,
    tls: ServerTLS | None,
    insecure: bool,
) -> None:
    secure = serve_options(host, tls, insecure=insecure, what="codec server")
    app = create_app(codec, operator_token=operator_token, ui_origin=ui_origin)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, **secure)
