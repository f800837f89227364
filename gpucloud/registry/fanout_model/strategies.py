"""The three ways of fanning out: origin only, tiered mirrors and a peer-to-peer swarm that asks
the control plane's tracker (`gpucloud.registry.tracker`) for its sources."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from gpucloud.registry.fanout_model.config import FanoutConfig
from gpucloud.registry.fanout_model.network import Flow, Network
from gpucloud.registry.tracker import ORIGIN, NodePlace, Tracker


class Fanout(ABC):
    """What every strategy shares: piece bookkeeping, completion times and the event loop."""

    def __init__(self, config: FanoutConfig, network: Network, sizes: list[int]) -> None:
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

    def start(self) -> None:
        """Issue the first requests at time zero, the nodes in a random order."""
        order = list(range(self.config.nodes))
        self.rng.shuffle(order)
        for node in order:
            self._fill(node)

    @abstractmethod
    def _fill(self, node: int) -> None:
        """Start as many fetches for `node` as it may have in flight."""

    @abstractmethod
    def on_finished(self, flow: Flow) -> None:
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


class InOrder(Fanout):
    """Each node fetches pieces in order from one fixed source, which serves a FIFO queue."""

    def __init__(self, config: FanoutConfig, network: Network, sizes: list[int]) -> None:
        super().__init__(config, network, sizes)
        self.source_of = self.assign_sources()
        self.slots = [config.upload_slots] * config.nodes + [config.origin_slots]
        self.queue: list[deque[tuple[int, int]]] = [deque() for _ in range(config.nodes + 1)]
        self.next_piece = [0] * config.nodes
        self.outstanding = [0] * config.nodes

    @abstractmethod
    def assign_sources(self) -> list[int]:
        """Index of each node's one source (the origin is index `nodes`)."""

    def on_finished(self, flow: Flow) -> None:
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


class OriginOnly(InOrder):
    def assign_sources(self) -> list[int]:
        return [self.network.origin] * self.config.nodes


class TieredMirrors(InOrder):
    """The first node of each rack mirrors the origin; its rack fetches from it."""

    def assign_sources(self) -> list[int]:
        per_rack, origin = self.config.nodes_per_rack, self.network.origin
        nodes = range(self.config.nodes)
        return [origin if node % per_rack == 0 else node - node % per_rack for node in nodes]

    def on_finished(self, flow: Flow) -> None:
        super().on_finished(flow)
        mirror = flow.target
        if self.source_of[mirror] == self.network.origin:
            for node in range(mirror + 1, min(mirror + self.config.nodes_per_rack, self.config.nodes)):
                self._fill(node)


class PeerToPeer(Fanout):
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

    def __init__(self, config: FanoutConfig, network: Network, sizes: list[int]) -> None:
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

    def on_finished(self, flow: Flow) -> None:
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
        pieces = set_bits(candidates)
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


def set_bits(mask: int) -> list[int]:
    bits = []
    while mask:
        low = mask & -mask
        bits.append(low.bit_length() - 1)
        mask ^= low
    return bits
