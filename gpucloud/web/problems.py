"""RFC 9457 problem+json: the one module of gpucloud that answers an HTTP error, for every
FastAPI app (the API, the ledger, the host agent, the node weights API, the simulated fleet).

A problem has a stable `type` (a slug under `TYPE_BASE`), a title, the status, a `detail` that
names what was wrong (the field, for bad input) and what to do next, and any extra members a
client reads (`retryable`, `errors`, ...). Handlers raise `Problem`; code that answers rather
than raises uses `problem_response` (or `response` for a body built elsewhere, such as the
ledger's typed catalogue). `install` renders validation errors (422 naming the field), HTTP
errors and unexpected exceptions (500) the same way on any app.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

MEDIA_TYPE = "application/problem+json"
TYPE_BASE = "https://gpucloud.dev/problems/"


class FieldError(BaseModel):
    field: str
    message: str


class ProblemDocument(BaseModel):
    """What every error answer of every server carries (`application/problem+json`, RFC 9457)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description=f"a stable slug under {TYPE_BASE}")
    title: str
    status: int
    detail: str = Field(description="what was wrong (the field, for bad input) and what to do next")
    instance: str | None = Field(default=None, description="the path of the request")
    errors: list[FieldError] | None = Field(default=None, description="on a 422: each field and why")
    retryable: bool | None = Field(default=None, description="true when the same request may be sent again")


# What every authenticated route of the API may answer, besides what it declares itself.
COMMON_RESPONSES: dict[int, str] = {
    401: "no valid credentials (an API key, the operator token, or an agent credential)",
    403: "the caller may not do this",
    429: "the caller is over its share of the API: retry after `Retry-After`",
    503: "overloaded, or a dependency (database, workflow engine) did not answer: retry after `Retry-After`",
}


def truthful_openapi(app: FastAPI, *, open_paths: frozenset[str]) -> None:
    """Make the app's OpenAPI document say what the app answers: every error body is a problem
    document (`ProblemDocument`, as `application/problem+json`), the 422 included (not FastAPI's
    default), and every route but the open ones may answer 401, 403, 429 and 503; one with a path
    parameter, 404; one with a body, 408 and 413."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        document = ProblemDocument.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in document.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components["ProblemDocument"] = document
        problem = {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/ProblemDocument"}}}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                statuses = set() if path in open_paths else set(COMMON_RESPONSES)
                if "{" in path:
                    statuses.add(404)
                if operation.get("parameters") or operation.get("requestBody"):
                    statuses.add(422)
                if operation.get("requestBody") and path not in open_paths:
                    statuses |= {408, 413}  # the gate's (web/gate.py): too slow, too large
                names = {p.get("name", "").lower() for p in operation.get("parameters", [])}
                if "page_token" in names:
                    statuses.add(400)  # a page token this API did not issue
                if "idempotency-key" in names:
                    statuses |= {400, 409}  # a malformed key; one reused for another request or still running
                for status in statuses:
                    described = {
                        **COMMON_RESPONSES,
                        400: "a `page_token` this API did not issue, or a malformed `Idempotency-Key`",
                        409: "the state refuses it; or the `Idempotency-Key` was used for another request",
                        404: "not found, or not visible to this caller",
                        408: "the body did not arrive within the read deadline (the connection is closed)",
                        413: "the body is larger than this server takes",
                    }
                    responses.setdefault(str(status), {"description": described.get(status, "see `detail`")})
                for status, response in responses.items():
                    if status.isdigit() and int(status) >= 400:
                        if int(status) == 422:
                            response["description"] = "the request is invalid: `errors` names each field"
                        response["content"] = problem
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def slug(title: str) -> str:
    return title.lower().replace(" ", "-")


def body(status: int, type_: str, title: str, detail: str, **extra: Any) -> dict[str, Any]:
    """A problem document: `type_` is the slug under `TYPE_BASE`."""
    return {"type": TYPE_BASE + type_, "title": title, "status": status, "detail": detail, **extra}


def response(document: Mapping[str, Any], status: int, *, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The HTTP answer carrying a problem document (`body`, or a catalogue's own)."""
    return JSONResponse(dict(document), status_code=status, media_type=MEDIA_TYPE, headers=headers)


async def send(
    scope: Any, send_: Any, document: Mapping[str, Any], status: int, *, headers: Mapping[str, str] | None = None
) -> None:
    """Answer with a problem document straight from ASGI middleware (before any route runs)."""

    async def no_body() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    await response(document, status, headers=headers)(scope, no_body, send_)


def header(scope: Any, name: bytes) -> str | None:
    """A request header read straight from ASGI scope (middleware that answers before routing)."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip()
    return None


CHALLENGE = {"WWW-Authenticate": "Bearer"}


def unauthenticated(detail: str, *, type_: str = TYPE_BASE + "unauthenticated") -> JSONResponse:
    """The 401 for a caller without valid credentials, with the challenge a client expects."""
    document = {"type": type_, "title": "Authentication required", "status": 401, "detail": detail}
    return response(document, 401, headers=CHALLENGE)


def unauthenticated_problem(detail: str) -> Problem:
    """`unauthenticated` for code that raises (a dependency checked before the body is read)."""
    return Problem(401, "unauthenticated", "Authentication required", detail, headers=CHALLENGE)


def problem_response(status: int, title: str, detail: str, **extra: Any) -> JSONResponse:
    """An answer for code that returns rather than raises; the type is the title's slug."""
    return response(body(status, slug(title), title, detail, **extra), status)


class Problem(Exception):
    """Raised by a handler; rendered by the handlers `install` adds. `headers` go on the answer
    (e.g. `Retry-After` on a 503 or 429)."""

    def __init__(
        self,
        status: int,
        type_: str,
        title: str,
        detail: str,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: object,
    ) -> None:
        super().__init__(detail)
        self.status, self.type, self.title, self.detail, self.extra = status, type_, title, detail, extra
        self.headers = dict(headers or {})

    def body(self, instance: str) -> dict[str, Any]:
        return body(self.status, self.type, self.title, self.detail, instance=instance, **self.extra)

    def response(self, instance: str) -> JSONResponse:
        return response(self.body(instance), self.status, headers=self.headers or None)


def not_found(kind: str, ident: str) -> Problem:
    # Foreign ids get the same answer as missing ones: nothing to learn about other tenants.
    return Problem(404, "not-found", f"{kind} not found", f"no {kind} {ident!r} visible to this caller")


def invalid(
    field: str,
    message: str,
    type_: str = "invalid-request",
    *,
    detail: str | None = None,
    title: str = "The request is invalid",
    errors: list[dict[str, str]] | None = None,
) -> Problem:
    """A 422 naming the bad field (`errors`, as a validation error lists them), with the detail
    `field: message` unless `detail` says more."""
    errors = errors or [{"field": field, "message": message}]
    return Problem(422, type_, title, detail or f"{field}: {message}", errors=errors)


def unavailable(what: str, detail: str, *, retry_after_s: int = 1) -> Problem:
    """A 503 for an outside system that did not answer (the workflow engine, the database):
    nothing was lost, the same request may be sent again after `Retry-After`."""
    return Problem(
        503, f"{what}-unavailable", "Try again", detail, headers={"Retry-After": str(retry_after_s)}, retryable=True
    )


def render(problem: Problem, request: Request, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return response(problem.body(request.url.path), problem.status, headers={**problem.headers, **(headers or {})})


def field_of(loc: tuple) -> str:
    """The field a validation error is about, as the client named it (`body.`/`query.` dropped)."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


# FastAPI answers a body it cannot decode at all (not UTF-8, say) with a bare 400 of this text,
# while JSON that does not parse gets its 422: both are the same mistake, so both are a 422 here.
_FASTAPI_BODY_ERROR = "There was an error parsing the body"
UNPARSABLE_BODY = "the body is not valid JSON (UTF-8 text)"


def is_unparsable_body(exc: StarletteHTTPException) -> bool:
    return exc.status_code == 400 and exc.detail == _FASTAPI_BODY_ERROR


def install(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return render(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"field": field_of(tuple(e.get("loc", ()))), "message": e.get("msg", "invalid")} for e in exc.errors()
        ]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return render(invalid(errors[0]["field"], errors[0]["message"], detail=detail, errors=errors), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if is_unparsable_body(exc):
            return render(invalid("body", UNPARSABLE_BODY), request)
        kind = {401: "unauthenticated", 403: "forbidden", 404: "not-found", 405: "method-not-allowed"}.get(
            exc.status_code, "http-error"
        )
        problem = Problem(exc.status_code, kind, kind.replace("-", " ").capitalize(), str(exc.detail))
        return render(problem, request, headers=getattr(exc, "headers", None))

    @app.exception_handler(sa_exc.TimeoutError)
    @app.exception_handler(sa_exc.OperationalError)
    @app.exception_handler(sa_exc.InterfaceError)
    async def _database(request: Request, exc: Exception) -> JSONResponse:
        # A pool that stayed empty, a database that is down or locked: transient, never a 500.
        log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc)
        detail = "the database did not answer in time; the request changed nothing, send it again after Retry-After"
        return render(unavailable("database", detail), request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        problem = Problem(
            500,
            "internal",
            "Internal error",
            "the server hit an unexpected error; retry with the same Idempotency-Key",
        )
        return render(problem, request)
