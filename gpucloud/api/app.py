"""The HTTP API: FastAPI app factory. Handlers read the DB or start/signal workflows."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from temporalio.client import Client
from temporalio.service import RPCError

from gpucloud import bootstrap
from gpucloud.api import errors, pagination
from gpucloud.api.admission import OPEN_PATHS, THREADS, Admission
from gpucloud.api.gate import CredentialCache, Gate
from gpucloud.api.routers import (
    agents,
    allocation_logs,
    allocations,
    api_keys,
    billing,
    catalog,
    enrollment,
    fleet_incidents,
    health,
    incidents,
    nodes,
    operations,
    operators,
    queue,
    registry,
    reservations,
    rollouts,
    tenants,
    whoami,
)
from gpucloud.config import Settings
from gpucloud.console import routes as console
from gpucloud.observability import tracing
from gpucloud.services.workflow_engine import engine_error
from gpucloud.web import problems
from gpucloud.web.metrics import FleetCollector, RequestMetrics, install_metrics
from gpucloud.web.readiness import (
    database_check,
    delegate_check,
    install_readiness,
    object_store_check,
    temporal_check,
)
from gpucloud.web.routes import mount
from gpucloud.web.service_tokens import public_key_path

log = logging.getLogger(__name__)


def create_app(settings: Settings, *, temporal: Client | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Sync handlers and dependencies run on these threads; admission keeps fewer requests
        # in flight than there are threads (see api/admission.py).
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        app.state.db.prepare(migrate_on_start=settings.migrates_on_start)
        app.state.temporal = temporal or await bootstrap.temporal_client(settings)
        yield
        if app.state.ledger is not None:
            await app.state.ledger.aclose()
        if app.state.agent_logs is not None:
            await app.state.agent_logs.aclose()

    app = FastAPI(
        title="gpucloud",
        version="0.1.0",
        lifespan=lifespan,
        description="Control plane of a GPU cloud: tenants, nodes, allocations.",
    )
    app.state.settings = settings
    pagination.use_secret(settings.page_token_secret)
    app.state.db = bootstrap.database(settings)
    # A delegate of the issuer key, not the key itself: this process faces the internet
    # (`web/service_tokens.py`); it can mint ledger tokens only.
    app.state.issuer = bootstrap.api_token_issuer(settings)
    app.state.ledger = bootstrap.ledger_client(settings, app.state.issuer)
    app.state.agent_logs = bootstrap.agent_log_reader(app.state.issuer)
    app.state.registry_stores = bootstrap.registry_stores(settings)
    app.state.credentials = CredentialCache(settings.api.credential_cache_s)
    problems.install(app)
    errors.install(app)

    @app.exception_handler(RPCError)
    async def _engine_refused(request: Request, exc: RPCError) -> JSONResponse:
        # A route that calls the engine and has nothing to undo lets its refusal come here: an
        # outage is still a 503 and a deployment's mistake still names itself (not "internal").
        what = f"a call of {request.method} {request.url.path}"
        refusal = engine_error(exc, what=what, left="what the request wrote before it stays")
        return problems.render(errors.problem_for(refusal), request)

    # Added innermost first. The gate finds who calls (and bounds the body: 413 on a declared
    # size at once; the rest as the route reads it, with the read deadline), admission gives the
    # caller a slot, and only then does the route read the body (api/gate.py, api/admission.py).
    app.add_middleware(Admission, settings=settings.api)
    app.add_middleware(
        Gate,
        database_url=settings.database_url,
        operator_token=settings.operator_token,
        cache=app.state.credentials,
        max_body_bytes=settings.api.max_body_bytes,
        max_chunk_bytes=settings.registry.max_chunk_size,
        body=settings.request_body,
        # Evaluations read their version with a token the issuer key signed (`api/gate.py`).
        control_plane_key=public_key_path(settings.issuer_key_path),
    )
    # Matched in this order (see routers/agents.py): the agents' reports, then what tenants poll;
    # the web console last, `/console` (docs/console.md). Mounted, not included: each route is
    # built once per process, not again for each app (`web/routes.py`).
    mount(
        app,
        [
            agents.router,
            allocations.router,
            allocation_logs.router,
            queue.router,
            reservations.router,
            operations.router,
            tenants.router,
            api_keys.router,
            nodes.router,
            health.router,
            incidents.router,
            fleet_incidents.router,
            *registry.ROUTERS,
            billing.router,
            rollouts.router,
            operators.router,
            enrollment.router,
            catalog.router,
            whoami.router,
            *console.ROUTERS,
        ],
    )

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict:
        """The process is alive (whatever its dependencies do; see `/readyz`)."""
        return {"ok": True}

    install_readiness(
        app,
        {
            "database": database_check(app.state.db.engine),
            "temporal": temporal_check(lambda: app.state.temporal),
            # The registry's chunks and manifests live there.
            "object store": object_store_check(app.state.registry_stores.objects),
        }
        | ({"delegate": delegate_check(app.state.issuer)} if app.state.issuer is not None else {}),
    )
    install_metrics(
        app,
        lambda: (settings.metrics_token, settings.operator_token),
        collectors=[FleetCollector(settings.database_url)],
    )
    app.add_middleware(RequestMetrics)  # outermost: what every caller got, refusals included
    problems.truthful_openapi(app, open_paths=OPEN_PATHS)
    tracing.configure(settings, "api")
    tracing.instrument_app(app)

    return app
