"""A node's weights for the tenant it holds: the weights API and the peer service, opened per tenant.

A node serves `/weights/*` (`gpucloud.agent.weights_api`, what the staged rollout asks of it) and
`/chunks/{id}` (`gpucloud.agent.peer`, what its swarm's peers fetch) next to its action API, from
one `ChunkCache` per tenant at `<root>/<tenant>`. The production agent (`TenantWeights`, for the
one node it runs on) and the simulated fleet (`gpucloud.sim.node_weights`, for each of its nodes)
both open them with `open_tenant_weights` and check callers with `caller_refusal`:

- `/weights/*` answers only the control plane's token for this node (`web/service_tokens.py`);
- `/chunks/*` answers only a rollout's peer token for the named swarm (`?swarm=`), of the
  tenant the node holds (`peer.swarm_refusal`).

Opening a tenant's weights deletes every other tenant's under `root` first: a former tenant's
weights go with its workload, and never reach the next tenant's root shell.

Manifests are verified against the tenant's signing keys. The simulated fleet reads them from the
control plane's DB; a real node has no DB, so it trusts the keys the control plane sends with each
prefetch (`SentKeys`; the control plane's token for the node authenticates them), kept on disk
for its restarts. A key revoked after a prefetch is trusted on that node until the next one.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.agent.host import HostState
from gpucloud.agent.peer import create_peer_app, swarm_refusal
from gpucloud.agent.weights_api import HealthCheck, KeysSent, install_weights_api
from gpucloud.config import RequestBodySettings, write_private
from gpucloud.registry.evaluators import CommandRunner
from gpucloud.registry.manifest import Keyring
from gpucloud.web import problems
from gpucloud.web.gate import BODY_DEFAULTS, query_value
from gpucloud.web.service_tokens import Verifier, refusal

KEYS_FILE = "trusted-keys.json"


def caller_refusal(verifier: Verifier | None, scope: Scope, *, node_id: str, tenant: str | None) -> ASGIApp | None:
    """The 401 (or 403) a node answers a call to its weights or peer routes from a caller not
    allowed there (module doc); None when it may go on. `tenant`: the node's (None: not checked)."""
    path = scope["path"][len(scope.get("root_path", "")) :]
    authorization = problems.header(scope, b"authorization")
    if path.startswith("/chunks/"):
        return swarm_refusal(verifier, query_value(scope, "swarm"), authorization, tenant=tenant)
    return refusal(verifier, authorization, node_id=node_id)


class SentKeys(Keyring):
    """A tenant's signing keys as the control plane last sent them, kept (0600) at `path`."""

    def __init__(self, path: Path, *, tenant: str) -> None:
        super().__init__()
        self._path, self._tenant = path, tenant
        self._lock = threading.Lock()
        if path.is_file():
            self._trust_only(json.loads(path.read_text()))

    def _trust_only(self, public_keys: list[str]) -> None:
        kept = Keyring()
        for key in public_keys:
            kept.trust(self._tenant, bytes.fromhex(key))
        self._trusted = kept._trusted  # one assignment: a verify beside it sees the old set or the new

    def replace(self, public_keys: list[str]) -> None:
        """Trust exactly `public_keys` from now on (the control plane's registered, unrevoked ones)."""
        with self._lock:
            self._trust_only(public_keys)
            write_private(self._path, json.dumps(sorted(public_keys)))


def open_tenant_weights(
    root: Path,
    tenant: str,
    *,
    node_id: str,
    keyring: Keyring,
    verifier: Verifier | None,
    health: HealthCheck,
    run_command: CommandRunner | None = None,
    container_runtime: str | None = None,
    trust: KeysSent | None = None,
    request_body: RequestBodySettings = BODY_DEFAULTS,
) -> FastAPI:
    """The peer app of `tenant`'s cache at `<root>/<tenant>` with the weights API on it, once every
    other tenant's weights under `root` are gone (blocking: disk)."""
    if root.is_dir():
        for other in root.iterdir():
            if other.name != tenant:  # a former tenant's weights: wiped with its workload
                shutil.rmtree(other, ignore_errors=True)
    cache = ChunkCache(root / tenant, keyring=keyring, tenant=tenant)
    app = create_peer_app(cache, verifier=verifier, request_body=request_body)
    install_weights_api(
        app,
        node_id=node_id,
        cache=cache,
        health=health,
        run_command=run_command,
        container_runtime=container_runtime,
        trust=trust,
    )
    return app


class TenantWeights:
    """The production agent's weights and peer routes (an ASGI app): those of the tenant
    `state` says holds the node now, reopened when that changes or a wipe removed its files.
    Callers are checked in front of it, by the agent's gate (`caller_refusal`)."""

    def __init__(
        self,
        state: HostState,
        root: Path,
        *,
        verifier: Verifier,
        health: HealthCheck,
        container_runtime: str | None = None,
        request_body: RequestBodySettings = BODY_DEFAULTS,
    ) -> None:
        self.root = root
        self._state, self._verifier, self._health = state, verifier, health
        self._container_runtime, self._request_body = container_runtime, request_body
        self._opening = asyncio.Lock()
        self._open: tuple[str, FastAPI] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"][len(scope.get("root_path", "")) :]
        if not path.startswith(("/weights/", "/chunks/")):
            await problems.problem_response(404, "Not Found", f"no route {path}")(scope, receive, send)
            return
        tenant = self._state.tenant_id
        if tenant is None:
            detail = f"{self._state.node_id} holds no tenant's workload, so no weights"
            await problems.problem_response(409, "Weights unavailable", detail)(scope, receive, send)
            return
        app = await self._app_of(tenant)
        await app(scope, receive, send)

    async def _app_of(self, tenant: str) -> FastAPI:
        async with self._opening:
            if self._open is None or self._open[0] != tenant or not (self.root / tenant).is_dir():
                self._open = tenant, await asyncio.to_thread(self._build, tenant)
            return self._open[1]

    def _build(self, tenant: str) -> FastAPI:
        keys = SentKeys(self.root / tenant / KEYS_FILE, tenant=tenant)
        return open_tenant_weights(
            self.root,
            tenant,
            node_id=self._state.node_id,
            keyring=keys,
            verifier=self._verifier,
            health=self._health,
            container_runtime=self._container_runtime,
            trust=keys.replace,
            request_body=self._request_body,
        )
