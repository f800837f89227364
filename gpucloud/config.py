"""Every setting of gpucloud, in one nested model read from the environment.

One naming scheme: `GPUCLOUD_<SECTION>__<FIELD>` (two underscores between section and field),
for example `GPUCLOUD_TEMPORAL__ADDRESS`, `GPUCLOUD_DATABASE__URL`, `GPUCLOUD_OBJECT_STORE__BUCKET`;
top-level fields have no section (`GPUCLOUD_DATA_DIR`). Secrets are `SecretStr`: they never
appear in a repr or a log line. A secrets directory (`GPUCLOUD_SECRETS_DIR`, say a Kubernetes
or Docker secret mount) holds one file per variable, named as the variable
(`GPUCLOUD_DATABASE__URL`), holding its value; variables in the environment win over files.
A `GPUCLOUD_*` variable (or secrets file) that is neither a setting nor one of `NOT_SETTINGS`
stops the process, naming the setting it most resembles: a misspelt or renamed variable would
otherwise be ignored without a word (`GPUCLOUD_DATABASE_URL`, the name before settings were
nested, ran a deployment on SQLite).
`gpucloud.bootstrap` is the only code that turns these settings into clients of outside systems.

The embedded defaults run everything on one machine (Temporal dev server, SQLite in the data
dir, local object store, simulated fleet on loopback); production points the same code at a
Temporal cluster, Postgres and S3 by configuration alone.
"""

from __future__ import annotations

import base64
import difflib
import ipaddress
import json
import os
import secrets
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

TASK_QUEUE = "gpucloud"
PREFIX = "GPUCLOUD_"

# Read only to refuse it at start, saying why (`TenantSettings`): a deployment that still sets it
# expects its tenants to get it, so the refusal names what to do instead.
RETIRED_SETTINGS = frozenset({"GPUCLOUD_TENANTS__DEFAULT_GPU_QUOTA"})
# `GPUCLOUD_*` variables read outside the settings model, by the name the code reads: where the
# settings live, the log level, the options of `gpucloud agent` taken from the environment
# (agent.env), the CLI's own (the API it calls, with which key, its config file and context),
# what a workload or an evaluation command is given, the dev server's config, and the test
# suite's (with every `GPUCLOUD_TEST_*`).
NOT_SETTINGS = (
    frozenset(
        {
            "GPUCLOUD_SECRETS_DIR",
            "GPUCLOUD_LOG_LEVEL",
            "GPUCLOUD_NODE_ID",
            "GPUCLOUD_AGENT_TOKEN",
            "GPUCLOUD_AGENT_METRICS_TOKEN",
            "GPUCLOUD_AGENT_ALLOW_SIMULATED",
            "GPUCLOUD_AGENT_METER_INTERVAL_S",
            "GPUCLOUD_API_URL",
            "GPUCLOUD_API_KEY",
            "GPUCLOUD_CONFIG",
            "GPUCLOUD_CONTEXT",
            "GPUCLOUD_ALLOCATION_ID",
            "GPUCLOUD_PROGRESS_FILE",  # what a workload touches to say it makes progress
            "GPUCLOUD_MODEL_DIR",
            "GPUCLOUD_TEMPORAL_CONFIG",
            "GPUCLOUD_RECORD_HISTORIES",
            "GPUCLOUD_CHAOS_SEED",
        }
    )
    | RETIRED_SETTINGS
)
NOT_SETTINGS_PREFIXES = ("GPUCLOUD_TEST_",)


class UnknownSetting(ValueError):
    """A `GPUCLOUD_*` variable, or a file of the secrets directory, that nothing reads."""


def evaluation_task_queue(task_queue: str) -> str:
    """The evaluation worker's task queue beside the control plane's `task_queue`: the workflow
    derives it from its own queue, so each deployment (and each test) has its own."""
    return f"{task_queue}-evaluations"


class TemporalSettings(BaseModel):
    """The Temporal service the workers and the API talk to, and one worker's capacity."""

    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    task_queue: str = TASK_QUEUE
    # Activity concurrency of one worker process (DB and agent calls run in threads / asyncio).
    worker_max_activities: int = 64
    # On SIGTERM a worker stops polling and gives the activities it runs this long to finish
    # before they are cancelled (and retried elsewhere): a restart drains, it does not drop work.
    worker_drain_s: float = 30.0
    # How long the namespace `gpucloud prepare` registers keeps closed workflows' histories.
    namespace_retention_s: float = 30 * 86_400.0
    # TLS to the frontend: on with `tls` or any file below; the CA that signed the frontend's
    # certificate (else the system's), and a client certificate and key for mutual TLS.
    tls: bool = False
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_server_name: str | None = None
    # An API key (Temporal Cloud, or a cluster with an authorizer), sent as a bearer token.
    api_key: SecretStr | None = None
    # A frontend off loopback is reached only over TLS, unless this says the network between is
    # trusted: histories carry every workflow's input, and the API key travels in each call.
    allow_insecure: bool = False
    # The keys that seal every payload (`adapters/temporal.py`): base64 of 32 bytes each,
    # separated by newlines or commas, the newest last (it seals new payloads; the older ones
    # still open what they sealed). Without them, keys kept in the data dir (created 0600).
    codec_keys: SecretStr | None = None
    # `gpucloud codec-server`: the Web UI's (and `temporal --codec-endpoint`'s) decoder, for
    # operators only; it binds loopback unless told otherwise, and answers only the operator token.
    codec_server_host: str = "127.0.0.1"
    codec_server_port: int = 8088
    # The Web UI's origin, allowed to call the codec server from a browser (CORS).
    codec_server_ui_origin: str = "http://127.0.0.1:8233"

    @model_validator(mode="after")
    def _tls_off_loopback(self) -> TemporalSettings:
        host = self.address.rsplit(":", 1)[0].strip("[]")
        tls_asked = self.tls or self.tls_ca_file is not None or self.tls_cert_file is not None
        if not is_loopback(host) and not tls_asked and not self.allow_insecure:
            raise ValueError(
                f"Temporal at {self.address} would be reached without TLS: set GPUCLOUD_TEMPORAL__TLS=true "
                "(with GPUCLOUD_TEMPORAL__TLS_CA_FILE for a private CA), or GPUCLOUD_TEMPORAL__ALLOW_INSECURE=true "
                "on a network you trust"
            )
        return self

    @property
    def evaluation_task_queue(self) -> str:
        return evaluation_task_queue(self.task_queue)


class DatabaseSettings(BaseModel):
    """The control-plane database: SQLite in the data dir unless a URL is given (Postgres:
    `postgresql+psycopg://user:password@host/db`)."""

    url: SecretStr | None = None
    # Whether the API and the worker run the migrations when they start. Unset: only on SQLite
    # (the embedded, one-host default); with Postgres run `gpucloud migrate` as a deployment step,
    # and the processes check that the schema is current and refuse to run otherwise.
    migrate_on_start: bool | None = None


class ApiSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    # The API's URL as the processes that call it reach it (agents on nodes, the tracker, the
    # workers' links): `https://api.internal:8000`. Unset: this host's own, from host and port
    # (a wildcard bind reached on loopback).
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+(/[^\s]*)?$")
    # The bootstrap operator's bearer token (the admin named `bootstrap`, who creates the named
    # operators: `services.operators`); without one, a token kept in the data dir (created 0600).
    operator_token: SecretStr | None = None
    # How long a named operator's token lives unless its create or rotate says otherwise.
    operator_token_lifetime_s: int = Field(default=90 * 86400, ge=60, le=366 * 86400)
    # Signs page tokens; every API process of a deployment needs the same one. Without one, a
    # secret kept in the data dir (created 0600).
    page_token_secret: SecretStr | None = None
    # The largest request body (413 past it), read only once the caller is authenticated;
    # registry chunk uploads have their own limit (`registry.max_chunk_size`).
    max_body_bytes: int = 8 * 1024 * 1024
    # API processes sharing the port (uvicorn workers); more than one needs Postgres.
    workers: int = 1
    # Admission (`api/admission.py`): requests in flight per lane, a tenant's share of its lane
    # (all its keys together), a node's share of the agents' lane, and how long a request waits
    # for a slot before it is answered 503 with Retry-After.
    tenant_slots: int = 32
    operator_slots: int = 8
    agent_slots: int = 12
    caller_share: float = 0.5
    node_share: float = 0.25
    admission_wait_s: float = 2.0
    # How long each API process remembers who a token is (`api/gate.py`): a revoked key or a
    # replaced node credential keeps working in a process for at most this long.
    credential_cache_s: float = 5.0
    # Live (not revoked, not expired) API keys a tenant may hold; one more is a 409.
    max_api_keys_per_tenant: int = 20
    # The API's delegated signing key: its own Ed25519 key and the certificate the issuer key
    # signed for it (`gpucloud issue-delegate`, `web/service_tokens.py`); the API never reads the
    # issuer key. Default `<data dir>/api_delegate.pem`.
    delegate_key: Path | None = None


class RequestBodySettings(BaseModel):
    """How every server reads a request body once it knows who calls (`web/gate.py`)."""

    # The largest body (413 past it); the API has its own (`api.max_body_bytes`, chunk uploads
    # `registry.max_chunk_size`).
    max_bytes: int = Field(default=8 * 1024 * 1024, ge=0)
    # How long a server waits for a body's bytes (408 past it, the connection closed), plus one
    # second for each `min_bytes_per_s` received: a large body must keep arriving at that pace.
    read_deadline_s: float = Field(default=10.0, gt=0)
    min_bytes_per_s: int = Field(default=256 * 1024, gt=0)


class AgentSettings(BaseModel):
    """How the control plane reaches host agents, the simulated fleet that stands in for them, and
    the host agent's own options on a node (`gpucloud agent`: each flag wins over its setting)."""

    # Agent heartbeats older than this make a node unreachable for the reconciler.
    heartbeat_timeout_s: float = 90.0
    # How often a bring-up batch calls an unreachable agent (delays doubling from the base)
    # before it leaves that node to the reconciler's backoff.
    batch_attempts: int = 4
    batch_retry_base_s: float = 0.5
    # The simulated fleet's one HTTP server (`gpucloud sim`).
    sim_host: str = "127.0.0.1"
    sim_port: int = 8100
    # The login user of the nodes' image: the tenant's SSH keys go to its authorized_keys (the
    # agent's `--ssh-user`), and the allocation's nodes show `ssh -p <port> <user>@<host>`.
    ssh_user: str = Field("ubuntu", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    # How often agents meter usage (the agent's `--meter-interval-s`; the simulated fleet's too).
    meter_interval_s: float = 60.0
    # The control plane's Ed25519 key that signs its calls to agents (`web/service_tokens.py`);
    # default `<data dir>/issuer_key.pem`, its public half (what agents get) beside it as `.pub`.
    issuer_key: Path | None = None
    # Derives the credential each wipe hands a node's agent; every worker needs the same one.
    # Without one, a secret kept in the data dir (created 0600).
    credential_secret: SecretStr | None = None

    # The host agent on a node (`gpucloud agent --help` says what each is; its flag wins).
    # This node's id, as enrolled (`--node-id`).
    node_id: str | None = None
    # The action API's management address and port; off loopback only over TLS (`tls_cert`,
    # `tls_key`), unless `insecure` says the network is trusted.
    host: str = "127.0.0.1"
    port: int = 8200
    tls_cert: Path | None = None
    tls_key: Path | None = None
    insecure: bool = False
    # A CA the control plane's and the ledger's certificates are checked against, besides
    # GPUCLOUD_TLS__CA_FILE.
    ca_file: Path | None = None
    # This node's credential (`gpa_<node id>.<secret>`), where it keeps it (a wipe replaces it),
    # a re-imaged boot's config drive that redeems a one-time token for it, and the control
    # plane's public key (only its calls are served).
    token: SecretStr | None = None
    token_file: Path = Path("/var/lib/gpucloud/agent-credential")
    enrollment_file: Path = Path("/run/gpucloud/config-drive/enrollment.json")
    control_plane_key: Path = Path("/etc/gpucloud/control-plane.pub")
    # Tenant files (removed on wipe), what the agent keeps across restarts, the tenant's weights
    # (default `<state_dir>/weights`), the booted image's digest file, the durable usage spool.
    scratch_dir: Path = Path("/var/lib/gpucloud/scratch")
    state_dir: Path = Path("/var/lib/gpucloud/agent")
    weights_dir: Path | None = None
    image_digest_file: Path = Path("/etc/gpucloud/image-digest")
    spool: Path = Path("/var/lib/gpucloud/usage-spool.db")
    # Block devices the tenant writes to, erased on every wipe (`/dev/nvme1n1`, ...).
    tenant_disks: list[str] = []
    # The CLI that runs workloads' images (unset: podman, else docker, on PATH), and how much of
    # a workload's output is kept (unset: `agent/workload_logs.py`'s 10 MiB a file, 5 files).
    container_runtime: str | None = None
    workload_log_max_bytes: int | None = Field(None, ge=1)
    workload_log_files: int | None = Field(None, ge=1)
    # Seconds between heartbeats, and between counter readings, sent to the control plane.
    heartbeat_s: float = Field(10.0, gt=0)
    reading_s: float = Field(30.0, gt=0)
    # Simulate GPUs where NVML is absent (a dev machine only).
    allow_simulated: bool = False
    # The kernel log followed for PCIe AER, NVRM and NIC lines (`agent/kernel_log.py`); empty:
    # not followed (the InfiniBand ports are still sampled).
    kernel_log: Path | None = Path("/dev/kmsg")

    @field_validator("kernel_log", mode="before")
    @classmethod
    def _empty_is_off(cls, value: object) -> object:
        return None if value == "" else value

    # The price-book GPU type (unset: from NVML's name).
    gpu_type: str | None = None
    # The bearer token Prometheus scrapes the agent's /metrics with (unset: off).
    metrics_token: SecretStr | None = None
    # The file the tenant's SSH keys go to (unset: ~<ssh_user>/.ssh/authorized_keys).
    authorized_keys: Path | None = None


class ReconcilerSettings(BaseModel):
    """The periodic sweep, the global cap on node operations and per-node backoff."""

    sweep_interval_s: float = 15.0
    max_concurrent_node_ops: int = 500
    sweep_batch: int = 1000
    # Per-node backoff: the base doubles per attempt, up to the cap.
    backoff_base_s: float = 5.0
    backoff_cap_s: float = 600.0
    # Bring-up of new nodes runs in batches of this many (one workflow, one activity per step).
    bringup_batch_size: int = 100
    # Multiplies every transient state's deadline (tests and demos shrink them).
    deadline_scale: float = 1.0
    # When at least this share of the nodes that report (and at least `silence_min_nodes` of
    # them) is silent past the heartbeat timeout, the silence is likelier the control plane's
    # (an overloaded API, a partition) than the hosts': an alert, and no power action until it
    # clears (`reconciler.plan.plan_sweep`).
    silence_max_share: float = Field(0.5, gt=0, le=1)
    silence_min_nodes: int = Field(10, ge=1)


class SchedulerSettings(BaseModel):
    """The pools' queues (`services/scheduling.py`, docs/scheduling.md): how often a pool with a
    queue is looked at again, and the fair-share policy's knobs (`scheduler/policy.py`)."""

    # A pool's scheduler re-plans this often while its queue is not empty (and at once when a
    # request is queued or cancelled); a queued allocation's workflow makes sure it runs this often.
    poll_s: float = Field(5.0, gt=0, le=300)
    queue_recheck_s: float = Field(60.0, gt=0, le=3600)
    # Usage halves every half-life (Slurm's PriorityDecayHalfLife); a request with no
    # expected_duration_s is charged this long for fair share.
    half_life_s: float = Field(7 * 86_400.0, gt=0)
    default_run_s: float = Field(3_600.0, gt=0)
    # A preemptible allocation taken back gets this much notice (an event) before its workload is
    # stopped (SIGTERM, then the agent's grace period) and its nodes released.
    preemption_notice_s: float = Field(120.0, ge=0, le=3600)
    # Capacity reservations: the earliest a window may start after it is booked; how long before
    # its start its nodes are held (the queue backfills them only with work that ends in time);
    # how long before its start its allocation is placed, so it is provisioned by then (preemptible
    # work on its nodes is taken back this much earlier again, plus its notice).
    reservation_min_notice_s: float = Field(600.0, ge=0)
    reservation_hold_s: float = Field(43_200.0, ge=0)
    reservation_prepare_s: float = Field(900.0, ge=0)


class HealthSettings(BaseModel):
    """The health loop and drain-and-replace."""

    # How long a tenant may checkpoint before a node with a non-fatal fault is pulled.
    drain_grace_s: float = 300.0
    # How often a degraded allocation looks for replacement capacity again.
    replacement_recheck_s: float = 30.0
    # Replacement nodes tried, per allocation, for nodes that fail provisioning.
    provision_retries: int = Field(3, ge=0)
    # The quarantine circuit breaker: the share of a pool pulled automatically within the window.
    breaker_max_pulled_share: float = 0.05
    breaker_window_s: float = 3600.0
    # Spare capacity (`services/spares.py`, `gpucloud fleet spares`, `GET /v1/fleet/spares`).
    # A pool's failures (its node incidents) and node-hours are counted over this window, and
    # each rack's and pool's MTBF, MTTR and MTTS (`services/reliability.py`).
    spares_window_s: float = Field(30 * 86_400.0, gt=0)
    # A pulled node's mean turnaround (drain, reset ladder, burn-in, or RMA) until it is back in
    # its pool: how long a spare stands in for it.
    spares_repair_s: float = Field(72 * 3600.0, ge=0)
    # How long after a pull its replacement may start. A node back from repair within it serves
    # as well as a spare, so the pool plans on the turnaround less this; 0: at once, from a spare
    # on hand.
    spares_replacement_target_s: float = Field(0.0, ge=0)
    # The probability that the spares a pool holds cover every node out for repair.
    spares_probability: float = Field(0.99, gt=0, lt=1)
    # A pool plans on its own measured rate (the Garwood upper bound) from this many node-hours
    # in the window, on the Llama 3 405B run's before: with no failure seen, the bound
    # (3.0 / node-hours) falls below the Llama 3 rate only past about 19,000 node-hours, so a
    # shorter record would only say "too little seen", not "fails more".
    spares_min_node_hours: float = Field(20_000.0, gt=0)
    # How often the reconciler's full sweep checks the pools: an operator alert for a pool short
    # of spares (one until it recovers), the `gpucloud_spares` gauges and the `gpucloud_mtbf_hours`,
    # `gpucloud_mttr_seconds` and `gpucloud_mtts_seconds` gauges.
    spares_check_interval_s: float = Field(300.0, gt=0)
    # An incident reads its node's history this often, and waits this long for the node to come
    # back (or go to RMA) before it closes as abandoned (`workflows/incident.py`).
    incident_poll_s: float = Field(30.0, gt=0)
    incident_max_wait_s: float = Field(7 * 86_400.0, gt=0)
    # Correlated faults (`health/correlation.py`): this many nodes (or this share of those behind
    # it, if more) behind one leaf switch, rack or PDU faulting within the window are one fleet
    # incident that suspects the component, and their node-level pulls are held.
    correlation_window_s: float = Field(300.0, gt=0)
    correlation_min_nodes: int = Field(3, ge=2)
    correlation_min_share: float = Field(0.0, ge=0, le=1)
    # Scheduled diagnostics of idle nodes (`services/diagnostics.py`, `AgentAction.DIAGNOSE`): a
    # node idle (available, healthy, neither cordoned nor in maintenance) that has not been
    # tested for this long (nor been through burn-in) is leased and diagnosed; at most this share
    # of the idle nodes (at least one) and this many at once, fleet-wide (0: none). A lease
    # lapses on its own after `diag_lease_s`; the reconciler's full sweep looks for due nodes
    # every `diag_check_interval_s`.
    diag_interval_s: float = Field(86_400.0, gt=0)
    diag_budget_share: float = Field(0.05, ge=0, le=1)
    diag_max_concurrent: int = Field(16, ge=0)
    diag_lease_s: float = Field(3600.0, gt=0)
    diag_check_interval_s: float = Field(60.0, gt=0)


class TenantSettings(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _no_default_quota(cls, data: object) -> object:
        # There is no default GPU quota any more: a tenant holds exactly what an operator granted
        # it (`services/quotas.py`). A deployment that still sets one expects every tenant to get
        # it; ignoring that quietly would refuse its tenants' allocations with no word why.
        if isinstance(data, dict) and "default_gpu_quota" in data:
            raise ValueError(
                "GPUCLOUD_TENANTS__DEFAULT_GPU_QUOTA is no longer read: tenants hold only the quotas granted "
                "to them; remove it and grant quotas at onboarding (`gpucloud tenants create NAME --quota "
                "H100:us-east-1=64`) or later (`gpucloud tenants quota TENANT_ID H100:us-east-1=64`)"
            )
        return data

    # How long onboarding may wait out outages of the fabric managers or the object store before
    # it gives up and undoes itself (an operator can extend it: the workflow's
    # `extend_deadline` signal).
    onboarding_deadline_s: float = 6 * 3600.0
    # An offboarded tenant's storage is deleted this long after offboarding.
    storage_retention_s: float = 30 * 86_400.0
    # How often offboarding looks whether the tenant's nodes are released and wiped.
    offboarding_poll_s: float = 5.0
    # Wraps every tenant's data key: base64 of 32 bytes, else one kept in the data dir (0600).
    storage_master_key: SecretStr | None = None


class LedgerSettings(BaseModel):
    """The billing ledger: its own service with its own database. Without a `url` the control
    plane bills nothing: it sends no allocation events, closes no periods, and the billing API
    answers 501. `gpucloud up` runs one on `port` and sets `url`."""

    url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8700
    database_url: SecretStr | None = None
    # Admission (`ledger/api/admission.py`): requests in flight from nodes' agents (at most
    # `node_share` of them for one node: tenants have root on the nodes they rent) and from the
    # control plane and operators; a request waits at most `admission_wait_s` for a slot.
    agent_slots: int = Field(32, ge=1, le=1024)
    node_share: float = Field(0.0625, gt=0, le=1)
    control_plane_slots: int = Field(16, ge=1, le=1024)
    admission_wait_s: float = Field(2.0, gt=0, le=60)
    # As `database.migrate_on_start`, for the ledger's own database.
    migrate_on_start: bool | None = None
    # How often the scheduled close looks for ended periods to close (and catches up).
    close_interval_s: float = 86_400.0


class FabricSettings(BaseModel):
    """The fabric managers (UFM, NMX-M, SDN). `url` serves all three, as the simulator does;
    the per-manager URLs win where the real managers live apart. With all three known, an
    allocation's fabric membership is applied and read back before its nodes become active and
    removed on release; with none (the embedded default) those steps are skipped and tenant
    VNIs are allocated in the control-plane DB. `gpucloud up` runs the simulated managers on
    `port` (0: a free port)."""

    url: str | None = None
    ufm_url: str | None = None
    nmx_url: str | None = None
    vpc_url: str | None = None
    port: int = 0
    # Each manager's own API token (sent as a bearer token; a leaked one opens one manager);
    # without one, a token kept in the data dir (created 0600), which the simulated managers of
    # `gpucloud up` are given too.
    ufm_token: SecretStr | None = None
    nmx_token: SecretStr | None = None
    vpc_token: SecretStr | None = None

    @property
    def manager_urls(self) -> tuple[str, str, str] | None:
        """(UFM, NMX-M, SDN) base URLs, or None when no fabric manager is configured."""
        urls = (self.ufm_url or self.url, self.nmx_url or self.url, self.vpc_url or self.url)
        if not any(urls):
            return None
        if not all(urls):
            raise ValueError(
                "fabric managers: set GPUCLOUD_FABRIC__URL, or all of GPUCLOUD_FABRIC__UFM_URL, "
                "GPUCLOUD_FABRIC__NMX_URL and GPUCLOUD_FABRIC__VPC_URL (an allocation cannot be "
                "isolated on some fabrics only)"
            )
        return urls  # type: ignore[return-value]


class ObjectStoreSettings(BaseModel):
    """The one object store behind registry chunks, signed manifests and tenant storage:
    a directory (`local`, the embedded default: `<data dir>/objects` unless `local_dir`) or an
    S3-compatible bucket (`s3`), with credentials from here when set, else boto3's usual chain."""

    backend: Literal["local", "s3"] = "local"
    local_dir: Path | None = None
    endpoint_url: str | None = None
    bucket: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None

    @model_validator(mode="after")
    def _s3_needs_a_bucket(self) -> ObjectStoreSettings:
        if self.backend == "s3" and not self.bucket:
            raise ValueError("GPUCLOUD_OBJECT_STORE__BUCKET is required when GPUCLOUD_OBJECT_STORE__BACKEND=s3")
        return self


class RegistrySettings(BaseModel):
    # Registry keys live under this prefix of the object store (tenant storage under `tenants/`).
    prefix: str = "registry"
    # The largest chunk the API accepts in one upload: the chunker's own maximum (64 MiB).
    max_chunk_size: int = 64 * 1024 * 1024
    # The bytes of chunks one tenant's registry store may hold (uploads past it: 409). 10 TiB
    # holds a dozen full versions of a 405B-parameter model in bf16 (810 GB each) before dedup,
    # and hundreds of fine-tunes that share their base's chunks; past that, the operator sets it.
    storage_quota_bytes: int = Field(10 * 1024**4, gt=0)
    # A version's logical size (what evaluation assembles and a pull writes), at most this, and
    # past `version_amplification_floor` at most `max_version_amplification` times its distinct
    # chunks' bytes (`Manifest.size_problem`). 4 TiB holds a 2-trillion-parameter model in bf16.
    max_version_bytes: int = Field(4 * 1024**4, gt=0)
    max_version_amplification: float = Field(16.0, ge=1)
    version_amplification_floor: int = Field(1024**3, ge=0)
    # `production` takes only a version a platform sanity evaluation has passed (no NaN or Inf
    # weight); off, a model without gates may promote a version nobody evaluated.
    production_requires_sanity: bool = True
    # The platform evaluator's Ed25519 seed (64 hex digits): it signs the results of the
    # evaluations the platform runs. Without one, a seed kept in the data dir (created 0600).
    evaluator_key: SecretStr | None = None
    # A model's evaluation command runs in a container of this runtime (podman or docker;
    # unset: the first of them on PATH). A command without an image runs on the worker's host
    # only where the operator allows it (`evaluation_host_commands`): it is the tenant's code.
    evaluation_runtime: str | None = None
    evaluation_host_commands: bool = False
    # Where the evaluation worker pulls versions to evaluate (removed after each run); unset:
    # its data dir.
    evaluation_dir: Path | None = None
    # The most bytes one evaluation assembles on that disk (the version and its parent, by
    # their manifests, checked before a byte is written); the disk's free space bounds it too.
    evaluation_disk_budget_bytes: int = Field(default=1024**4, gt=0)
    # Evaluations one evaluation worker runs at once (each reads a whole model).
    evaluations_at_once: int = Field(default=2, gt=0)
    # The life of the token an evaluation pulls its version (and parent) through the API with:
    # the pull comes first, so it need only outlast that; a retry after it ends is refused.
    evaluation_token_ttl_s: float = Field(default=3600.0, gt=0)


class TrackerSettings(BaseModel):
    """The weight tracker that hands nodes their peers (and the origin) for a version."""

    url: str = "http://127.0.0.1:8480"
    # The address the tracker binds to (`0.0.0.0` for every interface); unset: the URL's host.
    # The port is the URL's.
    host: str | None = None
    # How long the tracker trusts its last read of which allocation each swarm node is in: a
    # node that leaves its tenant's allocation loses the tracker and the origin within this.
    holders_fresh_s: float = Field(5.0, gt=0)


class BmcSettings(BaseModel):
    """Out-of-band management: each node's BMC over Redfish (`adapters/bmc.py`)."""

    # One file per credential reference a node names, holding `username:password` (0600);
    # default `<data dir>/bmc_credentials`. Node rows keep the reference, never the secret.
    credentials_dir: Path | None = None
    # One Redfish request (connect and read).
    timeout_s: float = Field(10.0, gt=0)
    # A power change the BMC accepted must show in its power state within this.
    power_wait_s: float = Field(120.0, gt=0)
    poll_s: float = Field(1.0, gt=0)
    # After a power-on, the node's agent must heartbeat again within this.
    boot_wait_s: float = Field(600.0, gt=0)
    # An agent silent this long (past the heartbeat timeout) on a node with a BMC is power-cycled.
    power_cycle_after_s: float = Field(300.0, gt=0)
    # The firmware image the repair ladder's `reflash` asks a BMC's UpdateService to install
    # (Redfish SimpleUpdate; where the BMC has none, or this is unset, the agent reflashes).
    firmware_image_uri: str | None = None
    # The known image a node whose tenant left boots once through its BMC's virtual media
    # (`activities/bmc.py`, cleaning), and the sha256 (hex) its booted agent must report. Unset,
    # or a node without a BMC or virtual media: the in-band wipe alone, recorded as weaker.
    clean_image_url: str | None = None
    clean_image_sha256: str | None = Field(None, pattern="^[0-9a-f]{64}$")
    # How long a re-imaged node's one-time enrollment token (in its config drive) may be redeemed.
    enrollment_ttl_s: float = Field(900.0, gt=0)
    # The Redfish emulator (sushy-tools) `gpucloud up` runs for the simulated fleet, and how many
    # seconds (low, high) after it was asked for a power change applies there (hardware's 1 to 11;
    # the demo and the tests wait less).
    emulator_port: int = 8600
    emulator_power_delay_s: tuple[int, int] = (1, 11)
    # A BMC off loopback is reached only over https (its credential travels in every request),
    # unless this says the management network is trusted.
    allow_insecure: bool = False

    @field_validator("emulator_power_delay_s")
    @classmethod
    def _delay_range(cls, value: tuple[int, int]) -> tuple[int, int]:
        return power_delay_range(*value)


def power_delay_range(low: int, high: int) -> tuple[int, int]:
    """(low, high) seconds a power change may take on the emulated BMCs; ValueError unless
    1 <= low <= high (the emulator's fake driver applies a change at a whole second after now)."""
    if not 1 <= low <= high:
        raise ValueError(f"want 1 <= low <= high seconds, got [{low}, {high}]")
    return low, high


class TelemetrySettings(BaseModel):
    """Prometheus metrics. Every server serves `/metrics` to a caller with the metrics token
    (Prometheus' `authorization` in its scrape config) or the operator token; the worker serves
    it (with `/healthz` and `/readyz`) on `worker_port` when one is set."""

    # The bearer token scrapers send; without one, a token kept in the data dir (created 0600).
    metrics_token: SecretStr | None = None
    # Log lines as text, or one JSON object each with the tenant, allocation and node ids (`logs.py`).
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"
    # OpenTelemetry traces over OTLP/HTTP (`http://collector:4318/v1/traces`); unset: no tracing.
    otlp_endpoint: str | None = None
    worker_host: str = "127.0.0.1"
    worker_port: int | None = None


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and key (PEM files), as `web/tls.py` serves them."""

    cert_file: Path
    key_file: Path


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TLSSettings(BaseModel):
    """TLS for every server of the control plane and the CA every client verifies them against
    (`web/tls.py`). With `cert_file` and `key_file` each server speaks only TLS; without them a
    server binds loopback only, unless `insecure`. `gpucloud up --tls` makes a private CA and a
    certificate in `<data dir>/tls` and sets all three."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    insecure: bool = False

    @property
    def server(self) -> ServerTLS | None:
        if self.cert_file is None or self.key_file is None:
            if self.cert_file is not None or self.key_file is not None:
                raise ValueError("TLS needs both GPUCLOUD_TLS__CERT_FILE and GPUCLOUD_TLS__KEY_FILE")
            return None
        return ServerTLS(self.cert_file, self.key_file)

    @property
    def scheme(self) -> str:
        return "https" if self.server is not None else "http"


class SecretFiles(EnvSettingsSource):
    """Settings from files named as their variables, in a directory (see the module doc)."""

    def __init__(self, settings_cls: type[BaseSettings], directory: Path) -> None:
        self.directory = directory
        super().__init__(settings_cls)

    def _load_env_vars(self) -> dict[str, str | None]:
        if not self.directory.is_dir():
            raise ValueError(f"GPUCLOUD_SECRETS_DIR={self.directory} is not a directory")
        return {
            path.name.lower(): path.read_text().strip()
            for path in self.directory.iterdir()
            if path.is_file() and path.name.upper().startswith(PREFIX)
        }


def refuse_unknown_variables(environ: Mapping[str, str] = os.environ) -> None:
    """Raise `UnknownSetting` for a `GPUCLOUD_*` variable of `environ`, or a file of its secrets
    directory, that nothing reads (see the module doc). Only settings are read from the secrets
    directory: a file there named as a variable read elsewhere (the agent's token, the CLI's key)
    is read by nobody, so it is refused as a misspelling is."""
    refuse_unknown(environ)
    directory = Path(environ.get("GPUCLOUD_SECRETS_DIR") or "")
    if environ.get("GPUCLOUD_SECRETS_DIR") and directory.is_dir():  # else `SecretFiles` says it is missing
        refuse_unknown(
            [p.name for p in directory.iterdir() if p.is_file()],
            where=f"in GPUCLOUD_SECRETS_DIR ({directory})",
            allowed=RETIRED_SETTINGS,
            allowed_prefixes=(),
        )


def setting_names() -> frozenset[str]:
    """Every variable the settings read: `GPUCLOUD_<FIELD>` for each top-level field and section
    (a section takes a JSON object too), and `GPUCLOUD_<SECTION>__<FIELD>` for each field of one."""
    names = set()
    for name, field in Settings.model_fields.items():
        names.add(f"{PREFIX}{name.upper()}")
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            names.update(f"{PREFIX}{name.upper()}__{inner.upper()}" for inner in section.model_fields)
    return frozenset(names)


def refuse_unknown(
    names: Iterable[str],
    *,
    where: str = "in the environment",
    allowed: frozenset[str] = NOT_SETTINGS,
    allowed_prefixes: tuple[str, ...] = NOT_SETTINGS_PREFIXES,
) -> None:
    """Raise `UnknownSetting` for the `GPUCLOUD_*` names in `names` that are neither settings nor
    `allowed`, each with the setting it most resembles (names are compared in capitals, as the
    settings read them whatever their case)."""
    known = setting_names()
    unknown = sorted(
        {
            upper
            for upper in (name.upper() for name in names)
            if upper.startswith(PREFIX)
            and upper not in known
            and upper not in allowed
            and not upper.startswith(allowed_prefixes)
        }
    )
    if not unknown:
        return
    # Compared without the prefix every name shares, which would make any two look alike.
    candidates = {name.removeprefix(PREFIX): name for name in known | allowed}
    lines = []
    for name in unknown:
        nearest = difflib.get_close_matches(name.removeprefix(PREFIX), sorted(candidates), n=1, cutoff=0.6)
        hint = f"did you mean {candidates[nearest[0]]}?" if nearest else "no setting is named like it"
        lines.append(f"{name} ({hint})")
    raise UnknownSetting(
        f"unknown gpucloud variable{'s' if len(lines) > 1 else ''} {where}: {'; '.join(lines)}. Nothing reads "
        f"{'them' if len(lines) > 1 else 'it'}: rename or remove {'them' if len(lines) > 1 else 'it'} "
        "(every setting is GPUCLOUD_<SECTION>__<FIELD>, two underscores; gpucloud/config.py lists them)"
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUCLOUD_", env_nested_delimiter="__", extra="ignore")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Each time settings are built, so every process (and each of the API's workers) refuses
        # a variable it would otherwise ignore, before it does anything with the others.
        refuse_unknown_variables(os.environ)
        directory = os.environ.get("GPUCLOUD_SECRETS_DIR")
        files = (SecretFiles(settings_cls, Path(directory)),) if directory else ()
        return (init_settings, env_settings, *files)

    data_dir: Path = Path(".data")
    temporal: TemporalSettings = TemporalSettings()
    database: DatabaseSettings = DatabaseSettings()
    api: ApiSettings = ApiSettings()
    request_body: RequestBodySettings = RequestBodySettings()
    agent: AgentSettings = AgentSettings()
    reconciler: ReconcilerSettings = ReconcilerSettings()
    health: HealthSettings = HealthSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    tenants: TenantSettings = TenantSettings()
    ledger: LedgerSettings = LedgerSettings()
    fabric: FabricSettings = FabricSettings()
    object_store: ObjectStoreSettings = ObjectStoreSettings()
    registry: RegistrySettings = RegistrySettings()
    tracker: TrackerSettings = TrackerSettings()
    tls: TLSSettings = TLSSettings()
    bmc: BmcSettings = BmcSettings()
    telemetry: TelemetrySettings = TelemetrySettings()

    @property
    def database_url(self) -> str:
        if self.database.url is not None:
            return self.database.url.get_secret_value()
        return f"sqlite:///{(self.data_dir / 'gpucloud.db').resolve()}"

    @property
    def migrates_on_start(self) -> bool:
        chosen = self.database.migrate_on_start
        return self.database_url.startswith("sqlite") if chosen is None else chosen

    @property
    def ledger_migrates_on_start(self) -> bool:
        chosen = self.ledger.migrate_on_start
        return self.ledger_database_url.startswith("sqlite") if chosen is None else chosen

    @property
    def ledger_database_url(self) -> str:
        if self.ledger.database_url is not None:
            return self.ledger.database_url.get_secret_value()
        return f"sqlite:///{(self.data_dir / 'ledger.db').resolve()}"

    @property
    def api_url(self) -> str:
        if self.api.url:
            return self.api.url.rstrip("/")
        host = "127.0.0.1" if self.api.host in ("0.0.0.0", "::", "") else self.api.host
        return f"{self.tls.scheme}://{host}:{self.api.port}"

    @property
    def sim_url(self) -> str:
        return f"{self.tls.scheme}://{self.agent.sim_host}:{self.agent.sim_port}"

    @property
    def object_store_dir(self) -> Path:
        return (self.object_store.local_dir or self.data_dir / "objects").resolve()

    @cached_property
    def operator_token(self) -> str:
        """The operator token: from the settings, else the one kept in the data dir (created 0600)."""
        if self.api.operator_token is not None:
            return self.api.operator_token.get_secret_value()
        return load_or_create_operator_token(self.data_dir)

    @property
    def bmc_credentials_dir(self) -> Path:
        return (self.bmc.credentials_dir or self.data_dir / "bmc_credentials").resolve()

    @property
    def issuer_key_path(self) -> Path:
        return (self.agent.issuer_key or self.data_dir / "issuer_key.pem").resolve()

    @property
    def api_delegate_path(self) -> Path:
        return (self.api.delegate_key or self.data_dir / "api_delegate.pem").resolve()

    @cached_property
    def agent_credential_secret(self) -> str:
        """Derives the agent credential each wipe hands a node (every worker the same)."""
        if self.agent.credential_secret is not None:
            return self.agent.credential_secret.get_secret_value()
        return load_or_create_secret(self.data_dir / "agent_credential_secret", lambda: secrets.token_urlsafe(32))

    @cached_property
    def evaluator_seed(self) -> bytes:
        """The platform evaluator's signing seed: from the settings, else kept in the data dir."""
        if self.registry.evaluator_key is not None:
            return bytes.fromhex(self.registry.evaluator_key.get_secret_value())
        return bytes.fromhex(load_or_create_secret(self.data_dir / "evaluator_key", lambda: secrets.token_hex(32)))

    @property
    def evaluation_dir(self) -> Path:
        return (self.registry.evaluation_dir or self.data_dir / "evaluations").resolve()

    @cached_property
    def metrics_token(self) -> str:
        """The token Prometheus scrapes `/metrics` with: from the settings, else kept in the data dir."""
        if self.telemetry.metrics_token is not None:
            return self.telemetry.metrics_token.get_secret_value()
        return load_or_create_secret(self.data_dir / "metrics_token", lambda: secrets.token_urlsafe(32))

    @cached_property
    def temporal_codec_keys(self) -> str:
        """The payload keys (`TemporalSettings.codec_keys`): from the settings, else kept in the
        data dir (a rotation appends a key to that file: `gpucloud codec-key-rotate`)."""
        if self.temporal.codec_keys is not None:
            return self.temporal.codec_keys.get_secret_value()
        return load_or_create_secret(self.temporal_codec_keys_path, lambda: base64.b64encode(os.urandom(32)).decode())

    @property
    def temporal_codec_keys_path(self) -> Path:
        return (self.data_dir / "temporal_codec_keys").resolve()

    @cached_property
    def page_token_secret(self) -> str:
        """The key page tokens are signed with: from the settings, else kept in the data dir."""
        if self.api.page_token_secret is not None:
            return self.api.page_token_secret.get_secret_value()
        return load_or_create_secret(self.data_dir / "page_token_secret", lambda: secrets.token_urlsafe(32))

    def for_evaluation_worker(self) -> Settings:
        """The evaluation worker's settings (it runs tenants' code): how to reach Temporal and
        run a command, and nothing else. No database, no object store (it pulls each version
        through the API with a token scoped to it, sent with the evaluation), no operator, metrics
        or fabric token, no issuer, evaluator or storage master key; a data dir of its own, under
        this one, that holds none of the platform's secrets. It does hold the Temporal payload
        keys, without which it could not read the evaluations it is sent, and the CA the API's
        certificate is verified against (public)."""
        # model_construct: the constructor (and model_validate) would read this process's
        # environment and secrets dir back in; every other section keeps its default.
        return Settings.model_construct(
            data_dir=self.data_dir.resolve() / "evaluation-worker",
            # The payload keys: it decodes its activities' inputs as every worker does (the one
            # secret it holds; the commands it runs get none of its environment).
            temporal=self.temporal.model_copy(update={"codec_keys": SecretStr(self.temporal_codec_keys)}),
            registry=self.registry.model_copy(update={"evaluator_key": None}),
            tls=TLSSettings.model_construct(ca_file=self.tls.ca_file),
            telemetry=self.telemetry.model_copy(update={"metrics_token": None, "worker_port": None}),
        )

    def env(self) -> dict[str, str]:
        """These settings as `GPUCLOUD_*` variables, for a child process to read back the same."""
        out = {"GPUCLOUD_DATA_DIR": str(self.data_dir.resolve())}
        for section, model in self:
            if not isinstance(model, BaseModel):
                continue
            for name, value in model:
                if value is None:
                    continue
                if isinstance(value, SecretStr):
                    value = value.get_secret_value()
                # A list or tuple is read back from JSON, as pydantic-settings reads complex values.
                text = json.dumps(value) if isinstance(value, list | tuple) else str(value)
                out[f"GPUCLOUD_{section.upper()}__{name.upper()}"] = text
        return out


def load_or_create_operator_token(data_dir: Path) -> str:
    return load_or_create_secret(data_dir / "operator_token", lambda: "gpcop_" + secrets.token_urlsafe(32))


def write_private(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data`, readable by its owner only (0600), whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


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
