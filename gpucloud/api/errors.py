"""The one place the API turns a service's refusal (`gpucloud.services.errors`) into its answer:
a problem document (`gpucloud.web.problems`) whose status follows from the kind of error."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gpucloud.services import errors
from gpucloud.web import problems

# Most specific first: the first class an error is an instance of gives its status.
STATUS: tuple[tuple[type[errors.DomainError], int], ...] = (
    (errors.NotFound, 404),
    (errors.Forbidden, 403),
    (errors.Invalid, 422),
    (errors.Conflict, 409),
    (errors.Unavailable, 503),
    (errors.Broken, 500),
)


def status_of(error: errors.DomainError) -> int:
    return next(status for kind, status in STATUS if isinstance(error, kind))


def problem_for(error: errors.DomainError) -> problems.Problem:
    """The problem document answering `error`; `Retry-After` when the service said when."""
    headers = {}
    if isinstance(error, errors.Unavailable) and error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return problems.Problem(status_of(error), error.type_, error.title, error.detail, headers=headers, **error.members)


def install(app: FastAPI) -> None:
    """Answer every domain error a route lets through with its problem document."""

    @app.exception_handler(errors.DomainError)
    async def _refused(request: Request, exc: errors.DomainError) -> JSONResponse:
        return problems.render(problem_for(exc), request)
