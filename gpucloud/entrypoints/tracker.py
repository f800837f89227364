"""The tracker process: the weight tracker and the origin as one HTTP service, with the registry's
chunks as the origin in a deployment (`serve`, `gpucloud tracker`).

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

In a deployment (`create_deployment_tracker`) the origin serves `GET /origin/chunks/{id}` for a
swarm from the registry store of the tenant whose rollout registered that swarm, to nodes that
hold the token the rollout gave them for it: a chunk id alone opens nothing, and no tenant's
chunk is served for another's swarm. Swarm specs are kept in the control-plane DB
(`DatabaseSwarms`), so a restart of the tracker loses no rollout (nodes announce what they hold
again). A node's token is honoured only while the DB has the node in the allocation the token
names (`DatabaseHolders`).

Nodes and the control plane reach it with `registry.tracker_client.TrackerClient`, whose wire
models this app reads.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections.abc import Callable, Collection
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from sqlalchemy.exc import IntegrityError
from starlette.types import ASGIApp, Scope

from gpucloud import bootstrap
from gpucloud.config import RequestBodySettings, Settings
from gpucloud.db import Database
from gpucloud.registry.manifest import HEX_DIGEST, ChunkCorruptedError, ChunkMissingError
from gpucloud.registry.store import ChunkSource
from gpucloud.registry.swarm import Plan, Swarm, SwarmSpec, SwarmStatus
from gpucloud.registry.tracker_client import (
    KEEPALIVE_S,
    BadChunkReport,
    ChunkRelease,
    Holdings,
    NodeChunks,
    OriginStats,
    PeersForRequest,
    PlanRequest,
)
from gpucloud.web import metrics, problems
from gpucloud.web.gate import BODY_DEFAULTS, OPEN_PATHS, Check, Gate, query_value
from gpucloud.web.service_tokens import (
    SWARM_MEMBER,
    TRACKER_AUDIENCE,
    Claims,
    InvalidToken,
    Verifier,
    load_verifier,
    public_key_path,
    swarm_audience,
    swarm_node,
)
from gpucloud.web.tls import serve_options


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


class DatabaseSwarms:
    """Swarm specs kept in the control-plane DB (`tracker_swarm`), so the tracker answers for a
    rollout's swarm after a restart."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def save(self, name: str, spec: SwarmSpec) -> SwarmSpec:
        from gpucloud.models.registry_tables import TrackerSwarm

        with self._db.session() as session:
            row = session.get(TrackerSwarm, name)
            if row is None:
                session.add(TrackerSwarm(name=name, tenant_id=spec.tenant, spec=spec.model_dump_json()))
                try:
                    session.commit()
                    return spec
                except IntegrityError:  # registered by a retry meanwhile: the kept one answers
                    session.rollback()
                    row = session.get(TrackerSwarm, name)
            assert row is not None
            return SwarmSpec.model_validate_json(row.spec)

    def load(self, name: str) -> SwarmSpec | None:
        from gpucloud.models.registry_tables import TrackerSwarm

        with self._db.session() as session:
            row = session.get(TrackerSwarm, name)
            return SwarmSpec.model_validate_json(row.spec) if row is not None else None

    def delete(self, name: str) -> None:
        from gpucloud.models.registry_tables import TrackerSwarm

        with self._db.session() as session:
            row = session.get(TrackerSwarm, name)
            if row is not None:
                session.delete(row)
                session.commit()


class DatabaseHolders:
    """Who holds each node now, read from the control-plane DB (`services.nodes.holdings`): the
    tracker honours a node's swarm token only while the node is in the allocation it names.

    Why the tracker reads the node's allocation rather than checking a revocation list that
    releases write: the node's row is what every path that takes a node from a tenant changes
    already (release, drain, repair, RMA, and any path added later), in the transaction that
    moves its state, so no path can forget to revoke, and nothing new is written or swept. A
    token is dead the moment its node leaves, whatever its expiry. The cost is one batched
    primary-key read per swarm every few seconds (`SwarmHolders`), however many
    calls its nodes make.
    """

    def __init__(self, db: Database) -> None:
        self._db = db

    def holders(self, nodes: Collection[str]) -> dict[str, tuple[str | None, str | None]]:
        from gpucloud.services.nodes import holdings

        with self._db.session() as session:
            return {node: (h.tenant_id, h.allocation_id) for node, h in holdings(session, nodes).items()}


def create_deployment_tracker(settings: Settings) -> FastAPI:
    """The tracker of a deployment: swarms kept in the control-plane DB, chunks served from each
    swarm's tenant's registry store, every caller checked against the control plane's key, every
    node against the allocation its token names."""
    from gpucloud.web.metrics import install_metrics
    from gpucloud.web.readiness import database_check, install_readiness, object_store_check

    db = bootstrap.database(settings)
    stores = bootstrap.registry_stores(settings)
    app = create_tracker_app(
        tenant_chunks=stores.chunks,
        # The issuer key's public half only, as the ledger: nodes reach the tracker.
        verifier=load_verifier(public_key_path(settings.issuer_key_path)),
        store=DatabaseSwarms(db),
        holders=SwarmHolders(DatabaseHolders(db), fresh_s=settings.tracker.holders_fresh_s),
        request_body=settings.request_body,
    )
    install_readiness(app, {"database": database_check(db.engine), "object store": object_store_check(stores.objects)})
    install_metrics(app, lambda: (settings.metrics_token, settings.operator_token))
    return app


def serve(settings: Settings) -> None:
    """Run the tracker and origin until stopped: on `tracker.host` (else the URL's host) and the
    URL's port. The URL is what nodes reach (`https://tracker.internal:8480`), which need not be
    an address of this host: behind a load balancer or NAT it binds to `tracker.host`."""
    import httpx
    import uvicorn

    bootstrap.trust_configured_ca(settings)
    url = httpx.URL(settings.tracker.url)
    host = settings.tracker.host or url.host
    secure = serve_options(host, settings.tls.server, insecure=settings.tls.insecure, what="tracker")
    # Keep-alive longer than clients keep idle connections (as `PeerServer` does), so the server
    # never closes one just as a client sends on it.
    uvicorn.run(
        create_deployment_tracker(settings),
        host=host,
        port=url.port or 80,
        log_level="warning",
        log_config=None,
        timeout_keep_alive=int(4 * KEEPALIVE_S),
        backlog=4096,
        **secure,
    )
