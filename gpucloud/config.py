"""One place that decides how gpucloud is wired: every setting comes from `GPUCLOUD_*` env vars.

The embedded defaults run everything on one laptop (Temporal dev server, SQLite in the data dir,
simulated fleet on loopback); production points the same code at a Temporal cluster, Postgres
and S3 by configuration alone.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from pydantic import Field
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
    # Bring-up of new nodes runs in batches of this many (one workflow, one activity per step).
    bringup_batch_size: int = 100
    # How often a batch calls an unreachable agent (delays doubling from the base) before it
    # leaves that node to the reconciler's backoff.
    agent_batch_attempts: int = 4
    agent_batch_retry_base_s: float = 0.5
    # Health loop: how long a tenant may checkpoint before a node with a non-fatal fault is
    # pulled; how often a degraded allocation looks for replacement capacity again; the
    # quarantine circuit breaker (share of a pool pulled automatically within the window).
    health_drain_grace_s: float = 300.0
    replacement_recheck_s: float = 30.0
    # Replacement nodes tried, per allocation, for nodes that fail provisioning.
    provision_retries: int = Field(3, ge=0)
    breaker_max_pulled_share: float = 0.05
    breaker_window_s: float = 3600.0
    # Weight rollouts: the tracker that hands nodes their peers (and the origin) for a version.
    tracker_url: str = "http://127.0.0.1:8480"
    # Activity concurrency of one worker process (DB and agent calls run in threads / asyncio).
    worker_max_activities: int = 64
    # Billing. The ledger is its own service with its own database; `gpucloud up` runs one on
    # `ledger_port` and sets `ledger_url`. Without a `ledger_url` the control plane bills
    # nothing: it sends no allocation events, closes no periods, and the billing API answers 503.
    ledger_url: str | None = None
    ledger_port: int = 8700
    ledger_database_url: str | None = None
    # How often the scheduled close looks for ended periods to close (and catches up on missed ones).
    billing_close_interval_s: float = 86_400.0
    # How often the simulated fleet's agents meter usage (real agents: every 60 s).
    meter_interval_s: float = 60.0
    # Tenants. A new tenant may hold this many GPUs of each type in each region unless its
    # create request says otherwise (1,024 nodes of 8: the largest single allocation).
    default_gpu_quota: int = 8192
    # The fabric managers (UFM, NMX-M, SDN), all at one base URL as the simulator serves them.
    # With none configured, tenant VNIs are allocated in the control-plane DB instead of by SDN.
    fabric_url: str | None = None
    # Per-manager URLs, where the real managers live apart (each defaults to `fabric_url`). With
    # all three known, an allocation's fabric membership is applied and read back before its
    # nodes become active and removed on release; with none (the embedded default) those steps
    # are skipped. `gpucloud up` runs the simulated managers on `fabric_port` (0: a free port).
    fabric_ufm_url: str | None = None
    fabric_nmx_url: str | None = None
    fabric_vpc_url: str | None = None
    fabric_port: int = 0
    # Tenant storage: an S3 bucket when `storage_bucket` is set (boto3's usual credentials;
    # `storage_endpoint_url` for S3-compatible stores), else the `objects` folder in the data
    # dir. The master key wraps every tenant's data key: base64 of 32 bytes, else one kept in
    # the data dir (created 0600).
    storage_bucket: str | None = None
    storage_endpoint_url: str | None = None
    storage_master_key: str | None = None
    # An offboarded tenant's storage is deleted this long after offboarding.
    tenant_storage_retention_s: float = 30 * 86_400.0
    # How often offboarding looks whether the tenant's nodes are released and wiped.
    offboarding_poll_s: float = 5.0

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'gpucloud.db').resolve()}"

    @property
    def ledger_db_url(self) -> str:
        if self.ledger_database_url:
            return self.ledger_database_url
        return f"sqlite:///{(self.data_dir / 'ledger.db').resolve()}"

    @property
    def fabric_manager_urls(self) -> tuple[str, str, str] | None:
        """(UFM, NMX-M, SDN) base URLs, or None when no fabric manager is configured."""
        urls = (
            self.fabric_ufm_url or self.fabric_url,
            self.fabric_nmx_url or self.fabric_url,
            self.fabric_vpc_url or self.fabric_url,
        )
        if not any(urls):
            return None
        if not all(urls):
            raise ValueError(
                "fabric managers: set GPUCLOUD_FABRIC_URL, or all of GPUCLOUD_FABRIC_UFM_URL, "
                "GPUCLOUD_FABRIC_NMX_URL and GPUCLOUD_FABRIC_VPC_URL (an allocation cannot be "
                "isolated on some fabrics only)"
            )
        return urls

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
    return load_or_create_secret(data_dir / "operator_token", lambda: "gpcop_" + secrets.token_urlsafe(32))


def load_or_create_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret kept in `path`, created 0600 with `make()` the first time."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = make()
    # Written whole to a temporary file, then linked into place (which fails if the file exists):
    # two processes starting at once agree on one secret, and neither reads a half-written one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        os.link(tmp, path)
    except FileExistsError:
        return path.read_text().strip()
    finally:
        os.unlink(tmp)
    return secret


def get_settings() -> Settings:
    return Settings()
