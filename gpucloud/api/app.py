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
from gpucloud.api import pagination
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
    health,
    nodes,
    operations,
    operators,
    registry,
    rollouts,
    tenants,
    whoami,
)
from gpucloud.config import Settings
from gpucloud.observability import tracing
from gpucloud.services.workflow_engine import engine_problem
from gpucloud.web import problems
from gpucloud.web.metrics import FleetCollector, RequestMetrics, install_metrics
from gpucloud.web.readiness import (
    database_check,
    delegate_check,
    install_readiness,
    object_store_check,
    temporal_check,
)
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

    @app.exception_handler(RPCError)
    async def _engine_refused(request: Request, exc: RPCError) -> JSONResponse:
        # A route that calls the engine and has nothing to undo lets its refusal come here: an
        # outage is still a 503 and a deployment's mistake still names itself (not "internal").
        what = f"a call of {request.method} {request.url.path}"
        return problems.render(engine_problem(exc, what=what, left="what the request wrote before it stays"), request)

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
    # Matched in this order (see routers/agents.py): the agents' reports, then what tenants poll.
    for module in (
        agents,
        allocations,
        allocation_logs,
        operations,
        tenants,
        api_keys,
        nodes,
        health,
        registry,
        billing,
        rollouts,
        operators,
        enrollment,
        catalog,
        whoami,
    ):
        app.include_router(module.router)

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


def create_app_from_env() -> FastAPI:
    """The app of one of several API processes: each reads the settings its parent exported.
    Uvicorn's master starts it (multiprocessing), so the worker itself asks to die with the
    master: a master killed outright would otherwise leave it serving the port."""
    from gpucloud import children
    from gpucloud.config import get_settings
    from gpucloud.observability import logs

    children.die_with_multiprocessing_parent()
    settings = get_settings()
    bootstrap.trust_configured_ca(settings)
    logs.configure(level=settings.telemetry.log_level, fmt=settings.telemetry.log_format)
    return create_app(settings)


def serve(settings: Settings) -> None:
    """Serve the API: one process, or `settings.api.workers` processes on one port (Postgres:
    they share nothing in memory that correctness depends on; SQLite has one writer per file)."""
    import os
    import shutil

    import uvicorn

    from gpucloud.web import tls

    secure = tls.serve_options(settings.api.host, settings.tls.server, insecure=settings.tls.insecure, what="API")
    workers = settings.api.workers
    if workers <= 1:
        uvicorn.run(
            create_app(settings),
            host=settings.api.host,
            port=settings.api.port,
            log_level="warning",
            log_config=None,
            **secure,
        )
        return
    if settings.database_url.startswith("sqlite"):
        raise SystemExit(
            f"{workers} API processes need Postgres (GPUCLOUD_DATABASE__URL); SQLite serves one. "
            "Set GPUCLOUD_API__WORKERS=1 or point the API at Postgres."
        )
    os.environ.update(settings.env())  # the worker processes read the same settings
    # The processes' metrics, summed at any one's /metrics (a fresh directory: no stale files).
    metrics_dir = settings.data_dir.resolve() / f"api-metrics-{settings.api.port}"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    uvicorn.run(
        "gpucloud.api.app:create_app_from_env",
        factory=True,
        workers=workers,
        # The supervisor's health check of a worker: its 5 s default kills workers still starting
        # (imports, migrations check) on a loaded host, and restarts them again and again.
        timeout_worker_healthcheck=60,
        host=settings.api.host,
        port=settings.api.port,
        log_level="warning",
        log_config=None,
        **secure,
    )
