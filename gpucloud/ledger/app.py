"""The ledger service: its own process, its own database, an HTTP API over both.

``create_app`` builds the FastAPI app for one database URL (SQLite file by default,
Postgres by URL); the database is migrated when the app starts, before it takes traffic.
``gpucloud.entrypoints.ledger`` runs it with uvicorn: ``gpucloud ledger`` calls it.

Every call but ``/healthz`` needs a token the control plane signed for the ledger, and its
role decides what it may do (``api/callers.py``). Endpoints (all under ``/v1``; errors are RFC
9457 ``application/problem+json``):

- ``POST /usage:batch``: usage samples from agents, exactly once per (node_id, seq).
- ``GET /usage``: GPU-ms and amounts of a tenant (optionally one allocation, a time window).
- ``GET /usage/conflicts``: samples refused because their (node_id, seq) had other content.
- ``POST /allocation-events``, ``GET /allocation-events``: allocation lifecycle.
- ``POST /reservations``, ``GET /reservations``: capacity reservations (billed for their window).
- ``GET /reconciliation``: metered vs allocated time per tenant per day, gaps flagged.
- ``POST /price-book/versions``, ``GET /price-book/versions``: the price book.
- ``GET /postings``, ``POST /postings/{id}:reverse``, ``GET /accounts``: the double-entry books.
- ``GET /periods``: the periods known, which ended and which closed (the close catches up on them).
- ``POST /periods/{YYYY-MM}:close``, ``GET /periods/{YYYY-MM}/invoices[/{tenant_id}]``.
- ``GET /periods/{YYYY-MM}/draft-invoices/{tenant_id}``: an open period's invoice so far.
- ``GET /invoices``, ``GET /invoices/{id}``: stored invoices by tenant or period, one by id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpucloud.config import LedgerSettings, RequestBodySettings
from gpucloud.ledger import pricebook, problems
from gpucloud.ledger.api import (
    allocations,
    invoices,
    periods,
    postings,
    prices,
    reconciliation,
    reservations,
    usage,
)
from gpucloud.ledger.api.admission import LedgerAdmission
from gpucloud.ledger.api.callers import ledger_callers
from gpucloud.ledger.api.deps import LedgerContext
from gpucloud.ledger.db import LedgerDatabase, open_ledger_database
from gpucloud.web import problems as web_problems
from gpucloud.web.gate import BODY_DEFAULTS, Gate
from gpucloud.web.metrics import install_metrics
from gpucloud.web.readiness import database_check, install_readiness
from gpucloud.web.routes import mount
from gpucloud.web.service_tokens import Verifier

DEFAULT_DATABASE_URL = "sqlite:///.data/ledger.db"


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def create_app(
    database_url: str = DEFAULT_DATABASE_URL,
    *,
    control_plane: Verifier,
    clock_ms: Callable[[], int] = wall_clock_ms,
    migrate_on_start: bool = True,
    metrics_tokens: tuple[str, ...] = (),
    request_body: RequestBodySettings = BODY_DEFAULTS,
    admission: LedgerSettings | None = None,
) -> FastAPI:
    """The ledger's app; it answers only callers with a token `control_plane` verifies
    (`api/callers.py`), and reads their bodies as `request_body` says (`web/gate.py`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.ledger = LedgerContext(
            database=open_ledger_database(database_url, migrate_on_start=migrate_on_start), clock_ms=clock_ms
        )
        try:
            yield
        finally:
            app.state.ledger.close()

    app = FastAPI(title="gpucloud ledger", version="1", lifespan=lifespan)
    # Added innermost first: the gate checks the token, then admission gives its caller a slot.
    app.add_middleware(LedgerAdmission, settings=admission or LedgerSettings())
    app.add_middleware(Gate, check=ledger_callers(control_plane), body=request_body)
    routers = (usage, allocations, reservations, prices, postings, reconciliation, periods, invoices)
    mount(app, [module.router for module in routers])  # built once per process (`web/routes.py`)
    app.add_exception_handler(problems.LedgerProblem, _ledger_problem)
    app.add_exception_handler(RequestValidationError, _validation_problem)
    app.add_exception_handler(StarletteHTTPException, _http_problem)
    app.add_exception_handler(Exception, _unexpected_problem)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    async def database() -> None:
        await database_check(app.state.ledger.database.engine)()

    priced = False

    async def price_book() -> None:
        # Without one every usage sample is rejected (unpriced). Looked for until found once: a
        # version, once written, is never removed.
        nonlocal priced
        if not priced:
            priced = await asyncio.to_thread(_has_price_book, app.state.ledger.database)
        if not priced:
            raise LookupError(
                "no price book: run `gpucloud prepare` (it writes the list prices) or POST /v1/price-book/versions"
            )

    install_readiness(app, {"database": database, "price book": price_book})
    install_metrics(app, lambda: metrics_tokens)  # no tokens: every scrape is refused

    return app


def _has_price_book(database: LedgerDatabase) -> bool:
    with database.read() as connection:
        return pricebook.has_price_book(connection)


def _problem_response(problem: problems.Problem) -> JSONResponse:
    return web_problems.response(problem.model_dump(exclude_none=True), problem.status)


async def _ledger_problem(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, problems.LedgerProblem)  # registered for this type only
    return _problem_response(error.problem)


async def _validation_problem(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)  # registered for this type only
    first = error.errors()[0]
    field = web_problems.field_of(tuple(first["loc"]))
    return _problem_response(problems.REQUEST_INVALID(f"{field}: {first['msg']}", field=field))


async def _http_problem(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)  # registered for this type only
    if web_problems.is_unparsable_body(error):
        return _problem_response(problems.REQUEST_INVALID(f"body: {web_problems.UNPARSABLE_BODY}", field="body"))
    kind = (
        problems.NOT_FOUND
        if error.status_code == 404
        else problems.ProblemType("http-error", "HTTP error", error.status_code)
    )
    return _problem_response(kind(str(error.detail)))


async def _unexpected_problem(_request: Request, error: Exception) -> JSONResponse:
    # Nothing was committed (every write is one transaction), so the client may retry.
    # Starlette re-raises the error after this answer, and uvicorn logs its traceback; the
    # answer names no exception: its text can carry SQL, paths or another caller's data.
    return _problem_response(problems.INTERNAL_ERROR("see the ledger's log for this request's error"))
