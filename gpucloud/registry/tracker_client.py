"""The client nodes and the control plane reach the weight tracker and the origin with, and the
wire models both ends share (the tracker's app, `gpucloud.entrypoints.tracker`, reads the same).

`TrackerClient` is the blocking httpx client for both, shared by a node's fetch threads.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx
from pydantic import BaseModel, ConfigDict, Field

from gpucloud.registry.swarm import ChunkId, Plan, SwarmSpec, SwarmStatus
from gpucloud.retry import Backoff, retry_call
from gpucloud.web import tls
from gpucloud.web.http_client import http_client

KEEPALIVE_S = 2.0
"""How long clients keep an idle connection: under uvicorn's default 5 s, so a server never closes
one just as a client sends on it."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeChunks(_Model):
    node: str
    chunks: list[ChunkId]


class Holdings(_Model):
    chunks: list[ChunkId]


class PlanRequest(_Model):
    node: str
    slots: int = Field(ge=1, le=256, description="fetches the node can start now")
    held: list[ChunkId] = Field(default=[], description="chunks to announce first")
    fetching: list[ChunkId] | None = Field(
        default=None, description="every fetch under way; the node's other assignments are released"
    )


class BadChunkReport(_Model):
    node: str
    peer: str
    chunk: ChunkId


class ChunkRelease(_Model):
    node: str
    chunk: ChunkId


class PeersForRequest(_Model):
    node: str
    chunks: list[ChunkId]
    max_sources: int = Field(default=4, ge=1, le=64)


class OriginStats(_Model):
    egress_bytes: int
    chunks_served: int


class TrackerClient:
    """Blocking client for the tracker and origin; one instance may be shared by many threads.

    A request that fails in transport (connection reset, timeout) is sent again a few times:
    every call is safe to repeat (announce, release and reset are idempotent, and a plan request
    carries the node's fetches under way, so assignments from a lost answer are released).
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        http: httpx.Client | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
    ) -> None:
        """`token`: the control plane's for the tracker, or a node's for its swarm."""
        self.base_url = base_url.rstrip("/")
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = http or http_client(
            timeout="tracker",
            timeout_s=timeout_s,
            trust=tls.client_verify(),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )
        self._retries = retries
        # 0.1 s after the first transport failure, doubled after each further one.
        self._backoff = Backoff(first_s=0.1, cap_s=0.1 * 2 ** max(retries - 1, 0))

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        response = retry_call(
            lambda: self._http.request(method, f"{self.base_url}{path}", json=body, headers=self.auth),
            retry_on=httpx.TransportError,
            backoff=self._backoff,
            attempts=self._retries + 1,
            deadline_s=None,
        )
        response.raise_for_status()
        return response

    def register_swarm(self, swarm: str, spec: SwarmSpec) -> SwarmStatus:
        response = self._call("PUT", f"/tracker/swarms/{swarm}", spec.model_dump())
        return SwarmStatus.model_validate_json(response.content)

    def status(self, swarm: str) -> SwarmStatus:
        return SwarmStatus.model_validate_json(self._call("GET", f"/tracker/swarms/{swarm}").content)

    def announce(self, swarm: str, node: str, chunks: Iterable[str]) -> None:
        self._call("POST", f"/tracker/swarms/{swarm}/announce", {"node": node, "chunks": list(chunks)})

    def reset(self, swarm: str, node: str, chunks: Iterable[str]) -> None:
        """Tell the tracker the node holds exactly `chunks` (forgetting anything it lost)."""
        self._call("PUT", f"/tracker/swarms/{swarm}/nodes/{node}", {"chunks": list(chunks)})

    def plan(
        self, swarm: str, node: str, *, slots: int, held: Iterable[str] = (), fetching: Iterable[str] | None = None
    ) -> Plan:
        body = {"node": node, "slots": slots, "held": list(held)}
        if fetching is not None:
            body["fetching"] = list(fetching)
        return Plan.model_validate_json(self._call("POST", f"/tracker/swarms/{swarm}/plan", body).content)

    def report_bad(self, swarm: str, node: str, *, peer: str, chunk: str) -> None:
        self._call("POST", f"/tracker/swarms/{swarm}/bad_chunks", {"node": node, "peer": peer, "chunk": chunk})

    def release(self, swarm: str, node: str, chunk: str) -> None:
        self._call("POST", f"/tracker/swarms/{swarm}/release", {"node": node, "chunk": chunk})

    def peers_for(self, swarm: str, node: str, chunks: list[str], *, max_sources: int = 4) -> dict[str, list[str]]:
        body = {"node": node, "chunks": chunks, "max_sources": max_sources}
        return self._call("POST", f"/tracker/swarms/{swarm}/peers_for", body).json()

    def forget(self, swarm: str, node: str) -> None:
        self._call("DELETE", f"/tracker/swarms/{swarm}/nodes/{node}")

    def remove_swarm(self, swarm: str) -> None:
        self._call("DELETE", f"/tracker/swarms/{swarm}")

    def origin_url(self, chunk_id: str, swarm: str | None = None) -> str:
        query = f"?swarm={swarm}" if swarm else ""
        return f"{self.base_url}/origin/chunks/{chunk_id}{query}"

    def origin_stats(self) -> OriginStats:
        return OriginStats.model_validate_json(self._call("GET", "/origin/stats").content)
