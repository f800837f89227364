"""The weight tracker and the origin as one HTTP service, and the client nodes use to reach them.

Swarms (`gpucloud.registry.swarm`: one fan-out's nodes, chunks and scheduling) are registered
by name under `/tracker/swarms/{swarm}`; nodes announce what they hold, ask for a plan (which
chunks to fetch now, from which sources), report peers that served bad bytes, and release
chunks they gave up on. `peers_for` exposes the pure tracker's ranking as it is.

The origin endpoint, `GET /origin/chunks/{id}`, serves chunks from a `ChunkStore` (which hashes
them in full before a byte is sent) and counts the bytes it sends (`GET /origin/stats`), so
origin egress can be measured against the artifact's size.

`TrackerClient` is the blocking httpx client for both, shared by a node's fetch threads.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any, TypeVar

import httpx
from fastapi import Depends, FastAPI, HTTPException, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from gpucloud.registry.manifest import HEX_DIGEST, ChunkCorruptedError, ChunkMissingError
from gpucloud.registry.store import ChunkSource
from gpucloud.registry.swarm import ChunkId, Plan, Swarm, SwarmSpec, SwarmStatus
from gpucloud.web import problems

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


class SwarmRegistry:
    """Swarms by name. Registering the same spec twice is a no-op; a different one conflicts."""

    def __init__(self, *, seed: int | None = None, **swarm_options: Any) -> None:
        self._swarms: dict[str, Swarm] = {}
        self._seed, self._options = seed, swarm_options
        self._lock = threading.Lock()

    def register(self, name: str, spec: SwarmSpec) -> Swarm:
        with self._lock:
            swarm = self._swarms.get(name)
            if swarm is None:
                rng = random.Random(f"{self._seed}/{name}") if self._seed is not None else random.Random()
                swarm = self._swarms[name] = Swarm(spec, rng=rng, **self._options)
            elif swarm.spec != spec:
                raise ValueError(f"swarm {name!r} exists with other nodes or chunks")
            return swarm

    def get(self, name: str) -> Swarm:
        with self._lock:
            return self._swarms[name]

    def remove(self, name: str) -> None:
        with self._lock:
            self._swarms.pop(name, None)


class OriginMeter:
    """Bytes and chunks the origin endpoint has sent (counted as each response is handed over)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.egress_bytes = self.chunks_served = 0

    def add(self, size: int) -> None:
        with self._lock:
            self.egress_bytes += size
            self.chunks_served += 1

    def stats(self) -> OriginStats:
        with self._lock:
            return OriginStats(egress_bytes=self.egress_bytes, chunks_served=self.chunks_served)


async def _swarm(request: Request, swarm: str) -> Swarm:
    try:
        return request.app.state.swarms.get(swarm)
    except KeyError:
        raise HTTPException(404, f"no swarm {swarm!r}") from None


SwarmDep = Annotated[Swarm, Depends(_swarm)]


T = TypeVar("T")


def _unknown_node(call: Callable[[], T]) -> T:
    try:
        return call()
    except KeyError as exc:
        raise HTTPException(404, f"node {exc.args[0]!r} is not in this swarm") from None
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None


def create_tracker_app(
    *, chunk_store: ChunkSource | None = None, seed: int | None = None, **swarm_options: Any
) -> FastAPI:
    """The tracker (swarms under /tracker) and, given a chunk store, the origin (/origin)."""
    app = FastAPI(title="gpucloud weight tracker")
    problems.install(app)
    app.state.swarms = SwarmRegistry(seed=seed, **swarm_options)
    app.state.origin_meter = OriginMeter()
    base = "/tracker/swarms/{swarm}"
    # Swarm calls are sub-millisecond pure logic: they run on the event loop, since a hop to the
    # thread pool and back costs more than the call, and far more when threads contend.

    @app.put(base, response_model=SwarmStatus)
    async def register_swarm(request: Request, swarm: str, spec: SwarmSpec) -> SwarmStatus:
        try:
            return request.app.state.swarms.register(swarm, spec).status()
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from None

    @app.get(base, response_model=SwarmStatus)
    async def swarm_status(swarm: SwarmDep) -> SwarmStatus:
        return swarm.status()

    @app.delete(base, status_code=204)
    async def remove_swarm(request: Request, swarm: str) -> None:
        request.app.state.swarms.remove(swarm)

    @app.post(f"{base}/announce", status_code=204)
    async def announce(swarm: SwarmDep, body: NodeChunks) -> None:
        _unknown_node(lambda: swarm.announce(body.node, body.chunks))

    @app.post(f"{base}/plan", response_model=Plan)
    async def plan(swarm: SwarmDep, body: PlanRequest) -> Plan:
        return _unknown_node(lambda: swarm.plan(body.node, body.slots, held=body.held, fetching=body.fetching))

    @app.post(f"{base}/bad_chunks", status_code=204)
    async def report_bad(swarm: SwarmDep, body: BadChunkReport) -> None:
        _unknown_node(lambda: swarm.report_bad(body.node, body.peer, body.chunk))

    @app.post(f"{base}/release", status_code=204)
    async def release(swarm: SwarmDep, body: ChunkRelease) -> None:
        _unknown_node(lambda: swarm.release(body.node, body.chunk))

    @app.post(f"{base}/peers_for", response_model=dict[str, list[str]])
    async def peers_for(swarm: SwarmDep, body: PeersForRequest) -> dict[str, list[str]]:
        return _unknown_node(lambda: swarm.peers_for(body.node, body.chunks, body.max_sources))

    @app.put(f"{base}/nodes/{{node}}", status_code=204)
    async def reset(swarm: SwarmDep, node: str, body: Holdings) -> None:
        _unknown_node(lambda: swarm.reset(node, body.chunks))

    @app.delete(f"{base}/nodes/{{node}}", status_code=204)
    async def forget(swarm: SwarmDep, node: str) -> None:
        _unknown_node(lambda: swarm.forget(node))

    @app.get("/origin/stats", response_model=OriginStats)
    async def origin_stats(request: Request) -> OriginStats:
        return request.app.state.origin_meter.stats()

    if chunk_store is not None:

        @app.get("/origin/chunks/{chunk_id}")
        def origin_chunk(request: Request, chunk_id: Annotated[str, Path(pattern=HEX_DIGEST)]) -> Response:
            try:
                data = chunk_store.get(chunk_id)  # hashed in full before one byte is sent
            except ChunkMissingError:
                raise HTTPException(404, f"chunk {chunk_id} is not in the store") from None
            except ChunkCorruptedError as exc:
                raise HTTPException(500, f"the store's copy is damaged: {exc}") from None
            request.app.state.origin_meter.add(len(data))
            return Response(data, media_type="application/octet-stream")

    return app


class TrackerClient:
    """Blocking client for the tracker and origin; one instance may be shared by many threads.

    A request that fails in transport (connection reset, timeout) is sent again a few times:
    every call is safe to repeat (announce, release and reset are idempotent, and a plan request
    carries the node's fetches under way, so assignments from a lost answer are released).
    """

    def __init__(
        self, base_url: str, *, http: httpx.Client | None = None, timeout_s: float = 30.0, retries: int = 3
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http or httpx.Client(timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
        self._retries = retries

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        for attempt in range(self._retries + 1):
            try:
                response = self._http.request(method, f"{self.base_url}{path}", json=body)
                break
            except httpx.TransportError:
                if attempt == self._retries:
                    raise
                time.sleep(0.1 * 2**attempt)
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

    def origin_url(self, chunk_id: str) -> str:
        return f"{self.base_url}/origin/chunks/{chunk_id}"

    def origin_stats(self) -> OriginStats:
        return OriginStats.model_validate_json(self._call("GET", "/origin/stats").content)
