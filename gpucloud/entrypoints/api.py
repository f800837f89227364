"""The API process: `gpucloud api` (one process, or several on one port), its app built from the
routers by `gpucloud.api.app.create_app` with the adapters `gpucloud.bootstrap` makes."""

from __future__ import annotations

import os
import shutil

import uvicorn
from fastapi import FastAPI

from gpucloud import bootstrap, children
from gpucloud.api.app import create_app
from gpucloud.config import Settings, get_settings
from gpucloud.observability import logs
from gpucloud.web import tls


def create_app_from_env() -> FastAPI:
    """The app of one of several API processes: each reads the settings its parent exported.
    Uvicorn's master starts it (multiprocessing), so the worker itself asks to die with the
    master: a master killed outright would otherwise leave it serving the port."""
    children.die_with_multiprocessing_parent()
    settings = get_settings()
    bootstrap.trust_configured_ca(settings)
    logs.configure(level=settings.telemetry.log_level, fmt=settings.telemetry.log_format)
    return create_app(settings)


def serve(settings: Settings) -> None:
    """Serve the API: one process, or `settings.api.workers` processes on one port (Postgres:
    they share nothing in memory that correctness depends on; SQLite has one writer per file)."""
    bootstrap.trust_configured_ca(settings)
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
        "gpucloud.entrypoints.api:create_app_from_env",
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
