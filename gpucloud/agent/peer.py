"""The node's side of weight fan-out over HTTP: the peer service, and the fetcher that fills the cache.

`create_peer_app` serves `GET /chunks/{id}` from the node's `ChunkCache`; the cache hashes the
chunk before the first byte goes out, so a copy that rotted on disk is dropped and answered 404,
never served. `PeerServer` runs such an app (or any ASGI app) with uvicorn on a background
thread, as the agent process does next to its other work.

`ChunkFetcher` fills the cache with the chunks of one version a node lacks, several at once. It
asks the tracker (`gpucloud.entrypoints.tracker`) for a plan as fetch slots free up; each
assignment lists sources best first (rack-local peers, other racks, the origin last). Every
chunk is hashed before it is written (`ChunkCache.put`); a peer whose bytes do not hash to the
chunk id is reported to the tracker and the next source is tried; a peer that is down or lacks
the chunk is simply skipped. The origin is fetched from when the tracker names it first (no
peer can serve the chunk), or in a chunk's later rounds; a first round that fails on every
listed peer goes back to the tracker instead, so a transient peer failure costs no origin
egress. Each verified chunk is announced with the plan request that follows its arrival at
once, so this node serves it to others while it keeps fetching. Bytes are counted by source
(peers vs origin) in `FetchStats`.

`prefetch` is the rollout's per-node prefetch step: keep the signed manifest (signature checked),
fetch what is missing, and assemble the version's files, ready for `ChunkCache.activate`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import httpx
from fastapi import FastAPI, HTTPException, Query, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Scope

from gpucloud.agent.chunk_cache import ChunkCache
from gpucloud.config import RequestBodySettings
from gpucloud.registry.manifest import (
    HEX_DIGEST,
    ChunkCorruptedError,
    ChunkMissingError,
    ChunkRef,
    IntegrityError,
    Manifest,
    SignedManifest,
)
from gpucloud.registry.tracker import ORIGIN
from gpucloud.registry.tracker_client import KEEPALIVE_S, TrackerClient
from gpucloud.web import metrics, problems, tls
from gpucloud.web.gate import BODY_DEFAULTS, Gate, query_value
from gpucloud.web.http_client import http_client
from gpucloud.web.service_tokens import SWARM_PEER, InvalidToken, Verifier, swarm_audience
from gpucloud.web.serving import ThreadedServer
from gpucloud.web.tls import ServerTLS


def swarm_refusal(
    verifier: Verifier | None, swarm: str | None, authorization: str | None, *, tenant: str | None
) -> JSONResponse | None:
    """What a peer answers a chunk request without a rollout's peer token for `swarm` (401), or
    with one for another tenant than `tenant` (403; None: not checked yet); None when it may go on.

    Only the peer token opens a peer: the member token, which opens the tracker and the origin
    as its node, is never sent here, so a peer never holds another node's member token to replay.
    A peer token is bearer and checked offline: the peer that sees it could show it to the
    swarm's other peers, which serve it nothing that peer's own token would not, and only until
    it expires (`SWARM_TOKEN_TTL_S`); the tracker stops offering a node that left as a source."""
    if verifier is None:
        return None
    if swarm is None:
        return problems.unauthenticated("chunks go to a swarm's nodes: name the swarm (?swarm=)")
    try:
        claims = verifier.check_header(authorization, audience=swarm_audience(swarm), roles=(SWARM_PEER,))
    except InvalidToken as exc:
        return problems.unauthenticated(f"a node's peer token for swarm {swarm!r} is needed ({exc})")
    if tenant is not None and claims.tenant != tenant:
        return problems.problem_response(403, "Forbidden", "this node serves its own tenant's swarms only")
    return None


def create_peer_app(
    cache: ChunkCache, *, verifier: Verifier | None = None, request_body: RequestBodySettings = BODY_DEFAULTS
) -> FastAPI:
    """`verifier` (the control plane's public key): serve a chunk only to a node holding the
    peer token a rollout gave it for a swarm of this node's tenant (`?swarm=` names it), checked
    by the gate every server has (`web/gate.py`). Routes added beside `/chunks` (the weights API)
    check their own callers, in front of this app."""
    app = FastAPI(title="gpucloud peer")
    problems.install(app)

    async def swarm_members(scope: Scope) -> ASGIApp | None:
        if not scope["path"].startswith("/chunks/"):
            return None
        swarm = query_value(scope, "swarm")
        return swarm_refusal(verifier, swarm, problems.header(scope, b"authorization"), tenant=cache.tenant)

    app.add_middleware(Gate, check=swarm_members, body=request_body)

    @app.get("/chunks/{chunk_id}", response_model=None)
    def get_chunk(
        chunk_id: Annotated[str, PathParam(pattern=HEX_DIGEST)],
        swarm: Annotated[str | None, Query(description="the swarm the caller's token is for")] = None,
    ) -> Response:
        try:
            data = cache.read(chunk_id)
        except (ChunkMissingError, ChunkCorruptedError):
            raise HTTPException(404, f"no good copy of chunk {chunk_id} here") from None
        metrics.CHUNK_BYTES.labels("peer").inc(len(data))
        return Response(data, media_type="application/octet-stream")

    @app.get("/healthz")
    def healthz() -> dict[str, int]:
        return {"chunks": len(cache.held())}

    return app


class PeerServer(ThreadedServer):
    """A peer's (or the tracker's) app served on a daemon thread."""

    def __init__(self, app: object, *, host: str = "127.0.0.1", port: int = 0, tls: ServerTLS | None = None) -> None:
        # Keep-alive longer than any client keeps an idle connection (KEEPALIVE_S), so the server
        # never closes one just as a client sends on it (a ReadError for a request that did nothing).
        super().__init__(app, host=host, port=port, name="peer", tls=tls, timeout_keep_alive=int(4 * KEEPALIVE_S))


@dataclass
class FetchStats:
    """What one fetch moved, by source (`origin` or a peer's address); `bad_chunks` counts chunks
    whose bytes failed their hash."""

    bytes_by_source: Counter[str] = field(default_factory=Counter)
    bad_chunks: int = 0
    failed_attempts: int = 0
    seconds: float = 0.0

    @property
    def origin_bytes(self) -> int:
        return self.bytes_by_source[ORIGIN]

    @property
    def peer_bytes(self) -> int:
        return self.bytes_by_source.total() - self.origin_bytes


class FetchError(Exception):
    """A chunk could not be fetched from any source within the allowed attempts."""


class _Unavailable(Exception):
    """The source did not offer the chunk (down, 404, busy); not evidence of bad bytes."""


class ChunkFetcher:
    """Fetches one node's missing chunks of a version by the tracker's plan; see the module doc."""

    def __init__(
        self,
        *,
        node: str,
        cache: ChunkCache,
        tracker: TrackerClient,
        swarm: str,
        peer_token: str | None = None,
        parallel: int = 4,
        http: httpx.Client | None = None,
        poll_s: float = 0.02,
        max_poll_s: float = 0.25,
        max_attempts: int = 8,
    ) -> None:
        self.node, self.swarm = node, swarm
        # The member token (the tracker's) goes to the origin only; peers get the peer token,
        # which the tracker and the origin refuse, so a peer cannot act as this node with it.
        self._origin_auth = tracker.auth
        self._peer_auth = {"Authorization": f"Bearer {peer_token}"} if peer_token else {}
        self._cache, self._tracker, self._parallel = cache, tracker, parallel
        limits = httpx.Limits(
            max_connections=4 * parallel, max_keepalive_connections=4 * parallel, keepalive_expiry=KEEPALIVE_S
        )
        self._http = http or http_client(timeout="peer", trust=tls.client_verify(), limits=limits)
        self._poll_s, self._max_poll_s, self._max_attempts = poll_s, max_poll_s, max_attempts
        self._stats_lock = threading.Lock()
        self.stats = FetchStats()

    def close(self) -> None:
        self._http.close()

    def fetch(self, manifest: Manifest) -> FetchStats:
        """Fetch every chunk of the manifest the cache lacks; `stats` accumulates across calls."""
        started = time.perf_counter()
        chunks = {c.id: c for entry in manifest.files.values() for c in entry.chunks}
        missing = {chunk_id for chunk_id in chunks if not self._cache.has(chunk_id)}
        # Exactly what the cache holds now: a chunk announced earlier and dropped since (rotted,
        # pruned) must become this node's to fetch again, not a source for its peers.
        self._tracker.reset(self.swarm, self.node, sorted(chunks.keys() - missing))
        attempts: Counter[str] = Counter()
        fetched: list[str] = []  # verified and cached, announced with the next plan request
        idle, next_plan = self._poll_s, 0.0
        with ThreadPoolExecutor(self._parallel, thread_name_prefix=f"fetch-{self.node}") as pool:
            running: dict[Future[bool], str] = {}
            try:
                while missing:
                    free = self._parallel - len(running)
                    if free and time.monotonic() >= next_plan:
                        work, complete = self._plan(free, fetched, missing, set(running.values()), chunks)
                        fetched = []
                        if complete:
                            raise FetchError(f"the swarm {self.swarm!r} does not list {len(missing)} chunks")
                        for chunk, sources, urls in work:
                            if sources[0] != ORIGIN and not attempts[chunk.id]:
                                # The origin is the last resort: a first round that fails on every
                                # peer goes back to the tracker, which finds other peers, or seeds
                                # the chunk from the origin if no peer can serve it.
                                sources = [s for s in sources if s != ORIGIN]
                            running[pool.submit(self._fetch_one, chunk, sources, urls)] = chunk.id
                        # Nothing to do means every chunk we lack is in flight or held by busy
                        # peers: ask again later, less often the longer that lasts.
                        idle = self._poll_s if work else min(idle * 2, self._max_poll_s)
                        next_plan = time.monotonic() + idle
                    timeout = max(0.0, next_plan - time.monotonic()) if len(running) < self._parallel else None
                    if not running:
                        time.sleep(timeout or 0.0)
                        continue
                    finished, _ = wait(running, timeout=timeout, return_when=FIRST_COMPLETED)
                    for future in finished:
                        chunk_id = running.pop(future)
                        next_plan = 0.0  # a slot freed up: plan (and announce) at once
                        if future.result():
                            missing.discard(chunk_id)
                            fetched.append(chunk_id)
                            continue
                        attempts[chunk_id] += 1
                        if attempts[chunk_id] >= self._max_attempts:
                            raise FetchError(f"chunk {chunk_id}: no source delivered good bytes")
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        if fetched:  # after a failure these wait for the next fetch, which announces all it holds
            self._tracker.announce(self.swarm, self.node, fetched)
        self.stats.seconds += time.perf_counter() - started
        return self.stats

    def _plan(
        self, slots: int, fetched: list[str], missing: set[str], in_flight: set[str], chunks: dict[str, ChunkRef]
    ) -> tuple[list[tuple[ChunkRef, list[str], dict[str, str]]], bool]:
        """Fetches to start now, and whether the tracker counts this node complete already."""
        plan = self._tracker.plan(self.swarm, self.node, slots=slots, held=fetched, fetching=in_flight)
        work, held_here = [], []
        for assignment in plan.assignments:
            if assignment.chunk in in_flight:
                continue  # already on its way under an earlier assignment
            if assignment.chunk in chunks and assignment.chunk not in missing:
                held_here.append(assignment.chunk)  # the tracker forgot it (a restart): tell it again
                continue
            if assignment.chunk not in missing:  # not in this version
                self._tracker.release(self.swarm, self.node, assignment.chunk)
                continue
            work.append((chunks[assignment.chunk], assignment.sources, plan.urls))
        if held_here:
            self._tracker.announce(self.swarm, self.node, held_here)
        return work, plan.complete

    def _fetch_one(self, chunk: ChunkRef, sources: list[str], urls: dict[str, str]) -> bool:
        """Try each source in order; True once a verified copy is in the cache."""
        for source in sources:
            url = self._tracker.origin_url(chunk.id, self.swarm) if source == ORIGIN else urls.get(source)
            if url is None:
                continue
            if source != ORIGIN:
                url = f"{url.rstrip('/')}/chunks/{chunk.id}?swarm={self.swarm}"
            try:
                data = self._download(url, chunk.size, self._origin_auth if source == ORIGIN else self._peer_auth)
            except (httpx.HTTPError, _Unavailable):
                self._count(failed=True)
                continue
            try:
                self._cache.put(chunk.id, data)
            except ChunkCorruptedError:
                self._count(bad=True)
                if source != ORIGIN:  # the origin verifies before it sends; a mismatch is the wire's
                    self._tracker.report_bad(self.swarm, self.node, peer=source, chunk=chunk.id)
                continue
            self._count(source=source, size=len(data))
            return True
        self._tracker.release(self.swarm, self.node, chunk.id)
        return False

    def _download(self, url: str, size: int, auth: dict[str, str]) -> bytearray:
        """The response body, cut off one byte past the expected size (wrong either way)."""
        data = bytearray()
        with self._http.stream("GET", url, headers=auth) as response:
            if response.status_code != 200:
                raise _Unavailable(f"{url}: HTTP {response.status_code}")
            # Raw bytes: a peer gets no say in decoding (no decompression bombs), and we hash
            # exactly what was sent.
            for piece in response.iter_raw():
                data += piece
                if len(data) > size:
                    break
        return data

    def _count(self, *, source: str | None = None, size: int = 0, bad: bool = False, failed: bool = False) -> None:
        with self._stats_lock:
            stats = self.stats
            stats.bad_chunks += bad
            stats.failed_attempts += failed
            if source is None:
                return
            stats.bytes_by_source[source] += size


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    digest: str
    path: Path
    stats: FetchStats


def prefetch(signed: SignedManifest, *, cache: ChunkCache, fetcher: ChunkFetcher) -> PrefetchResult:
    """Keep the signed manifest, fetch the chunks the node lacks, assemble the version's files.

    Assembly re-reads (and re-hashes) every cached chunk; one that rotted since it was fetched
    is dropped there, so one more fetch round brings a good copy before giving up.
    """
    manifest = cache.add_manifest(signed)
    fetcher.fetch(manifest)
    try:
        path = cache.assemble(signed.digest)
    except IntegrityError:
        fetcher.fetch(manifest)
        path = cache.assemble(signed.digest)
    return PrefetchResult(signed.digest, path, fetcher.stats)
