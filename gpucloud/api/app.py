"""The HTTP API: FastAPI app factory. Handlers read the DB or start/signal workflows."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from temporalio.client import Client

from gpucloud.api import problems
from gpucloud.api.routers import allocations, api_keys, billing, nodes, operations, registry, rollouts, tenants
from gpucloud.config import Settings
from gpucloud.db import migrate
from gpucloud.ledger.client import LedgerClient

log = logging.getLogger(__name__)


async def _connect_with_retry(settings: Settings, attempts: int = 60) -> Client:
    from gpucloud.adapters.temporal import connect

    for attempt in range(attempts):
        try:
            return await connect(settings)
        except RuntimeError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def create_app(settings: Settings, *, temporal: Client | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        migrate(settings.db_url)
        app.state.temporal = temporal or await _connect_with_retry(settings)
        app.state.ledger = LedgerClient(settings.ledger_url) if settings.ledger_url else None
        yield
        if app.state.ledger is not None:
            await app.state.ledger.aclose()

    app = FastAPI(
        title="gpucloud",
        version="0.1.0",
        lifespan=lifespan,
        description="Control plane of a GPU cloud: tenants, nodes, allocations.",
    )
    app.state.settings = settings
    problems.install(app)
    for module in (tenants, api_keys, allocations, operations, nodes, registry, billing, rollouts):
        app.include_router(module.router)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict:
        return {"ok": True}

    return app


def serve(settings: Settings) -> None:
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port, log_level="warning")
