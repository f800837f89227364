"""The weights API of every simulated node, served by the fleet's one process.

A real node serves the weights API (`gpucloud.agent.weights_api`) and the peer service
(`gpucloud.agent.peer`) next to its action API (`gpucloud.agent.tenant_weights`); a simulated
node serves the very same app, opened and guarded by the same functions, under its agent URL,
`{base}/v1/nodes/{id}`: `/weights/*` for the rollout's activities, `/chunks/{id}` for its peers.
Each node has a real `ChunkCache` on disk (`<root>/<node>/<tenant>`) for the tenant whose
workload it holds, so a rollout moves real, verified bytes through the tracker and between
simulated nodes.

The node's state decides the answers: an unreachable node answers 503 (as its action API does),
one with a hardware fault reports itself unhealthy to the rollout's check, and one that holds no
tenant's workload has no weights (409). When a node's tenant changes (a wipe, then another
tenant), the previous tenant's cache is deleted before the new one opens.

Memory stays bounded on a 10,000-node fleet: a node's app and cache are built on its first
weights call, and at most `resident` idle ones are kept (a cache reopens from its disk as it
was). Prefetches, which hold a server thread for a whole download, run a few at a time, so the
threads that serve chunks to peers are never all taken by nodes waiting for those chunks.

A canary's evaluation runs the weight-sanity evaluator on the node's files, but never the
model's command: that is tenant text, and this process runs on the control plane's host. The
node reports the command it would have run, with no metrics (`evaluators.simulated_command`).

Manifests are verified against the tenant's keys as the control plane holds them
(`keyring_for`), re-read every few seconds, so a key registered or revoked since is honoured.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from gpucloud.agent.tenant_weights import caller_refusal, open_tenant_weights
from gpucloud.registry.evaluators import simulated_command
from gpucloud.registry.manifest import EvaluationRecord, Keyring, Manifest, SignedEvaluation, SignedManifest
from gpucloud.web import problems
from gpucloud.web.service_tokens import Verifier

if TYPE_CHECKING:  # the database layer loads only where the keyrings are read from it
    from gpucloud.db import Database

PREFETCHES_AT_ONCE = 8
KEYRING_REFRESH_S = 5.0


@dataclass(frozen=True)
class WeightsSpec:
    root: Path
    keyring_for: Callable[[str], Keyring]
    """The keys a tenant's versions must be signed with (the control plane's registered keys)."""
    resident: int = 256


class _TenantKeys(Keyring):
    """A tenant's keyring as `load` returns it, loaded again once it is `refresh_s` old."""

    def __init__(self, load: Callable[[], Keyring], *, refresh_s: float = KEYRING_REFRESH_S) -> None:
        super().__init__()
        self._load, self._refresh_s = load, refresh_s
        self._lock = threading.Lock()
        self._keys: Keyring | None = None
        self._loaded_at = 0.0

    def _current(self) -> Keyring:
        with self._lock:
            if self._keys is None or time.monotonic() - self._loaded_at > self._refresh_s:
                self._keys, self._loaded_at = self._load(), time.monotonic()
            return self._keys

    def verify(self, signed: SignedManifest, *, tenant: str) -> Manifest:
        return self._current().verify(signed, tenant=tenant)

    def verify_evaluation(self, signed: SignedEvaluation, *, tenant: str) -> EvaluationRecord:
        return self._current().verify_evaluation(signed, tenant=tenant)


@dataclass
class _Resident:
    tenant: str
    app: FastAPI
    in_flight: int = 0


def _unavailable(status: int, detail: str) -> JSONResponse:
    return problems.problem_response(status, "Weights unavailable", detail)


class NodeWeights:
    """An ASGI app mounted at `/v1/nodes/{node_id}`: each node's weights and peer routes."""

    def __init__(self, nodes: dict, spec: WeightsSpec, *, control_plane: Verifier | None = None) -> None:
        self._nodes, self._spec = nodes, spec  # node id -> `SimNode`, read live
        # `/weights/*` answers only the control plane's token for the node (None: unchecked).
        self._control_plane = control_plane
        self._resident: OrderedDict[str, _Resident] = OrderedDict()
        self._keyrings: dict[str, _TenantKeys] = {}
        self._opening = asyncio.Lock()
        self._prefetching: asyncio.Semaphore | None = None  # made on the server's loop

    async def __call__(self, scope, receive, send) -> None:
        node = self._nodes.get(scope["path_params"]["node_id"])
        path = scope["path"][len(scope.get("root_path", "")) :]
        if node is None or not path.startswith(("/weights/", "/chunks/")):
            await _unavailable(404, "not found")(scope, receive, send)
            return
        # A peer's chunk: a rollout's token for a swarm of the node's tenant (none: checked once it has one).
        refused = caller_refusal(self._control_plane, scope, node_id=node.id, tenant=node.tenant_id)
        if refused is not None:
            await refused(scope, receive, send)
            return
        if node.unreachable:
            await _unavailable(503, f"agent on {node.id} does not answer")(scope, receive, send)
            return
        if node.tenant_id is None:
            await _unavailable(409, f"{node.id} holds no tenant's workload, so no weights")(scope, receive, send)
            return
        resident = await self._open(node)
        resident.in_flight += 1
        try:
            if path == "/weights/prefetch":
                self._prefetching = self._prefetching or asyncio.Semaphore(PREFETCHES_AT_ONCE)
                async with self._prefetching:
                    await resident.app(scope, receive, send)
            else:
                await resident.app(scope, receive, send)
        finally:
            resident.in_flight -= 1
            self._evict_idle()

    async def _open(self, node) -> _Resident:
        async with self._opening:
            resident = self._resident.get(node.id)
            if resident is not None and resident.tenant != node.tenant_id:
                del self._resident[node.id]
                resident = None
            if resident is None:
                tenant = node.tenant_id
                app = await asyncio.to_thread(self._build, node, tenant)
                resident = self._resident[node.id] = _Resident(tenant=tenant, app=app)
            self._resident.move_to_end(node.id)
            return resident

    def _build(self, node, tenant: str) -> FastAPI:
        if tenant not in self._keyrings:
            self._keyrings[tenant] = _TenantKeys(lambda: self._spec.keyring_for(tenant))

        def health() -> tuple[bool, str]:
            fault = node.hardware_fault
            return fault is None, f"hardware fault: {fault}" if fault else ""

        # The fleet shares its host with `gpucloud up`: a canary's command is recorded, never run.
        return open_tenant_weights(
            self._spec.root / node.id,
            tenant,
            node_id=node.id,
            keyring=self._keyrings[tenant],
            verifier=self._control_plane,
            health=health,
            run_command=simulated_command,
        )

    def _evict_idle(self) -> None:
        idle = [node_id for node_id, r in self._resident.items() if r.in_flight == 0]
        for node_id in idle[: max(0, len(self._resident) - self._spec.resident)]:
            del self._resident[node_id]


def control_plane_keyrings(db: Database) -> Callable[[str], Keyring]:
    """Each tenant's registered, unrevoked keys, read from the control-plane DB."""
    from gpucloud.registry.promotion import keyring_for

    def load(tenant_id: str) -> Keyring:
        with db.session() as session:
            return keyring_for(session, tenant_id)

    return load
