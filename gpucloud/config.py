"""One place that decides how gpucloud is wired: every setting comes from `GPUCLOUD_*` env vars.

The embedded defaults run everything on one laptop (Temporal dev server, SQLite in the data dir,
simulated fleet on loopback); production points the same code at a Temporal cluster, Postgres
and S3 by configuration alone.
"""

from __future__ import annotations

import os
import secrets
from functools import cached_property
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

TASK_QUEUE = "gpucloud"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUCLOUD_", extra="ignore")

    data_dir: Path = Path(".data")
    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    task_queue: str = TASK_QUEUE
    database_url: str | None = None
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    sim_host: str = "127.0.0.1"
    sim_port: int = 8100
    operator_token: str | None = None
    # Multiplies every transient state's deadline (tests and demos shrink them).
    deadline_scale: float = 1.0
    # Reconciler: sweep period, heartbeat staleness, global cap on concurrent node operations,
    # per-node backoff (base doubles per attempt, up to the cap).
    sweep_interval_s: float = 15.0
    heartbeat_timeout_s: float = 90.0
    max_concurrent_node_ops: int = 500
    sweep_batch: int = 1000
    backoff_base_s: float = 5.0
    backoff_cap_s: float = 600.0
    # Health loop: how long a tenant may checkpoint before a node with a non-fatal fault is
    # pulled; how often a degraded allocation looks for replacement capacity again; the
    # quarantine circuit breaker (share of a pool pulled automatically within the window).
    health_drain_grace_s: float = 300.0
    replacement_recheck_s: float = 30.0
    breaker_max_pulled_share: float = 0.05
    breaker_window_s: float = 3600.0
    # Activity concurrency of one worker process (DB and agent calls run in threads / asyncio).
    worker_max_activities: int = 64

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'gpucloud.db').resolve()}"

    @property
    def api_url(self) -> str:
        return f"http://{self.api_host}:{self.api_port}"

    @property
    def sim_url(self) -> str:
        return f"http://{self.sim_host}:{self.sim_port}"

    @cached_property
    def resolved_operator_token(self) -> str:
        """The operator token: from the env, else the one kept in the data dir (created 0600)."""
        if self.operator_token:
            return self.operator_token
        return load_or_create_operator_token(self.data_dir)


def load_or_create_operator_token(data_dir: Path) -> str:
    path = data_dir / "operator_token"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    token = "gpcop_" + secrets.token_urlsafe(32)
    # O_EXCL: two processes starting at once agree on one token.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def get_settings() -> Settings:
    return Settings()
