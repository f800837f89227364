"""Discrete-event simulator of fanning one weight artifact out to a fleet of GPU nodes.

It answers the design question of ARCHITECTURE.md "Weights" -> Distribution: how long until
every node holds the artifact, and how many bytes leave the origin, for three strategies:

- ``origin_only``: every node fetches every chunk from the origin.
- ``tiered_mirrors``: the first node of each rack mirrors the origin; the rest of the rack
  fetches from its mirror (chunk by chunk, as soon as the mirror holds one).
- ``p2p``: a swarm. Each node keeps a few fetches in flight, picks the rarest chunk it lacks that
  a peer with a free upload slot holds (chunks its own rack can serve first; a chunk its rack
  already holds or is receiving is never fetched across racks again), and asks the tracker
  (`gpucloud.registry.tracker`, the same code the control plane runs) for the source: rack-local
  peers first, then other racks, least loaded first. The origin serves only chunks no node holds
  yet, so each chunk leaves it once.

Network model (flow level): nodes sit in racks; each NIC is full duplex with its own upload and
download capacity; the origin, outside every rack, has its own egress; racks optionally have an
oversubscribed uplink (traffic leaving a rack, and traffic entering it, origin traffic included,
each share ``nodes_in_rack x NIC / oversubscription``). A transfer runs at ``min`` over the links it crosses of ``capacity / transfers on that link``,
recomputed whenever a transfer starts or ends on one of those links, so no link ever carries more
than its capacity. That is fair sharing per link without max-min redistribution (a transfer held
back by one end leaves the other end's unused share idle), so it understates what TCP would
achieve and the swarm's figures err on the slow side. Sources cap their concurrent uploads (``upload_slots``, ``origin_slots``): the
origin and mirrors queue further requests FIFO; swarm peers at the cap are skipped by the tracker.
Chunks are store-and-forward: a node serves a chunk only once it holds (and has verified) all of
it.

Approximation, for run time: the simulator moves "pieces" of whole chunks. When
``nodes x chunks`` exceeds ``max_transfers`` it groups consecutive chunks into pieces so that
about ``max_transfers`` transfers happen (141 GB in 64 MiB chunks to 1,000 nodes: 8 chunks =
512 MiB per piece, 263 pieces). The bandwidth arithmetic is unchanged; only store-and-forward
granularity coarsens, which lengthens the swarm's pipeline (by at least
``depth x (piece - chunk) / NIC``, 0.38 s there) and makes its end game lumpier, so results err on
the slow side: on that run, pieces of 4 chunks instead of 8 take p2p's p99 from 1.21x to 1.12x of
the bound, at twice the run time.

Lower bound (`lower_bound_s`): ``size / NIC + depth x chunk / NIC`` with
``depth = ceil(log2(nodes))``. The first term is the largest of three delivery floors: every node
takes the whole artifact in through its NIC (``size / down``), every byte leaves the origin at
least once (``size / origin``), and the fleet's total upload carries N copies
(``N x size / (N x up + origin)``, which matters only when uploads are slower than downloads).
The second: a holder makes one new copy of a chunk per ``chunk / NIC up``, so copies of the last
chunk at most double per chunk time and reaching N nodes takes ``ceil(log2 N)`` more. With equal
capacities this is, to within a round, the optimal makespan of chunk-by-chunk dissemination
(M rounds plus about log2 N: Mundinger, Weber and Weiss, "Optimal scheduling of peer-to-peer file
dissemination", J. Scheduling 2008), and the figure ARCHITECTURE.md quotes (about 11.3 s for
141 GB at 100 Gb/s). It is a yardstick for the design's regime (many nodes, an origin no faster
than a few NICs), not a theorem for every configuration: a handful of nodes fed straight from a
fast origin can beat the depth term, and oversubscribed rack uplinks are not in it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from gpucloud.registry.tracker import ORIGIN, NodePlace, Tracker

MiB = 1 << 20
Strategy = Literal["origin_only", "tiered_mirrors", "p2p"]
STRATEGIES: tuple[Strategy, ...] = ("origin_only", "tiered_mirrors", "p2p")
ORIGIN_SOURCE = -1
"""`Transfer.source` of a transfer the origin served."""


class FanoutConfig(BaseModel):
    """One scenario: fleet shape, link speeds (Gb/s), artifact, strategy and client knobs."""

    model_config = ConfigDict(frozen=True)

    strategy: Strategy
    nodes: int = Field(gt=0)
    artifact_bytes: int = Field(gt=0)
    chunk_bytes: int = Field(default=64 * MiB, gt=0)
    nodes_per_rack: int = Field(default=40, gt=0)
    nic_up_gbps: float = Field(default=100.0, gt=0)
    nic_down_gbps: float = Field(default=100.0, gt=0)
    origin_gbps: float = Field(default=100.0, gt=0)
    rack_oversubscription: float | None = Field(default=None, ge=1.0)
    parallel_fetches: int = Field(default=4, gt=0, description="fetches a node keeps in flight")
    upload_slots: int = Field(default=4, gt=0, description="concurrent uploads per peer/mirror")
    origin_slots: int = Field(default=8, gt=0, description="concurrent uploads at the origin")
    max_transfers: int = Field(default=300_000, gt=0, description="chunk batching threshold")
    seed: int = 0
    audit: bool = Field(default=False, description="record every transfer and peak link rates")


class Transfer(NamedTuple):
    """One finished transfer, recorded by audited runs; node indices, ORIGIN_SOURCE for the origin."""

    source: int
    target: int
    piece: int
    start_s: float
    end_s: float
    size: int


class FanoutResult(BaseModel):
    """Completion times (seconds from the start), their ratio to `lower_bound_s`, egress bytes."""

    config: FanoutConfig
    piece_bytes: int
    pieces: int
    transfers: int
    bound_s: float
    completion_s: list[float] = Field(description="when each node (by index) held every piece")
    p50_s: float
    p99_s: float
    max_s: float
    p50_over_bound: float
    p99_over_bound: float
    max_over_bound: float
    origin_egress_bytes: int
    origin_egress_x: float
    sent_bytes: list[int] = Field(description="bytes each node uploaded to other nodes")
    transfer_log: list[Transfer] | None = None
    peak_up_bytes_per_s: list[float] | None = Field(default=None, description="per node")
    peak_down_bytes_per_s: list[float] | None = None
    peak_origin_bytes_per_s: float | None = None


def lower_bound_s(config: FanoutConfig) -> float:
    """Optimistic yardstick for any strategy; see the module docstring for the argument."""
    up, down, origin = _bytes_per_s(config)
    size, nodes = config.artifact_bytes, config.nodes
    delivery = max(size / down, size / origin, nodes * size / (nodes * up + origin))
    depth = math.ceil(math.log2(nodes)) if nodes > 1 else 0
    return delivery + depth * config.chunk_bytes / up


def piece_bytes(config: FanoutConfig) -> int:
    """Bytes the simulator moves per transfer: whole chunks, batched only past max_transfers."""
    chunks = math.ceil(config.artifact_bytes / config.chunk_bytes)
    pieces_per_node = max(1, min(chunks, config.max_transfers // config.nodes))
    return math.ceil(chunks / pieces_per_node) * config.chunk_bytes


def simulate(config: FanoutConfig) -> FanoutResult:
    """Run one fan-out to completion and summarise it."""
    size = piece_bytes(config)
    count = math.ceil(config.artifact_bytes / size)
    sizes = [size] * (count - 1) + [config.artifact_bytes - size * (count - 1)]
    network = _Network(config)
    strategy = {"origin_only": _OriginOnly, "tiered_mirrors": _TieredMirrors, "p2p": _PeerToPeer}
    fanout = strategy[config.strategy](config, network, sizes)
    fanout.run()
    return _summarise(config, network, fanout, size)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]): the value at least a q share of nodes beat."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _bytes_per_s(config: FanoutConfig) -> tuple[float, float, float]:
    return (config.nic_up_gbps * 1e9 / 8, config.nic_down_gbps * 1e9 / 8, config.origin_gbps * 1e9 / 8)


def _summarise(config: FanoutConfig, network: _Network, fanout: _Fanout, size: int) -> FanoutResult:
    bound = lower_bound_s(config)
    done = [t for t in fanout.completion if t is not None]  # all of them: `run` raises otherwise
    p50, p99, worst = percentile(done, 0.50), percentile(done, 0.99), max(done)
    origin_bytes = network.sent[network.origin]
    return FanoutResult(
        config=config,
        piece_bytes=size,
        pieces=len(fanout.sizes),
        transfers=network.transfers,
        bound_s=bound,
        completion_s=done,
        p50_s=p50,
        p99_s=p99,
        max_s=worst,
        p50_over_bound=p50 / bound,
        p99_over_bound=p99 / bound,
        max_over_bound=worst / bound,
        origin_egress_bytes=origin_bytes,
        origin_egress_x=origin_bytes / config.artifact_bytes,
        sent_bytes=network.sent[: network.origin],
        transfer_log=network.log,
        peak_up_bytes_per_s=network.peak_up[: network.origin] if config.audit else None,
        peak_down_bytes_per_s=network.peak_down if config.audit else None,
        peak_origin_bytes_per_s=network.peak_up[network.origin] if config.audit else None,
    )


class _Flow:
    __slots__ = ("cross", "piece", "rate", "remaining", "since", "size", "source", "start", "target", "token")

    def __init__(self, source: int, target: int, piece: int, size: int, now: float, cross: bool) -> None:
        self.source, self.target, self.piece, self.size = source, target, piece, size
        self.remaining = float(size)
        self.rate = 0.0
        self.since = self.start = now
        self.token = -1
        self.cross = cross


class _Network:
    """Links, the transfers crossing them, and the clock (see "Network model" above).

    Node i is index i; the origin is index `nodes`, outside every rack. Starting or ending a
    transfer marks its links dirty; `settle` then recomputes the rate of every transfer on a
    dirty link and reschedules its finish (stale heap entries are skipped by token).
    """

    def __init__(self, config: FanoutConfig) -> None:
        up, down, origin_rate = _bytes_per_s(config)
        n = config.nodes
        self.origin = n
        self.rack_of = [i // config.nodes_per_rack for i in range(n)] + [-1]
        racks = self.rack_of[n - 1] + 1
        self.up_capacity = [up] * n + [origin_rate]
        self.down_capacity = down
        # Dicts used as ordered sets: iteration order must not depend on object addresses, or
        # two runs with one seed would schedule ties differently.
        self.uploads: list[dict[_Flow, None]] = [{} for _ in range(n + 1)]
        self.downloads: list[dict[_Flow, None]] = [{} for _ in range(n)]
        self.rack_capacity: list[tuple[float, float]] | None = None
        if config.rack_oversubscription is not None:
            sizes = [self.rack_of[:n].count(r) for r in range(racks)]
            factor = config.rack_oversubscription
            self.rack_capacity = [(k * up / factor, k * down / factor) for k in sizes]
        self.rack_out: list[dict[_Flow, None]] = [{} for _ in range(racks)]
        self.rack_in: list[dict[_Flow, None]] = [{} for _ in range(racks)]
        self.now = 0.0
        self.transfers = 0
        self.sent = [0] * (n + 1)
        self._heap: list[tuple[float, int, _Flow]] = []
        self._tokens = itertools.count()
        self._dirty: list[dict[_Flow, None]] = []
        self.audit = config.audit
        self.log: list[Transfer] | None = [] if config.audit else None
        self.peak_up = [0.0] * (n + 1)
        self.peak_down = [0.0] * n

    def start(self, source: int, target: int, piece: int, size: int) -> None:
        cross = self.rack_of[source] != self.rack_of[target]
        flow = _Flow(source, target, piece, size, self.now, cross)
        self.uploads[source][flow] = None
        self.downloads[target][flow] = None
        if cross and self.rack_capacity is not None:
            if source != self.origin:
                self.rack_out[self.rack_of[source]][flow] = None
            self.rack_in[self.rack_of[target]][flow] = None
        self._touch(flow)

    def busy(self, source: int) -> int:
        return len(self.uploads[source])

    def pop_finished(self) -> _Flow | None:
        """Advance the clock to the next finishing transfer and take it off its links."""
        heap = self._heap
        while heap:
            finish, token, flow = heapq.heappop(heap)
            if flow.token != token:
                continue
            self.now = finish
            self._touch(flow)
            del self.uploads[flow.source][flow]
            del self.downloads[flow.target][flow]
            if flow.cross and self.rack_capacity is not None:
                if flow.source != self.origin:
                    del self.rack_out[self.rack_of[flow.source]][flow]
                del self.rack_in[self.rack_of[flow.target]][flow]
            self.transfers += 1
            self.sent[flow.source] += flow.size
            if self.log is not None:
                source = ORIGIN_SOURCE if flow.source == self.origin else flow.source
                self.log.append(Transfer(source, flow.target, flow.piece, flow.start, finish, flow.size))
            return flow
        return None

    def settle(self) -> None:
        """Give every transfer on a dirty link its new rate (each once, however many links)."""
        dirty: dict[_Flow, None] = {}
        for flows in self._dirty:
            dirty.update(flows)
        self._dirty = []
        for flow in dirty:
            self._reschedule(flow)
        if self.audit:
            self._record_peaks(dirty)

    def _touch(self, flow: _Flow) -> None:
        """Mark `flow`'s links dirty: the live sets are kept, so transfers added later count."""
        self._dirty.append(self.uploads[flow.source])
        self._dirty.append(self.downloads[flow.target])
        if flow.cross and self.rack_capacity is not None:
            if flow.source != self.origin:
                self._dirty.append(self.rack_out[self.rack_of[flow.source]])
            self._dirty.append(self.rack_in[self.rack_of[flow.target]])

    def _reschedule(self, flow: _Flow) -> None:
        rate = self.up_capacity[flow.source] / len(self.uploads[flow.source])
        share = self.down_capacity / len(self.downloads[flow.target])
        if share < rate:
            rate = share
        if flow.cross and self.rack_capacity is not None:
            if flow.source != self.origin:
                rack = self.rack_of[flow.source]
                rate = min(rate, self.rack_capacity[rack][0] / len(self.rack_out[rack]))
            rack = self.rack_of[flow.target]
            rate = min(rate, self.rack_capacity[rack][1] / len(self.rack_in[rack]))
        if rate == flow.rate:
            return
        now = self.now
        flow.remaining = max(0.0, flow.remaining - flow.rate * (now - flow.since))
        flow.since, flow.rate = now, rate
        token = next(self._tokens)
        flow.token = token
        heapq.heappush(self._heap, (now + flow.remaining / rate, token, flow))

    def _record_peaks(self, flows: dict[_Flow, None]) -> None:
        for node in {flow.source for flow in flows}:
            self.peak_up[node] = max(self.peak_up[node], sum(f.rate for f in self.uploads[node]))
        for node in {flow.target for flow in flows}:
            self.peak_down[node] = max(self.peak_down[node], sum(f.rate for f in self.downloads[node]))


class _Fanout(ABC):
    """What every strategy shares: piece bookkeeping, completion times and the event loop."""

    def __init__(self, config: FanoutConfig, network: _Network, sizes: list[int]) -> None:
        self.config = config
        self.network = network
        self.sizes = sizes
        self.rng = random.Random(config.seed)
        self.have = [0] * config.nodes
        self.held = [0] * config.nodes
        self.completion: list[float | None] = [None] * config.nodes

    def run(self) -> None:
        network = self.network
        self.start()
        network.settle()
        while True:
            flow = network.pop_finished()
            if flow is None:
                if self.unstick():
                    network.settle()
                    continue
                break
            self._arrived(flow.target, flow.piece)
            self.on_finished(flow)
            network.settle()
        missing = sum(t is None for t in self.completion)
        if missing:
            raise RuntimeError(f"fan-out stalled with {missing} nodes incomplete")

    @abstractmethod
    def start(self) -> None:
        """Issue the first requests at time zero."""

    @abstractmethod
    def on_finished(self, flow: _Flow) -> None:
        """React to a finished transfer (its piece is already recorded as held)."""

    def unstick(self) -> bool:
        """Nothing is in flight: start whatever can start. False when nothing can."""
        return False

    def _arrived(self, node: int, piece: int) -> None:
        bit = 1 << piece
        if self.have[node] & bit:
            raise RuntimeError(f"node {node} received piece {piece} twice")
        self.have[node] |= bit
        self.held[node] += 1
        if self.held[node] == len(self.sizes):
            self.completion[node] = self.network.now


class _InOrder(_Fanout):
    """Each node fetches pieces in order from one fixed source, which serves a FIFO queue."""

    def __init__(self, config: FanoutConfig, network: _Network, sizes: list[int]) -> None:
        super().__init__(config, network, sizes)
        self.source_of = self.assign_sources()
        self.slots = [config.upload_slots] * config.nodes + [config.origin_slots]
        self.queue: list[deque[tuple[int, int]]] = [deque() for _ in range(config.nodes + 1)]
        self.next_piece = [0] * config.nodes
        self.outstanding = [0] * config.nodes

    @abstractmethod
    def assign_sources(self) -> list[int]:
        """Index of each node's one source (the origin is index `nodes`)."""

    def start(self) -> None:
        order = list(range(self.config.nodes))
        self.rng.shuffle(order)
        for node in order:
            self._fill(node)

    def on_finished(self, flow: _Flow) -> None:
        source, node = flow.source, flow.target
        self.outstanding[node] -= 1
        if self.queue[source]:
            target, piece = self.queue[source].popleft()
            self.network.start(source, target, piece, self.sizes[piece])
        self._fill(node)

    def _fill(self, node: int) -> None:
        source = self.source_of[node]
        pieces = len(self.sizes)
        while self.outstanding[node] < self.config.parallel_fetches and self.next_piece[node] < pieces:
            piece = self.next_piece[node]
            if source != self.network.origin and not self.have[source] >> piece & 1:
                return
            self.next_piece[node] = piece + 1
            self.outstanding[node] += 1
            if self.network.busy(source) < self.slots[source]:
                self.network.start(source, node, piece, self.sizes[piece])
            else:
                self.queue[source].append((node, piece))


class _OriginOnly(_InOrder):
    def assign_sources(self) -> list[int]:
        return [self.network.origin] * self.config.nodes


class _TieredMirrors(_InOrder):
    """The first node of each rack mirrors the origin; its rack fetches from it."""

    def assign_sources(self) -> list[int]:
        per_rack, origin = self.config.nodes_per_rack, self.network.origin
        nodes = range(self.config.nodes)
        return [origin if node % per_rack == 0 else node - node % per_rack for node in nodes]

    def on_finished(self, flow: _Flow) -> None:
        super().on_finished(flow)
        mirror = flow.target
        if self.source_of[mirror] == self.network.origin:
            for node in range(mirror + 1, min(mirror + self.config.nodes_per_rack, self.config.nodes)):
                self._fill(node)


class _PeerToPeer(_Fanout):
    """Rarest-first swarm whose sources come from the control plane's tracker policy.

    A node with a free fetch slot takes, in order: the next piece no node holds yet, from the
    origin (at most one origin fetch per node, so first copies land all over the swarm, and at
    most `origin_slots` at the origin); else the rarest piece it lacks that a rack-local peer
    below `upload_slots` holds; else the rarest one a peer elsewhere can serve, unless its rack
    already holds or is receiving that piece. The source itself is the tracker's first choice.
    A node that finds nothing waits ("hungry") until a finished transfer frees a source or
    creates a holder it could use: those events wake the hungry nodes of that source's rack and
    a bounded random sample of the others, as a tracker's long-poll would; if everything goes
    quiet with nodes still hungry, every one of them is retried.

    Piece sets are Python ints used as bitmasks. `rack_offer[r]` holds the pieces that some
    peer of rack r with a free upload slot holds, so a node asks the tracker only about pieces
    that can start now instead of ranking sources for hundreds of pieces whose holders are busy.
    """

    WAKE_SAMPLE = 32

    def __init__(self, config: FanoutConfig, network: _Network, sizes: list[int]) -> None:
        super().__init__(config, network, sizes)
        self.names = [f"node-{i:05d}" for i in range(config.nodes)]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.piece_ids = [f"piece-{p}" for p in range(len(sizes))]
        topology = {
            name: NodePlace(rack=f"rack-{network.rack_of[node]}", site="site-0") for node, name in enumerate(self.names)
        }
        self.tracker = Tracker(
            topology,
            rng=random.Random(f"{config.seed}/tracker"),
            clock=lambda: self.network.now,
            upload_slots=config.upload_slots,
        )
        self.inflight = [0] * config.nodes
        self.holders = [0] * len(sizes)
        self.next_seed = 0
        self.fetching_from_origin = [False] * config.nodes
        per_rack, racks = config.nodes_per_rack, network.rack_of[config.nodes - 1] + 1
        self.rack_members = [range(r * per_rack, min((r + 1) * per_rack, config.nodes)) for r in range(racks)]
        self.uploading_below_cap = [True] * config.nodes
        self.rack_offer = [0] * racks
        self.rack_holds = [0] * racks
        self.rack_incoming = [0] * racks
        self.offer: int | None = 0
        self.hungry: list[int] = []
        self.hungry_at: dict[int, int] = {}
        self.hungry_in_rack: list[set[int]] = [set() for _ in range(racks)]

    def start(self) -> None:
        order = list(range(self.config.nodes))
        self.rng.shuffle(order)
        for node in order:
            self._fill(node)

    def on_finished(self, flow: _Flow) -> None:
        source, node, piece = flow.source, flow.target, flow.piece
        bit = 1 << piece
        self.tracker.announce(self.names[node], (self.piece_ids[piece],))
        self.inflight[node] &= ~bit
        self.holders[piece] += 1
        if self.uploading_below_cap[node]:
            self._add_offer(node, bit)
        rack = self.network.rack_of[node]
        self.rack_holds[rack] |= bit
        if flow.cross:
            self.rack_incoming[rack] &= ~bit
        if source == self.network.origin:
            self.fetching_from_origin[node] = False
        else:
            self._update_offer(source)
        self._fill(node)
        self._wake_for_holder(node, piece)
        self._wake_for_source(source)

    def unstick(self) -> bool:
        for node in list(self.hungry):
            self._fill(node)
        return any(self.network.downloads)

    def _fill(self, node: int) -> None:
        downloads = self.network.downloads[node]
        if self.completion[node] is not None:
            self._set_hungry(node, False)
            return
        while len(downloads) < self.config.parallel_fetches:
            choice = self._choose(node)
            if choice is None:
                self._set_hungry(node, True)
                return
            self._begin(*choice, node)
        self._set_hungry(node, False)

    def _choose(self, node: int) -> tuple[int, int] | None:
        """(piece, source index) for the node's next fetch, or None if nothing can start now."""
        if (
            self.next_seed < len(self.sizes)
            and not self.fetching_from_origin[node]
            and self.tracker.load(ORIGIN) < self.config.origin_slots
        ):
            # No node holds this piece, so the tracker's only source for it is the origin.
            return self.next_seed, self.network.origin
        rack = self.network.rack_of[node]
        wanted = ~(self.have[node] | self.inflight[node])
        rack_local = self.rack_offer[rack] & wanted
        # Pieces a rack-local peer can serve come first, and a piece the rack already holds (its
        # holders busy) or is already receiving is waited for rather than fetched across again:
        # each piece then crosses into a rack about once, which keeps an oversubscribed rack
        # uplink from being the bottleneck.
        remote = self._offered() & wanted & ~self.rack_holds[rack] & ~self.rack_incoming[rack]
        for candidates in (rack_local, remote):
            if candidates:
                choice = self._rarest_with_source(node, candidates)
                if choice is not None:
                    return choice
        return None

    def _rarest_with_source(self, node: int, candidates: int) -> tuple[int, int] | None:
        pieces = _set_bits(candidates)
        rnd = self.rng.random
        holders = self.holders
        pieces.sort(key=lambda piece: (holders[piece], rnd()))
        name = self.names[node]
        for piece in pieces:
            source = self.tracker.rank_sources(name, self.piece_ids[piece], max_sources=1)[0]
            if source != ORIGIN:
                return piece, self.index[source]
        return None

    def _begin(self, piece: int, source: int, node: int) -> None:
        origin = source == self.network.origin
        self.tracker.assign(self.names[node], self.piece_ids[piece], ORIGIN if origin else self.names[source])
        self.inflight[node] |= 1 << piece
        rack = self.network.rack_of[node]
        if self.network.rack_of[source] != rack:
            self.rack_incoming[rack] |= 1 << piece
        if origin:
            self.next_seed += 1
            self.fetching_from_origin[node] = True
        else:
            self._update_offer(source)
        self.network.start(source, node, piece, self.sizes[piece])

    def _offered(self) -> int:
        """Pieces some peer with a free upload slot holds: the only ones worth asking about."""
        if self.offer is None:
            self.offer = 0
            for mask in self.rack_offer:
                self.offer |= mask
        return self.offer

    def _add_offer(self, node: int, mask: int) -> None:
        self.rack_offer[self.network.rack_of[node]] |= mask
        if self.offer is not None:
            self.offer |= mask

    def _update_offer(self, peer: int) -> None:
        """Keep the offer masks in step with `peer` reaching or leaving its upload cap.

        Growing a mask is an OR; shrinking one means recomputing the peer's rack (a few dozen
        ORs) and, lazily, the total.
        """
        below_cap = self.tracker.has_free_slot(self.names[peer])
        if below_cap == self.uploading_below_cap[peer]:
            return
        self.uploading_below_cap[peer] = below_cap
        if below_cap:
            self._add_offer(peer, self.have[peer])
            return
        rack = self.network.rack_of[peer]
        mask = 0
        for member in self.rack_members[rack]:
            if self.uploading_below_cap[member]:
                mask |= self.have[member]
        self.rack_offer[rack] = mask
        self.offer = None

    def _wake_for_holder(self, holder: int, piece: int) -> None:
        bit, name = 1 << piece, self.names[holder]
        for node in self._hungry_near(holder):
            if not self.tracker.has_free_slot(name):
                return
            if not (self.have[node] | self.inflight[node]) & bit:
                self._fill(node)

    def _wake_for_source(self, source: int) -> None:
        if source == self.network.origin:
            for node in self._hungry_anywhere():
                if self.next_seed >= len(self.sizes) or self.tracker.load(ORIGIN) >= self.config.origin_slots:
                    return
                if not self.fetching_from_origin[node]:
                    self._fill(node)
            return
        offer, name = self.have[source], self.names[source]
        for node in self._hungry_near(source):
            if not self.tracker.has_free_slot(name):
                return
            if offer & ~(self.have[node] | self.inflight[node]):
                self._fill(node)

    def _hungry_near(self, node: int) -> Iterator[int]:
        """Hungry nodes worth waking for `node`'s spare upload: its rack first, then anywhere."""
        yield from self._shuffled(self.hungry_in_rack[self.network.rack_of[node]])
        yield from self._hungry_anywhere()

    def _hungry_anywhere(self) -> Iterator[int]:
        """Every hungry node if there are few, else `WAKE_SAMPLE` random draws (lazily: the
        caller usually stops after the first one or two)."""
        if len(self.hungry) <= self.WAKE_SAMPLE:
            yield from self._shuffled(self.hungry)
            return
        rnd, hungry = self.rng.random, self.hungry
        for _ in range(self.WAKE_SAMPLE):
            if not hungry:
                return
            yield hungry[int(rnd() * len(hungry))]

    def _shuffled(self, nodes: Iterable[int]) -> list[int]:
        rnd = self.rng.random
        return sorted(nodes, key=lambda _: rnd())

    def _set_hungry(self, node: int, hungry: bool) -> None:
        if hungry == (node in self.hungry_at):
            return
        rack = self.network.rack_of[node]
        if hungry:
            self.hungry_at[node] = len(self.hungry)
            self.hungry.append(node)
            self.hungry_in_rack[rack].add(node)
            return
        position = self.hungry_at.pop(node)
        last = self.hungry.pop()
        if position < len(self.hungry):
            self.hungry[position] = last
            self.hungry_at[last] = position
        self.hungry_in_rack[rack].discard(node)


def _set_bits(mask: int) -> list[int]:
    bits = []
    while mask:
        low = mask & -mask
        bits.append(low.bit_length() - 1)
        mask ^= low
    return bits
