"""RFC 9457 problem+json errors with stable `type`s, and the handlers that render every error so.

Bad input is a 4xx whose detail names the field; nothing else in the API formats errors.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

MEDIA_TYPE = "application/problem+json"
TYPE_BASE = "https://gpucloud.dev/problems/"


class Problem(Exception):
    def __init__(self, status: int, type_: str, title: str, detail: str, **extra: object) -> None:
        super().__init__(detail)
        self.status, self.type, self.title, self.detail, self.extra = status, type_, title, detail, extra

    def body(self, instance: str) -> dict:
        return {
            "type": TYPE_BASE + self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "instance": instance,
            **self.extra,
        }


def not_found(kind: str, ident: str) -> Problem:
    # Foreign ids get the same answer as missing ones: nothing to learn about other tenants.
    return Problem(404, "not-found", f"{kind} not found", f"no {kind} {ident!r} visible to this caller")


def render(problem: Problem, request: Request, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        problem.body(request.url.path), status_code=problem.status, media_type=MEDIA_TYPE, headers=headers
    )


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem):
        return render(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = [{"field": _field(tuple(e.get("loc", ()))), "message": e.get("msg", "invalid")} for e in exc.errors()]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return render(Problem(422, "invalid-request", "The request is invalid", detail, errors=errors), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        slug = {401: "unauthenticated", 403: "forbidden", 404: "not-found", 405: "method-not-allowed"}.get(
            exc.status_code, "http-error"
        )
        return render(
            Problem(exc.status_code, slug, slug.replace("-", " ").capitalize(), str(exc.detail)),
            request,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return render(
            Problem(
                500,
                "internal",
                "Internal error",
                "the control plane hit an unexpected error; retry with the same Idempotency-Key",
            ),
            request,
        )
