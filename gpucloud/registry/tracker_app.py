"""The weight tracker and the origin as one HTTP service, and the client nodes use to reach them.

Swarms (`gpucloud.registry.swarm`: one fan-out's nodes, chunks and scheduling) are registered
by name under `/tracker/swarms/{swarm}`; nodes announce what they hold, ask for a plan (which
chunks to fetch now, from which sources), report peers that served bad bytes, and release
chunks they gave up on. `peers_for` exposes the pure tracker's ranking as it is.

The origin endpoint, `GET /origin/chunks/{id}?swarm=<name>`, serves chunks from a `ChunkStore`
(which hashes them in full before a byte is sent) and counts the bytes it sends
(`GET /origin/stats`), so origin egress can be measured against the artifact's size.

With a `verifier` (the control plane's public key, `web/service_tokens.py`) every call but
`/healthz` needs a token: registering, removing and reading swarms and the origin's stats take
the control plane's (audience `tracker`); a node's calls take the member token the rollout gave
that node for that swarm (audience `swarm:<name>`, role `swarm-member`, its tenant and
allocation named), and only for itself. A node's peer token (role `swarm-peer`), which every
peer it fetches from sees, opens nothing here: a peer cannot replay it as that node. The origin
then serves only chunks of that swarm, from that tenant's store, to a node of that swarm. With a
`SwarmStore` the swarms' specs are kept (the control-plane DB), so the tracker answers for them
after a restart; nodes announce their holdings again as they plan.

With `NodeHolders` (the control-plane DB) the tracker also follows who holds each swarm's nodes
(`SwarmHolders`): a node that left the swarm's tenant's allocation is forgotten by its swarm
(never offered to its peers as a source again, so no rollout traffic or peer token reaches
whoever holds it next), and its member token is refused from then on, whatever its expiry.

`TrackerClient` is the blocking httpx client for both, shared by a node's fetch threads.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Annotated, Any, Protocol, TypeVar

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Scope

from gpucloud.config import RequestBodySettings
from gpucloud.registry.manifest import HEX_DIGEST, ChunkCorruptedError, ChunkMissingError
from gpucloud.registry.store import ChunkSource
from gpucloud.registry.swarm import ChunkId, Plan, Swarm, SwarmSpec, SwarmStatus
from gpucloud.web import metrics, problems, tls
from gpucloud.web.gate import BODY_DEFAULTS, OPEN_PATHS, Check, Gate, query_value
from gpucloud.web.service_tokens import (
    SWARM_MEMBER,
    TRACKER_AUDIENCE,
    Claims,
    InvalidToken,
    Verifier,
    swarm_audience,
    swarm_node,
)

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


class SwarmStore(Protocol):
    """Where swarm specs outlive the tracker process."""

    def save(self, name: str, spec: SwarmSpec) -> SwarmSpec:
        """Keep `spec` under `name`, or return the spec kept there already."""

    def load(self, name: str) -> SwarmSpec | None: ...

    def delete(self, name: str) -> None: ...


class NodeHolders(Protocol):
    """Who holds nodes now (the control-plane DB in a deployment)."""

    def holders(self, nodes: Collection[str]) -> dict[str, tuple[str | None, str | None]]:
        """Each known node's tenant, and the allocation it serves in (None: none, or leaving one)."""


class SwarmHolders:
    """Which nodes of each swarm are still in its tenant's allocations, as `NodeHolders` says,
    read again at most every `fresh_s` per swarm (one batched read, however many calls), so a
    node that left loses the tracker and the origin within `fresh_s`. Its swarm forgets it as
    the read finds it gone: it is offered to no peer as a source again."""

    def __init__(self, holders: NodeHolders, *, fresh_s: float) -> None:
        self._holders, self._fresh_s = holders, fresh_s
        self._read: dict[str, tuple[float, dict[str, str]]] = {}  # swarm -> (read at, node -> allocation)
        self._reading = asyncio.Lock()

    async def serving(self, name: str, swarm: Swarm) -> dict[str, str]:
        """The allocation each of the swarm's nodes serves its tenant in; nodes that left are absent."""
        read = self._read.get(name)
        if read is not None and time.monotonic() - read[0] < self._fresh_s:
            return read[1]
        async with self._reading:
            read = self._read.get(name)
            if read is not None and time.monotonic() - read[0] < self._fresh_s:
                return read[1]
            now = await asyncio.to_thread(self._holders.holders, list(swarm.spec.nodes))
            serving = {
                node: allocation
                for node, (tenant, allocation) in now.items()
                if node in swarm.spec.nodes and allocation is not None and tenant == swarm.spec.tenant
            }
            for node in (read[1] if read is not None else swarm.spec.nodes).keys() - serving.keys():
                swarm.forget(node)
            self._read[name] = (time.monotonic(), serving)
            return serving

    def drop(self, name: str) -> None:
        self._read.pop(name, None)


class SwarmRegistry:
    """Swarms by name. Registering the same spec twice is a no-op; a different one conflicts.
    With a `store`, a swarm this process does not hold is looked up there (after a restart)."""

    def __init__(self, *, seed: int | None = None, store: SwarmStore | None = None, **swarm_options: Any) -> None:
        self._swarms: dict[str, Swarm] = {}
        self._seed, self._options, self._store = seed, swarm_options, store
        self._lock = threading.Lock()

    def _new(self, name: str, spec: SwarmSpec) -> Swarm:
        rng = random.Random(f"{self._seed}/{name}") if self._seed is not None else random.Random()
        return Swarm(spec, rng=rng, **self._options)

    def register(self, name: str, spec: SwarmSpec) -> Swarm:
        with self._lock:
            swarm = self._swarms.get(name)
            if swarm is None:
                kept = self._store.save(name, spec) if self._store is not None else spec
                if kept != spec:
                    raise ValueError(f"swarm {name!r} exists with other nodes or chunks")
                swarm = self._swarms[name] = self._new(name, spec)
            elif swarm.spec != spec:
                raise ValueError(f"swarm {name!r} exists with other nodes or chunks")
            return swarm

    def get(self, name: str) -> Swarm:
        with self._lock:
            swarm = self._swarms.get(name)
            if swarm is None and self._store is not None:
                spec = self._store.load(name)
                if spec is not None:
                    swarm = self._swarms[name] = self._new(name, spec)
            if swarm is None:
                raise KeyError(name)
            return swarm

    def remove(self, name: str) -> None:
        with self._lock:
            self._swarms.pop(name, None)
            if self._store is not None:
                self._store.delete(name)


class OriginMeter:
    """Bytes and chunks the origin endpoint has sent (counted as each response is handed over)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.egress_bytes = self.chunks_served = 0

    def add(self, size: int) -> None:
        metrics.CHUNK_BYTES.labels("origin").inc(size)
        with self._lock:
            self.egress_bytes += size
            self.chunks_served += 1

    def stats(self) -> OriginStats:
        with self._lock:
            return OriginStats(egress_bytes=self.egress_bytes, chunks_served=self.chunks_served)


def _unauthenticated(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


_SWARM_PATH = re.compile(r"^/tracker/swarms/([^/]+)(/.+)?$")


def _callers(verifier: Verifier | None) -> Check:
    """The tracker's credential check for its gate (`web/gate.py`): a node's calls within a
    swarm, and its origin fetches, take that swarm's token; everything else (registering,
    removing and reading swarms, the origin's stats) the control plane's."""

    async def check(scope: Scope) -> ASGIApp | None:
        if verifier is None or scope["path"] in OPEN_PATHS:
            return None
        header = problems.header(scope, b"authorization")
        within = _SWARM_PATH.match(scope["path"])
        try:
            if within is not None and within.group(2):
                verifier.check_header(header, audience=swarm_audience(within.group(1)), roles=(SWARM_MEMBER,))
            elif scope["path"].startswith("/origin/chunks/"):
                swarm = query_value(scope, "swarm")
                if swarm is None:
                    return problems.unauthenticated(
                        "the origin serves chunks of a swarm to its nodes: name it (?swarm=)"
                    )
                verifier.check_header(header, audience=swarm_audience(swarm), roles=(SWARM_MEMBER,))
            else:
                verifier.check_header(header, audience=TRACKER_AUDIENCE)
        except InvalidToken as exc:
            return problems.unauthenticated(f"the tracker answers the control plane, and a swarm's nodes ({exc})")
        return None

    return check


async def _member(request: Request, swarm: str, authorization: Annotated[str | None, Header()] = None) -> Claims | None:
    """The claims of a node's member token for this swarm, while its node is still in the
    allocation the token names (None when the tracker checks no tokens)."""
    verifier: Verifier | None = request.app.state.verifier
    if verifier is None:
        return None
    try:
        claims = verifier.check_header(authorization, audience=swarm_audience(swarm), roles=(SWARM_MEMBER,))
    except InvalidToken as exc:
        raise _unauthenticated(f"a node's member token for swarm {swarm!r} is needed ({exc})") from None
    holders: SwarmHolders | None = request.app.state.holders
    if holders is not None:
        serving = await holders.serving(swarm, await _swarm(request, swarm))
        node = swarm_node(claims)
        if node is None or claims.allocation is None or serving.get(node) != claims.allocation:
            raise _unauthenticated(f"{claims.subject} is no longer in the allocation its token names")
    return claims


Member = Annotated[Claims | None, Depends(_member)]


def _as(caller: Claims | None, node: str) -> None:
    """A node speaks for itself only."""
    if caller is not None and caller.subject != f"node:{node}":
        raise HTTPException(403, f"{caller.subject} may not speak for node {node!r}")


async def _swarm(request: Request, swarm: str) -> Swarm:
    try:
        return await asyncio.to_thread(request.app.state.swarms.get, swarm)
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
    *,
    chunk_store: ChunkSource | None = None,
    tenant_chunks: Callable[[str], ChunkSource] | None = None,
    verifier: Verifier | None = None,
    store: SwarmStore | None = None,
    holders: SwarmHolders | None = None,
    seed: int | None = None,
    request_body: RequestBodySettings = BODY_DEFAULTS,
    **swarm_options: Any,
) -> FastAPI:
    """The tracker (swarms under /tracker) and, given chunks, the origin (/origin).

    The origin serves a swarm's chunks from `tenant_chunks(<the swarm's tenant>)`, or from
    `chunk_store` for a swarm that names no tenant. `verifier`: check every caller (module doc);
    `store`: keep swarm specs across restarts; `holders`: honour a node's token only while it is
    in the allocation the token names, and forget nodes that left (module doc); `request_body`:
    how bodies are read (`web/gate.py`).
    """
    app = FastAPI(title="gpucloud weight tracker")
    problems.install(app)
    app.add_middleware(Gate, check=_callers(verifier), body=request_body)
    app.state.swarms = SwarmRegistry(seed=seed, store=store, **swarm_options)
    app.state.origin_meter = OriginMeter()
    app.state.verifier = verifier
    app.state.holders = holders
    base = "/tracker/swarms/{swarm}"
    # Swarm calls are sub-millisecond pure logic: they run on the event loop, since a hop to the
    # thread pool and back costs more than the call, and far more when threads contend. Only a
    # swarm not yet in memory is looked up in the store, off the loop.

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.put(base, response_model=SwarmStatus)
    async def register_swarm(request: Request, swarm: str, spec: SwarmSpec) -> SwarmStatus:
        try:
            return (await asyncio.to_thread(request.app.state.swarms.register, swarm, spec)).status()
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from None

    @app.get(base, response_model=SwarmStatus)
    async def swarm_status(swarm: SwarmDep) -> SwarmStatus:
        return swarm.status()

    @app.delete(base, status_code=204)
    async def remove_swarm(request: Request, swarm: str) -> None:
        await asyncio.to_thread(request.app.state.swarms.remove, swarm)
        if request.app.state.holders is not None:
            request.app.state.holders.drop(swarm)

    @app.post(f"{base}/announce", status_code=204)
    async def announce(caller: Member, swarm: SwarmDep, body: NodeChunks) -> None:
        _as(caller, body.node)
        _unknown_node(lambda: swarm.announce(body.node, body.chunks))

    @app.post(f"{base}/plan", response_model=Plan)
    async def plan(caller: Member, swarm: SwarmDep, body: PlanRequest) -> Plan:
        _as(caller, body.node)
        return _unknown_node(lambda: swarm.plan(body.node, body.slots, held=body.held, fetching=body.fetching))

    @app.post(f"{base}/bad_chunks", status_code=204)
    async def report_bad(caller: Member, swarm: SwarmDep, body: BadChunkReport) -> None:
        _as(caller, body.node)
        _unknown_node(lambda: swarm.report_bad(body.node, body.peer, body.chunk))

    @app.post(f"{base}/release", status_code=204)
    async def release(caller: Member, swarm: SwarmDep, body: ChunkRelease) -> None:
        _as(caller, body.node)
        _unknown_node(lambda: swarm.release(body.node, body.chunk))

    @app.post(f"{base}/peers_for", response_model=dict[str, list[str]])
    async def peers_for(caller: Member, swarm: SwarmDep, body: PeersForRequest) -> dict[str, list[str]]:
        _as(caller, body.node)
        return _unknown_node(lambda: swarm.peers_for(body.node, body.chunks, body.max_sources))

    @app.put(f"{base}/nodes/{{node}}", status_code=204)
    async def reset(caller: Member, swarm: SwarmDep, node: str, body: Holdings) -> None:
        _as(caller, node)
        _unknown_node(lambda: swarm.reset(node, body.chunks))

    @app.delete(f"{base}/nodes/{{node}}", status_code=204)
    async def forget(caller: Member, swarm: SwarmDep, node: str) -> None:
        _as(caller, node)
        _unknown_node(lambda: swarm.forget(node))

    @app.get("/origin/stats", response_model=OriginStats)
    async def origin_stats(request: Request) -> OriginStats:
        return request.app.state.origin_meter.stats()

    if chunk_store is not None or tenant_chunks is not None:

        @app.get("/origin/chunks/{chunk_id}")
        async def origin_chunk(
            request: Request,
            chunk_id: Annotated[str, Path(pattern=HEX_DIGEST)],
            swarm: Annotated[str | None, Query(description="the swarm the caller fetches for")] = None,
            authorization: Annotated[str | None, Header()] = None,
        ) -> Response:
            source = chunk_store
            if verifier is not None or tenant_chunks is not None:
                if swarm is None:
                    raise _unauthenticated("the origin serves chunks of a swarm to its nodes: name it (?swarm=)")
                caller = await _member(request, swarm, authorization)
                spec = (await _swarm(request, swarm)).spec
                if caller is not None and caller.tenant != spec.tenant:
                    raise HTTPException(403, "the token is for another tenant than the swarm's")
                if caller is not None and swarm_node(caller) not in spec.nodes:
                    raise HTTPException(403, f"{caller.subject} is not a node of swarm {swarm!r}")
                if chunk_id not in spec.chunk_set:
                    raise HTTPException(404, f"chunk {chunk_id} is not in swarm {swarm!r}")
                if spec.tenant is not None and tenant_chunks is not None:
                    source = tenant_chunks(spec.tenant)
            if source is None:
                raise HTTPException(404, f"no chunk store for swarm {swarm!r}")
            try:
                data = await asyncio.to_thread(source.get, chunk_id)  # hashed in full before one byte is sent
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
        self._http = http or httpx.Client(
            timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S), verify=tls.client_verify()
        )
        self._retries = retries

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        for attempt in range(self._retries + 1):
            try:
                response = self._http.request(method, f"{self.base_url}{path}", json=body, headers=self.auth)
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

    def remove_swarm(self, swarm: str) -> None:
        self._call("DELETE", f"/tracker/swarms/{swarm}")

    def origin_url(self, chunk_id: str, swarm: str | None = None) -> str:
        query = f"?swarm={swarm}" if swarm else ""
        return f"{self.base_url}/origin/chunks/{chunk_id}{query}"

    def origin_stats(self) -> OriginStats:
        return OriginStats.model_validate_json(self._call("GET", "/origin/stats").content)
