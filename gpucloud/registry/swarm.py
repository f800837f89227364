"""Scheduling one weight fan-out (a *swarm*): which chunk a node fetches next, and from where.

A swarm is a version's chunk ids and the nodes that should hold them, each with its rack, site
and peer URL (a rollout registers one per target and version). The pure `Tracker`
(`gpucloud.registry.tracker`) keeps who holds what and ranks sources; `Swarm` adds what only a
central service can decide, the scheduling the fan-out simulator's p2p strategy models
(`gpucloud.registry.fanout_model`):

- *seeding*: a chunk no usable peer holds is handed to one node at a time to fetch from the
  origin (at most one origin fetch per node, at most `origin_slots` at once), so each chunk
  leaves the origin about once however many nodes want it, and the first copies land all over
  the swarm;
- otherwise the node gets the rarest chunks it lacks that a peer with a free upload slot holds,
  those a rack-local peer can serve first, each with the tracker's ordered source list (the
  origin last, for when every listed peer fails);
- a node that gets nothing waits and asks again: the chunks it lacks are all in flight or held
  only by busy peers, and the origin is not the answer to a busy peer.

A peer reported for bad bytes is skipped by the tracker's own rules; a chunk whose every holder
is shunned counts as held by nobody, so it is seeded again rather than waited on forever.

Pure logic with no I/O (one lock, since the HTTP service calls it from a thread pool);
`gpucloud.entrypoints.tracker` serves it over HTTP.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from gpucloud.registry.manifest import HEX_DIGEST
from gpucloud.registry.tracker import ORIGIN, NodePlace, Tracker

ChunkId = Annotated[str, Field(pattern=HEX_DIGEST)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PeerPlace(_Model):
    rack: str
    site: str
    url: str = Field(description="base URL of the node's peer service")


class SwarmSpec(_Model):
    nodes: dict[str, PeerPlace] = Field(min_length=1)
    chunks: list[ChunkId] = Field(min_length=1)
    tenant: str | None = Field(default=None, description="whose chunks these are (the origin reads its store)")

    @cached_property
    def chunk_set(self) -> frozenset[str]:
        return frozenset(self.chunks)


class Assignment(_Model):
    chunk: ChunkId
    sources: list[str] = Field(description="node ids best first; 'origin' last")


class Plan(_Model):
    assignments: list[Assignment]
    urls: dict[str, str] = Field(description="peer URL of every node named in the sources")
    complete: bool = Field(description="the node holds every chunk of the swarm")


class SwarmStatus(_Model):
    nodes: int
    chunks: int
    complete_nodes: list[str]
    held: dict[str, int] = Field(description="chunks of the swarm each node holds")
    seeding: int = Field(description="chunks being fetched from the origin now")
    bad_reports: int


class Swarm:
    """One fan-out's scheduling around a pure `Tracker`; thread-safe (one lock per swarm)."""

    def __init__(
        self,
        spec: SwarmSpec,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        upload_slots: int = 4,
        origin_slots: int = 8,
        seed_timeout_s: float = 120.0,
        max_sources: int = 4,
    ) -> None:
        self.spec = spec
        topology = {node: NodePlace(rack=p.rack, site=p.site) for node, p in spec.nodes.items()}
        self._rng, self._clock = rng or random.Random(), clock
        self.tracker = Tracker(topology, rng=self._rng, clock=clock, upload_slots=upload_slots)
        self._origin_slots, self._seed_timeout_s, self._max_sources = (
            origin_slots,
            seed_timeout_s,
            max_sources,
        )
        self._chunks = list(dict.fromkeys(spec.chunks))
        self._in_swarm = set(self._chunks)
        self._holders = dict.fromkeys(self._chunks, 0)
        self._held: dict[str, set[str]] = {node: set() for node in spec.nodes}
        self._inflight: dict[str, set[str]] = {node: set() for node in spec.nodes}
        self._seeding: dict[str, tuple[str, float]] = {}  # chunk -> (node fetching it, since)
        self._bad_reports = 0
        self._lock = threading.Lock()

    def announce(self, node: str, chunks: list[str]) -> None:
        """`node` holds verified copies of `chunks` now (and its fetches of them are over)."""
        with self._lock:
            self._known(node)
            self._announce(node, chunks)

    def plan(self, node: str, slots: int, *, held: Iterable[str] = (), fetching: Iterable[str] | None = None) -> Plan:
        """Up to `slots` fetches for `node` to start now.

        `held` is announced first, which saves a fetching node one request per chunk. `fetching`,
        when given, is every fetch the node has under way: any other assignment of its was lost
        (an answer that never arrived) and goes back to the pool, so a retried request is safe.
        """
        with self._lock:
            self._known(node)
            self._announce(node, held)
            if fetching is not None:
                for chunk in self._inflight[node] - set(fetching):
                    self._release(node, chunk)
            now = self._clock()
            for chunk, (_, since) in list(self._seeding.items()):
                if now - since > self._seed_timeout_s:  # the seeder died or stalled: reopen it
                    del self._seeding[chunk]
            taken = self._held[node] | self._inflight[node]
            lacking = [c for c in self._chunks if c not in taken]
            picks = [self._begin(node, chunk, [ORIGIN]) for chunk in self._seed_for(node, lacking)]
            picks += self._from_peers(node, lacking, slots - len(picks))
            named = {s for pick in picks for s in pick.sources if s != ORIGIN}
            return Plan(
                assignments=picks,
                urls={peer: self.spec.nodes[peer].url for peer in named},
                complete=len(self._held[node]) == len(self._chunks),
            )

    def report_bad(self, node: str, peer: str, chunk: str) -> None:
        if peer == ORIGIN:
            raise ValueError("the origin is the source of truth; a bad chunk there is a store fault")
        with self._lock:
            self._known(node)
            self._known(peer)
            self.tracker.report_bad(peer, chunk)
            self._bad_reports += 1
            self._release(node, chunk)

    def release(self, node: str, chunk: str) -> None:
        with self._lock:
            self._known(node)
            self._release(node, chunk)

    def peers_for(self, node: str, chunks: list[str], max_sources: int) -> dict[str, list[str]]:
        """The pure tracker's ranking and assignment, for callers that schedule for themselves."""
        with self._lock:
            self._known(node)
            return self.tracker.peers_for(node, chunks, max_sources=max_sources)

    def forget(self, node: str) -> None:
        """Drop the node's holdings and its transfers (it left, or lost its cache)."""
        self.reset(node, [])

    def reset(self, node: str, chunks: Iterable[str]) -> None:
        """The node holds exactly `chunks` now: what it announced before and lost is forgotten
        (a restart, or a copy that rotted), and fetches it had under way are over."""
        with self._lock:
            self._known(node)
            self.tracker.forget(node)
            for chunk in self._held[node]:
                self._holders[chunk] -= 1
            self._held[node].clear()
            self._inflight[node].clear()
            for chunk in [c for c, (seeder, _) in self._seeding.items() if seeder == node]:
                del self._seeding[chunk]
            self._announce(node, chunks)

    def status(self) -> SwarmStatus:
        with self._lock:
            total = len(self._chunks)
            return SwarmStatus(
                nodes=len(self._held),
                chunks=total,
                complete_nodes=sorted(n for n, held in self._held.items() if len(held) == total),
                held={node: len(held) for node, held in self._held.items()},
                seeding=len(self._seeding),
                bad_reports=self._bad_reports,
            )

    def _announce(self, node: str, chunks: Iterable[str]) -> None:
        chunks = list(chunks)
        self.tracker.announce(node, chunks)
        held = self._held[node]
        for chunk in chunks:
            self._inflight[node].discard(chunk)
            if self._seeding.get(chunk, ("",))[0] == node:
                del self._seeding[chunk]
            if chunk in self._in_swarm and chunk not in held:
                held.add(chunk)
                self._holders[chunk] += 1

    def _known(self, node: str) -> None:
        if node not in self._held:
            raise KeyError(node)

    def _seed_for(self, node: str, lacking: list[str]) -> list[str]:
        """The one chunk (or none) this node should fetch from the origin now."""
        if any(seeder == node for seeder, _ in self._seeding.values()):
            return []
        if self.tracker.load(ORIGIN) >= self._origin_slots:
            return []
        for chunk in lacking:
            if chunk not in self._seeding and not self._has_live_holder(node, chunk):
                self._seeding[chunk] = (node, self._clock())
                return [chunk]
        return []

    def _from_peers(self, node: str, lacking: list[str], slots: int) -> list[Assignment]:
        """Up to `slots` of the rarest lacking chunks a peer can serve now, rack-local first."""
        by_rarity = sorted(lacking, key=lambda c: (self._holders[c], self._rng.random()))
        rack, picks = self.spec.nodes[node].rack, list[Assignment]()
        for rack_local_only in (True, False):
            for chunk in by_rarity:
                if len(picks) >= slots:
                    return picks
                if self._holders[chunk] == 0 or chunk in self._inflight[node]:
                    continue
                sources = self.tracker.rank_sources(node, chunk, max_sources=self._max_sources)
                first = sources[0]
                if first == ORIGIN or (rack_local_only and self.spec.nodes[first].rack != rack):
                    continue
                picks.append(self._begin(node, chunk, sources))
        return picks

    def _has_live_holder(self, node: str, chunk: str) -> bool:
        """Some peer can serve the chunk now, or will once a busy upload slot frees up."""
        if self._holders[chunk] == 0:
            return False
        if self.tracker.rank_sources(node, chunk, max_sources=1)[0] != ORIGIN:
            return True
        # Nobody usable: either every holder is busy (wait for one) or every holder is shunned
        # for bad bytes (then only the origin has a good copy).
        holders = self.tracker.holders(chunk) - {node}
        return any(not self.tracker.has_free_slot(peer) for peer in holders)

    def _begin(self, node: str, chunk: str, sources: list[str]) -> Assignment:
        self.tracker.assign(node, chunk, sources[0])
        self._inflight[node].add(chunk)
        return Assignment(chunk=chunk, sources=sources)

    def _release(self, node: str, chunk: str) -> None:
        self.tracker.release(node, chunk)
        self._inflight[node].discard(chunk)
        if self._seeding.get(chunk, ("",))[0] == node:
            del self._seeding[chunk]
