"""The only code that turns settings into clients of outside systems, real or simulated.

Every process (the API, the worker, the ledger, the tracker, the agent, the CLI, `up`) gets its
adapters here; nothing else constructs a client from settings. Each outside system has one
client: the Temporal client (`adapters.temporal`), the control-plane database (`db`), nodes'
BMCs (Redfish through sushy: `adapters.bmc`, real ones or the sushy-tools emulator), the host
agents (the real agent and the simulated fleet speak the same wire API), the fabric managers
(UFM, NMX-M, SDN: real ones or `sim.fabric_managers`), the object store (a local directory or
S3) under both registry chunks and tenant storage, the billing ledger and the weight tracker.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from temporalio.client import Client
from temporalio.runtime import Runtime

from gpucloud.adapters.bmc import BmcCredentials, Bmcs
from gpucloud.adapters.host_agent import HostAgents, HttpHostAgents
from gpucloud.config import Settings, load_or_create_secret
from gpucloud.db import Database
from gpucloud.fabric.http_clients import HttpFabricController
from gpucloud.fabric.interface import FabricTokens
from gpucloud.ledger.client import LedgerClient
from gpucloud.registry.manifest import Signer
from gpucloud.registry.stores import RegistryStores
from gpucloud.services.agent_credentials import WipeRotation
from gpucloud.services.agent_enrollment import EnrollmentTokens
from gpucloud.storage.envelope import MasterKeys, TenantKeys
from gpucloud.storage.local import LocalObjectStore
from gpucloud.storage.objects import ObjectStore
from gpucloud.storage.s3 import S3ObjectStore
from gpucloud.storage.tenant import TenantStore
from gpucloud.web import service_tokens, tls

FabricControllerFactory = Callable[[], HttpFabricController]


def trust_configured_ca(settings: Settings) -> None:
    """Make every client of this process verify servers against the deployment's CA
    (`GPUCLOUD_TLS__CA_FILE`) as well as the public ones: each process calls this as it starts."""
    tls.trust(settings.tls.ca_file)


async def temporal_client(settings: Settings, *, wait_s: float = 30.0, runtime: Runtime | None = None) -> Client:
    """The Temporal client, once the server answers (processes of a stack start together);
    `runtime` carries the SDK's telemetry (the worker's metrics)."""
    from gpucloud.adapters.temporal import connect_when_up

    return await connect_when_up(settings, wait_s=wait_s, runtime=runtime)


@cache
def _s3_client(endpoint_url: str | None, region: str | None, access_key_id: str | None, secret: str | None) -> Any:
    import boto3  # only an S3 deployment pays for importing boto3

    credentials = {}
    if access_key_id and secret:
        credentials = {"aws_access_key_id": access_key_id, "aws_secret_access_key": secret}
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, **credentials)


def s3_client(settings: Settings) -> Any:
    """The one S3 client of a process (boto3's clients are thread-safe)."""
    store = settings.object_store
    secret = store.secret_access_key.get_secret_value() if store.secret_access_key else None
    return _s3_client(store.endpoint_url, store.region, store.access_key_id, secret)


def storage_master_key(settings: Settings) -> bytes:
    """The key that wraps every tenant's data key: from the settings, else kept in the data dir."""
    configured = settings.tenants.storage_master_key
    encoded = (
        configured.get_secret_value()
        if configured is not None
        else load_or_create_secret(
            settings.data_dir / "storage_master_key", lambda: base64.b64encode(MasterKeys.generate_key()).decode()
        )
    )
    key = base64.b64decode(encoded)
    if len(key) != 32:
        raise ValueError("the storage master key must be base64 of 32 bytes")
    return key


def object_store(settings: Settings) -> ObjectStore:
    """The one object store: registry chunks and manifests under `registry/`, tenant storage
    under `tenants/`, their keys and deletion marks under `control/`."""
    if settings.object_store.backend == "s3":
        assert settings.object_store.bucket is not None  # the settings refuse s3 without one
        return S3ObjectStore(s3_client(settings), settings.object_store.bucket)
    # Presigned URLs of the local store are signed with a key derived from the master key.
    signing_key = hmac.new(storage_master_key(settings), b"gpucloud-local-presign", hashlib.sha256).digest()
    return LocalObjectStore(settings.object_store_dir, signing_key=signing_key)


def tenant_store(settings: Settings) -> TenantStore:
    """Tenant storage: `tenants/<tenant id>/` on the object store, sealed with per-tenant data keys.
    The master key's id is derived from the key itself, so a different key can never pass for the
    one that wrapped a tenant's data key."""
    key = storage_master_key(settings)
    key_id = "mk-" + hashlib.sha256(key).hexdigest()[:12]
    objects = object_store(settings)
    return TenantStore(backend=objects, keys=TenantKeys(objects, MasterKeys({key_id: key}, active=key_id)))


def registry_stores(settings: Settings) -> RegistryStores:
    """Registry chunks and signed manifests: under `<registry prefix>/tenants/<tenant id>/`."""
    return RegistryStores(object_store(settings), prefix=settings.registry.prefix)


def evaluator_signer(settings: Settings) -> Signer:
    """The platform evaluator's key: it signs the results of the evaluations the platform runs,
    which are the only ones a `staging` or `production` gate accepts."""
    return Signer.from_seed(settings.evaluator_seed)


def fabric_tokens(settings: Settings) -> FabricTokens:
    """Each fabric manager's API token: from the settings, else the one kept in the data dir."""

    def token(configured: SecretStr | None, name: str) -> str:
        if configured is not None:
            return configured.get_secret_value()
        return load_or_create_secret(settings.data_dir / f"fabric_{name}_token", lambda: secrets.token_urlsafe(32))

    f = settings.fabric
    return FabricTokens(token(f.ufm_token, "ufm"), token(f.nmx_token, "nmx"), token(f.vpc_token, "vpc"))


def fabric_controller(settings: Settings) -> FabricControllerFactory | None:
    """A factory of clients of the three fabric managers, or None when none is configured."""
    urls = settings.fabric.manager_urls
    if urls is None:
        return None
    ufm, nmx, sdn = urls
    tokens = fabric_tokens(settings)
    return lambda: HttpFabricController(ufm_url=ufm, nmx_url=nmx, sdn_url=sdn, tokens=tokens)


def ledger_client(settings: Settings, issuer: service_tokens.Minter | None) -> LedgerClient | None:
    """The billing ledger's client, or None: without a ledger nothing is billed. Its calls are
    signed by `issuer` (the issuer key in a worker, the API's delegate in the API)."""
    if not settings.ledger.url:
        return None
    if issuer is None:
        raise ValueError(
            f"the ledger ({settings.ledger.url}) takes only signed calls, and there is no delegate key at "
            f"{settings.api_delegate_path}: make one with `gpucloud issue-delegate` (GPUCLOUD_API__DELEGATE_KEY)"
        )
    return LedgerClient(settings.ledger.url, issuer=issuer)


def bmcs(settings: Settings) -> Bmcs:
    """Nodes' BMCs over Redfish: credential references resolved in the secrets directory."""
    # requests (under sushy) takes a CA bundle path: the configured CA, else its own (certifi's).
    verify: bool | str = str(settings.tls.ca_file) if settings.tls.ca_file else True
    return Bmcs(
        credentials=BmcCredentials(settings.bmc_credentials_dir),
        timeout_s=settings.bmc.timeout_s,
        power_wait_s=settings.bmc.power_wait_s,
        poll_s=settings.bmc.poll_s,
        verify=verify,
        allow_insecure=settings.bmc.allow_insecure,
    )


def database(settings: Settings) -> Database:
    return Database(settings.database_url)


def token_issuer(settings: Settings) -> service_tokens.Issuer:
    """The issuer key's signer of the workers' calls to agents, the ledger and the tracker (the
    key is created on first use); one per key file in a process, so its clients share its cache
    of tokens. The API never calls this: it signs with a delegate (`api_token_issuer`)."""
    return _issuer_at(settings.issuer_key_path)


@cache
def _issuer_at(path: Path) -> service_tokens.Issuer:
    return service_tokens.load_or_create_issuer(path)


API_DELEGATE_AUDIENCES = (service_tokens.LEDGER_AUDIENCE, service_tokens.AGENT_LOGS_AUDIENCES)
API_DELEGATE_ROLES = ("agent", "operator", "control-plane", service_tokens.LOG_READER)
"""What an API process mints: ledger tokens for agents (`POST /v1/agents/ledger-token`), for
operators, and for its own calls to the ledger, and tokens that read one node's workload output
(`log-reader`, for a tenant's `.../logs`); never tokens that act on agents, nor for the tracker or
swarms."""
API_DELEGATE_TTL_S = 30 * 86400.0


def issue_api_delegate(settings: Settings, *, ttl_s: float = API_DELEGATE_TTL_S, path: Path | None = None) -> Path:
    """Write the API's delegate key and its certificate (signed with the issuer key, which only
    the caller holds) to `path` (default: the settings' `api_delegate_path`)."""
    target = path or settings.api_delegate_path
    service_tokens.issue_delegate(
        token_issuer(settings),
        target,
        name="api",
        audiences=API_DELEGATE_AUDIENCES,
        roles=API_DELEGATE_ROLES,
        ttl_s=ttl_s,
    )
    return target


def api_token_issuer(settings: Settings) -> service_tokens.DelegateFile | None:
    """The API's signer: its delegate (`issue_api_delegate`), never the issuer key, following its
    file (a new one is taken up without a restart); None where none was issued (the API then
    mints nothing: no ledger, no ledger tokens)."""
    path = settings.api_delegate_path
    return service_tokens.DelegateFile(path) if path.exists() else None


def host_agents(settings: Settings) -> HostAgents:
    """Agents on nodes and the simulated fleet serve the same action API: one HTTP client for
    both, presenting a token signed for the one node it calls."""
    return HttpHostAgents(issuer=token_issuer(settings))


def enrollment_tokens(cp: ControlPlane) -> EnrollmentTokens:
    """A re-imaged node's one-time enrollment tokens (`services/agent_enrollment.py`)."""
    return EnrollmentTokens(cp.settings.agent_credential_secret, ttl_s=cp.settings.bmc.enrollment_ttl_s)


def agent_log_reader(delegate: service_tokens.Minter | None) -> HttpHostAgents | None:
    """The API's client of agents, for one thing only: a node's workload output, with the
    log-reader tokens its delegate mints (None without a delegate: no logs)."""
    return HttpHostAgents(issuer=delegate, timeout_s=60.0) if delegate is not None else None


def wipe_rotation(cp: ControlPlane) -> WipeRotation:
    """What replaces a node's agent credential at every wipe."""
    return WipeRotation(cp.db, cp.settings.agent_credential_secret)


@dataclass
class ControlPlane:
    """The outside systems the worker and the API act on."""

    settings: Settings
    db: Database
    agents: HostAgents
    fabric: FabricControllerFactory | None
    ledger: LedgerClient | None
    tenant_store: TenantStore
    registry: RegistryStores
    bmcs: Bmcs

    async def aclose(self) -> None:
        await self.agents.aclose()
        if self.ledger is not None:
            await self.ledger.aclose()


def unconfigured(settings: Settings) -> list[str]:
    """What this control plane runs without, in words an operator acts on: each part left out is
    a capability tenants do not get, which must be said where a worker starts, not found later."""
    missing = []
    if settings.fabric.manager_urls is None:
        missing.append(
            "no fabric managers (GPUCLOUD_FABRIC__URL): allocations get no InfiniBand partition, NVLink "
            "partition or VPC of their own, so tenants share the fabric"
        )
    if not settings.ledger.url:
        missing.append("no billing ledger (GPUCLOUD_LEDGER__URL): nothing is metered or billed")
    return missing


def control_plane(settings: Settings) -> ControlPlane:
    return ControlPlane(
        settings=settings,
        db=database(settings),
        agents=host_agents(settings),
        fabric=fabric_controller(settings),
        ledger=ledger_client(settings, token_issuer(settings)),
        tenant_store=tenant_store(settings),
        registry=registry_stores(settings),
        bmcs=bmcs(settings),
    )
