"""Simulated fabric managers: UFM (InfiniBand pkeys), NMX-M (NVLink partitions) and an SDN
controller (Ethernet VPCs) as one FastAPI app, one router per manager, served on loopback.

They enforce the constraints the real managers (and the isolation promise) rely on, and refuse
a request that would break one with a 4xx whose body names it:
``{"detail": {"constraint": "<name>", "message": "<what and why>"}}``.

UFM (`/ufmRest/resources/pkeys`): a new pkey lies in 0x0001-0x7ffe (`pkey_range`) and is not
taken (`pkey_unique`); the default partition 0x7fff holds ports only as limited members
(`default_partition_limited`) and cannot be deleted (`default_partition_permanent`); a port
GUID is a full member of at most one non-default pkey (`full_member_single_pkey`).
NMX-M (`/nmx/v1`): a partition holds GPUs of its own NVL72 domain only (`gpu_in_domain`), and a
GPU is in at most one partition (`gpu_single_partition`); names are unique in a domain
(`partition_name_unique`).
The domains' GPUs are registered with `PUT /nmx/v1/domains/{id}` (real NMX-M discovers them).
SDN (`/sdn/v1/vpcs`): a VNI lies in 1-2^24-1 (`vni_range`) and belongs to one tenant
(`vni_unique`), a tenant has one VNI (`one_vni_per_tenant`), a node is attached to one VPC
(`node_single_vpc`), and only an empty VPC is deleted (`vpc_not_empty`).

State lives in memory, and with a `state_path` also in a JSON file rewritten after every change
(so a second `gpucloud up` on the same data dir finds the partitions the first one made). A
request that changes nothing writes nothing, and each pkey's member list is encoded once per
change, not per write or read: the default partition holds every port of the fleet. As UFM
does, a pkey list carries members only when asked (`guids_data=true`).
Handlers are `async` but never await, so each runs whole on the event loop (no thread-pool hop
per request); the lock keeps a handler safe should it move to the pool.

Faults for tests (`PUT /sim/v1/fault`): `unavailable` answers every manager request with 503 (a
manager down); `stale_reads` answers single-record reads with the record's members left out (a
manager whose reads disagree with what it acknowledged), which a read-back must catch.

One module per manager (`ufm`, `nmx`, `sdn`), their shared `state`, and the test `faults`.
`FabricManagersServer` runs the app on a daemon thread for tests; `main` runs it standalone
(`gpucloud fabric-managers`, which `gpucloud up` starts).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI
from starlette.types import ASGIApp, Scope

from gpucloud.config import RequestBodySettings
from gpucloud.fabric.http_clients import NmxClient
from gpucloud.fabric.interface import FabricTokens
from gpucloud.sim.fabric_managers.faults import faults
from gpucloud.sim.fabric_managers.nmx import nmx
from gpucloud.sim.fabric_managers.sdn import sdn
from gpucloud.sim.fabric_managers.state import FabricState, available
from gpucloud.sim.fabric_managers.ufm import ufm
from gpucloud.web import problems, tls
from gpucloud.web.gate import BODY_DEFAULTS, Gate, holds_token
from gpucloud.web.http_client import http_client
from gpucloud.web.serving import ThreadedServer
from gpucloud.web.tls import ServerTLS, serve_options


def create_app(
    *,
    nvl_domains: dict[str, list[str]] | None = None,
    state_path: Path | None = None,
    tokens: FabricTokens | None = None,
    request_body: RequestBodySettings = BODY_DEFAULTS,
) -> FastAPI:
    """The three managers; `nvl_domains` maps each NVL72 domain to its GPUs' UIDs; with a
    `state_path` the state survives a restart; with `tokens`, every call but `/healthz` needs
    its manager's own token as a bearer token, as each real manager's API needs its own (None:
    unchecked), checked by the gate every server has before a body is read (`web/gate.py`,
    bodies read as `request_body` says). The test faults (`/sim/`) answer any of the three."""
    app = FastAPI(title="Simulated fabric managers (UFM, NMX-M, SDN)")
    by_prefix = {} if tokens is None else {"/ufmRest/": [tokens.ufm], "/nmx/": [tokens.nmx], "/sdn/": [tokens.sdn]}

    async def token_only(scope: Scope) -> ASGIApp | None:
        if tokens is None or scope["path"] == "/healthz":
            return None
        path = scope["path"]
        accepted = next((t for prefix, t in by_prefix.items() if path.startswith(prefix)), list(tokens))
        if any(holds_token(scope, token) for token in accepted):
            return None
        return problems.unauthenticated("each fabric manager answers only its own API token")

    app.add_middleware(Gate, check=token_only, body=request_body)

    app.state.fabric = state = FabricState.load(state_path)
    for domain, gpus in (nvl_domains or {}).items():
        for gpu in gpus:
            state.domain_of_gpu[gpu] = domain

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    for router in (ufm, nmx, sdn):
        app.include_router(router, dependencies=[Depends(available)])
    app.include_router(faults)
    return app


def nvl_domains(inventory: Iterable[dict]) -> dict[str, list[str]]:
    """NVL72 domain -> its GPUs' UIDs, from a fleet inventory (`/v1/inventory` of the simulated fleet)."""
    domains: dict[str, list[str]] = {}
    for node in inventory:
        if node.get("nvlink_domain") and node.get("gpu_uids"):
            domains.setdefault(node["nvlink_domain"], []).extend(node["gpu_uids"])
    return domains


def register_nvl_domains(url: str, inventory: Iterable[dict], *, nmx_token: str | None = None) -> int:
    """Tell the simulated NMX-M which GPUs each NVL72 domain has (real NMX-M discovers them);
    idempotent. Returns the number of domains."""
    domains = nvl_domains(inventory)
    with http_client(timeout="fabric_manager_setup", trust=tls.client_verify()) as client:
        nmx = NmxClient(client, url, token=nmx_token)
        for domain, gpus in domains.items():
            nmx.register_domain(domain, gpus)
    return len(domains)


class FabricManagersServer(ThreadedServer):
    """The simulated managers served on a daemon thread; `start` returns the URL."""

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(app, host=host, port=port, name="fabric-managers")


def main(
    host: str = "127.0.0.1",
    port: int = 8470,
    *,
    state_path: Path | None = None,
    tokens: FabricTokens | None = None,
    tls: ServerTLS | None = None,
    insecure: bool = False,
    request_body: RequestBodySettings = BODY_DEFAULTS,
) -> None:
    secure = serve_options(host, tls, insecure=insecure, what="simulated fabric managers")
    app = create_app(state_path=state_path, tokens=tokens, request_body=request_body)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, **secure)
