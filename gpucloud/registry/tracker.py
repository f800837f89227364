"""The weight-distribution tracker: who holds which chunks, and where a node should fetch each one.

Nodes announce the chunks they hold (every chunk verified against the manifest before it is
announced); a node about to fetch asks `peers_for` and gets, per chunk, an ordered list of
sources: peers in its own rack, then peers elsewhere in its site, then peers in other sites, and
the origin last, so origin egress stays near one copy of the artifact per site. Within a tier the
least-loaded peer comes first (the tracker counts the transfers it has handed to each source and
not yet seen finish), ties broken by an injectable random generator, so a thousand nodes asking
for the same chunk do not all land on its first holder. A peer that served bad bytes is skipped
for that chunk for a while, and quarantined for every chunk after repeated reports.

Chunk ids are content addresses (BLAKE3), so a chunk held for one version serves every version
that contains it: the tracker keys holdings by chunk id, not by version.

This is pure logic with no I/O: the control plane wraps it behind HTTP and a database, and the
fan-out simulator (`gpucloud.registry.fanout_model`) drives the very same source selection.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

ORIGIN = "origin"
"""The source of last resort: the chunk store every chunk was pushed to."""

_Key = TypeVar("_Key")


@dataclass(frozen=True, slots=True)
class NodePlace:
    """Where a node sits in the network; transfers inside a rack are cheapest."""

    rack: str
    site: str


class _Bag:
    """A set with O(1) add, remove and uniform random sampling (list + position index)."""

    __slots__ = ("_index", "items")

    def __init__(self) -> None:
        self.items: list[str] = []
        self._index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, item: object) -> bool:
        return item in self._index

    def add(self, item: str) -> None:
        if item not in self._index:
            self._index[item] = len(self.items)
            self.items.append(item)

    def discard(self, item: str) -> None:
        position = self._index.pop(item, None)
        if position is None:
            return
        last = self.items.pop()
        if position < len(self.items):
            self.items[position] = last
            self._index[last] = position


def _bag_for(bags: dict[_Key, _Bag], key: _Key) -> _Bag:
    bag = bags.get(key)
    if bag is None:
        bag = bags[key] = _Bag()
    return bag


class Tracker:
    """Chunk holdings and source selection for one swarm (a site, or the whole fleet).

    `topology` maps every node id to its rack and site. `upload_slots`, when set, is how many
    transfers a peer serves at once; a peer with all of them assigned is not offered (the caller
    picks another chunk or waits) rather than slowing every transfer it already serves.
    `sample_size` bounds the work per tier: a tier with more holders than that is ranked from a
    random sample of that many (the "power of d choices" rule, which spreads load almost as well
    as ranking every holder), so a request costs about the same whether ten or ten thousand nodes
    hold the chunk.
    """

    def __init__(
        self,
        topology: Mapping[str, NodePlace],
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        upload_slots: int | None = None,
        sample_size: int = 16,
        bad_chunk_ttl_s: float = 600.0,
        strikes_to_quarantine: int = 3,
        quarantine_s: float = 1800.0,
    ) -> None:
        if ORIGIN in topology:
            raise ValueError(f"{ORIGIN!r} is reserved for the chunk store")
        if sample_size < 1:
            raise ValueError("sample_size must be at least 1")
        if upload_slots is not None and upload_slots < 1:
            raise ValueError("upload_slots must be at least 1")
        self._rack = {node: place.rack for node, place in topology.items()}
        self._site = {node: place.site for node, place in topology.items()}
        self._rng = rng or random.Random()
        self._clock = clock
        self._sample_size = sample_size
        self._bad_chunk_ttl_s = bad_chunk_ttl_s
        self._strikes_to_quarantine = strikes_to_quarantine
        self._quarantine_s = quarantine_s

        self._holders: dict[str, _Bag] = {}
        self._by_site: dict[tuple[str, str], _Bag] = {}
        self._by_rack: dict[tuple[str, str], _Bag] = {}
        self._held: dict[str, set[str]] = {}

        self._upload_slots = upload_slots
        self._load: dict[str, int] = {}
        # Peers below `upload_slots`: when few are, searching them beats sampling the holders.
        self._open = _Bag()
        if upload_slots is not None:
            for node in topology:
                self._open.add(node)
        self._assigned: dict[tuple[str, str], str] = {}
        self._serving: dict[str, set[tuple[str, str]]] = {}

        self._bad_until: dict[tuple[str, str], float] = {}
        self._strikes: dict[str, deque[float]] = {}
        self._quarantined_until: dict[str, float] = {}

    # Holdings ------------------------------------------------------------------------------

    def announce(self, node: str, chunks: Iterable[str]) -> None:
        """Record that `node` now holds (verified copies of) `chunks`.

        An announcement also closes the node's outstanding assignment for each chunk: the
        transfer the tracker handed out has finished, so its source is one transfer less busy.
        """
        rack, site = self._place(node)
        if self._upload_slots is not None and self.has_free_slot(node):
            self._open.add(node)  # back after a `forget`
        held = self._held.setdefault(node, set())
        for chunk in chunks:
            self._close_assignment(node, chunk)
            if chunk in held:
                continue
            held.add(chunk)
            _bag_for(self._holders, chunk).add(node)
            _bag_for(self._by_site, (chunk, site)).add(node)
            _bag_for(self._by_rack, (chunk, rack)).add(node)

    def forget(self, node: str) -> None:
        """Drop everything known about `node`: its holdings and its transfers either way.

        Receivers that were assigned this node as their source simply ask again; their new
        answer no longer names it.
        """
        rack, site = self._place(node)
        for chunk in self._held.pop(node, set()):
            self._holders[chunk].discard(node)
            self._by_site[(chunk, site)].discard(node)
            self._by_rack[(chunk, rack)].discard(node)
        for key in [key for key in self._assigned if key[0] == node]:
            self._close_assignment(*key)
        for key in self._serving.pop(node, set()):
            del self._assigned[key]
        self._load.pop(node, None)
        self._open.discard(node)

    def holders(self, chunk: str) -> frozenset[str]:
        bag = self._holders.get(chunk)
        return frozenset(bag.items) if bag else frozenset()

    # Integrity -------------------------------------------------------------------------------

    def report_bad(self, peer: str, chunk: str) -> None:
        """`peer` served bytes for `chunk` that did not hash to its id.

        The peer is skipped as a source of that chunk for `bad_chunk_ttl_s` (a corrupt copy or a
        flaky link heals or gets replaced), and for every chunk for `quarantine_s` once it has
        `strikes_to_quarantine` reports inside that window (a peer that keeps serving garbage is
        broken or hostile).
        """
        if peer == ORIGIN:
            raise ValueError("the origin is the source of truth; a bad chunk there is a store fault")
        self._place(peer)
        now = self._clock()
        self._bad_until[(peer, chunk)] = now + self._bad_chunk_ttl_s
        strikes = self._strikes.setdefault(peer, deque())
        strikes.append(now)
        while strikes and strikes[0] <= now - self._quarantine_s:
            strikes.popleft()
        if len(strikes) >= self._strikes_to_quarantine:
            self._quarantined_until[peer] = now + self._quarantine_s

    # Source selection ----------------------------------------------------------------------

    def rank_sources(self, node: str, chunk: str, *, max_sources: int = 4) -> list[str]:
        """Up to `max_sources` peers for `node` to fetch `chunk` from, best first, then ORIGIN.

        Order: rack-local, same site, other sites; least loaded first within a tier, ties in
        random order. Peers with all `upload_slots` busy, reported bad for this chunk, or
        quarantined are left out. The origin is always listed, last: it is the answer only when
        no usable peer holds the chunk, or when every listed peer fails.
        """
        rack, site = self._place(node)
        sources: list[str] = []
        rack_bag = self._by_rack.get((chunk, rack))
        site_bag = self._by_site.get((chunk, site))
        world_bag = self._holders.get(chunk)
        in_rack = len(rack_bag) if rack_bag else 0
        in_site = len(site_bag) if site_bag else 0
        # A tier is searched only if it has holders beyond the nearer tiers it contains.
        tiers = (
            (rack_bag, None, None, in_rack),
            (site_bag, rack, None, in_site - in_rack),
            (world_bag, None, site, (len(world_bag) if world_bag else 0) - in_site),
        )
        for bag, skip_rack, skip_site, own_holders in tiers:
            if len(sources) >= max_sources:
                break
            if bag and own_holders > 0:
                wanted = max_sources - len(sources)
                sources.extend(self._rank_tier(node, chunk, bag, skip_rack, skip_site, wanted))
        sources.append(ORIGIN)
        return sources

    def peers_for(self, node: str, chunk_ids: Iterable[str], *, max_sources: int = 4) -> dict[str, list[str]]:
        """Ordered sources for each chunk, and an assignment of the first one.

        The first source of each list is counted as busy with this node until the node announces
        the chunk or calls `release`, which is what steers the next caller elsewhere.
        """
        plan: dict[str, list[str]] = {}
        for chunk in chunk_ids:
            # A repeat request replaces the earlier assignment; drop it before ranking so its
            # source is not counted busy with this very node.
            self._close_assignment(node, chunk)
            sources = self.rank_sources(node, chunk, max_sources=max_sources)
            self.assign(node, chunk, sources[0])
            plan[chunk] = sources
        return plan

    def assign(self, node: str, chunk: str, source: str) -> None:
        """Count a transfer of `chunk` from `source` to `node` as in flight."""
        self._close_assignment(node, chunk)
        self._assigned[(node, chunk)] = source
        self._serving.setdefault(source, set()).add((node, chunk))
        self._add_load(source, 1)

    def release(self, node: str, chunk: str) -> None:
        """The node gave up on `chunk` (or will ask again): its source is free of it."""
        self._close_assignment(node, chunk)

    def load(self, source: str) -> int:
        """Transfers handed to `source` (a peer or ORIGIN) that have not finished yet."""
        return self._load.get(source, 0)

    def has_free_slot(self, peer: str) -> bool:
        return self._upload_slots is None or self._load.get(peer, 0) < self._upload_slots

    # Internals ---------------------------------------------------------------------------------

    def _place(self, node: str) -> tuple[str, str]:
        try:
            return self._rack[node], self._site[node]
        except KeyError:
            raise ValueError(f"node {node!r} is not in the tracker's topology") from None

    def _close_assignment(self, node: str, chunk: str) -> None:
        source = self._assigned.pop((node, chunk), None)
        if source is not None:
            self._serving[source].discard((node, chunk))
            self._add_load(source, -1)

    def _add_load(self, source: str, delta: int) -> None:
        load = self._load[source] = self._load.get(source, 0) + delta
        if self._upload_slots is None or source == ORIGIN:
            return
        if load < self._upload_slots:
            self._open.add(source)
        else:
            self._open.discard(source)

    def _rank_tier(
        self, node: str, chunk: str, bag: _Bag, skip_rack: str | None, skip_site: str | None, wanted: int
    ) -> list[str]:
        """Up to `wanted` usable peers of one tier, least loaded first, ties in random order.

        The candidates are whichever is smallest: the peers with a free upload slot that hold the
        chunk (exact, and cheap when the swarm is busy), every holder, or a random sample of
        `sample_size` holders (cheap when the swarm is idle). A sample with nobody usable in it
        falls back to an exact search, so a usable peer is never missed.
        """
        items = bag.items
        open_peers = self._open.items if self._upload_slots is not None else None
        sampled = False
        if open_peers is not None and len(open_peers) <= min(len(items), self._sample_size):
            candidates = [peer for peer in open_peers if peer in bag]
        elif len(items) <= self._sample_size:
            candidates = items
        else:
            rnd, size = self._rng.random, len(items)
            candidates = list(dict.fromkeys(items[int(rnd() * size)] for _ in range(self._sample_size)))
            sampled = True
        usable = self._usable(node, chunk, candidates, skip_rack, skip_site)
        if not usable and sampled:
            if open_peers is not None and len(open_peers) < len(items):
                candidates = [peer for peer in open_peers if peer in bag]
            else:
                candidates = items
            usable = self._usable(node, chunk, candidates, skip_rack, skip_site)
        if not usable:
            return usable
        load, rnd = self._load, self._rng.random
        if wanted == 1:
            return [min(usable, key=lambda peer: (load.get(peer, 0), rnd()))]
        usable.sort(key=lambda peer: (load.get(peer, 0), rnd()))
        return usable[:wanted]

    def _usable(
        self, node: str, chunk: str, candidates: list[str], skip_rack: str | None, skip_site: str | None
    ) -> list[str]:
        load, rack_of, site_of, slots = self._load, self._rack, self._site, self._upload_slots
        shunning = bool(self._bad_until or self._quarantined_until)
        usable = []
        for peer in candidates:
            if peer == node:
                continue
            if skip_rack is not None and rack_of[peer] == skip_rack:
                continue
            if skip_site is not None and site_of[peer] == skip_site:
                continue
            if slots is not None and load.get(peer, 0) >= slots:
                continue
            if shunning and self._is_shunned(peer, chunk):
                continue
            usable.append(peer)
        return usable

    def _is_shunned(self, peer: str, chunk: str) -> bool:
        now = self._clock()
        until = self._quarantined_until.get(peer)
        if until is not None:
            if now < until:
                return True
            del self._quarantined_until[peer]
        until = self._bad_until.get((peer, chunk))
        if until is not None:
            if now < until:
                return True
            del self._bad_until[(peer, chunk)]
        return False
