"""The flow-level network of the fan-out model: racks, full-duplex NICs, the origin's egress,
oversubscribed rack uplinks, fair sharing per link, and the event clock."""

from __future__ import annotations

import heapq
import itertools

from gpucloud.registry.fanout_model.config import ORIGIN_SOURCE, FanoutConfig, Transfer, bytes_per_s


class Flow:
    __slots__ = ("cross", "piece", "rate", "remaining", "since", "size", "source", "start", "target", "token")

    def __init__(self, source: int, target: int, piece: int, size: int, now: float, cross: bool) -> None:
        self.source, self.target, self.piece, self.size = source, target, piece, size
        self.remaining = float(size)
        self.rate = 0.0
        self.since = self.start = now
        self.token = -1
        self.cross = cross


class Network:
    """Links, the transfers crossing them, and the clock (see "Network model" above).

    Node i is index i; the origin is index `nodes`, outside every rack. Starting or ending a
    transfer marks its links dirty; `settle` then recomputes the rate of every transfer on a
    dirty link and reschedules its finish (stale heap entries are skipped by token).
    """

    def __init__(self, config: FanoutConfig) -> None:
        up, down, origin_rate = bytes_per_s(config)
        n = config.nodes
        self.origin = n
        self.rack_of = [i // config.nodes_per_rack for i in range(n)] + [-1]
        racks = self.rack_of[n - 1] + 1
        self.up_capacity = [up] * n + [origin_rate]
        self.down_capacity = down
        # Dicts used as ordered sets: iteration order must not depend on object addresses, or
        # two runs with one seed would schedule ties differently.
        self.uploads: list[dict[Flow, None]] = [{} for _ in range(n + 1)]
        self.downloads: list[dict[Flow, None]] = [{} for _ in range(n)]
        self.rack_capacity: list[tuple[float, float]] | None = None
        if config.rack_oversubscription is not None:
            sizes = [self.rack_of[:n].count(r) for r in range(racks)]
            factor = config.rack_oversubscription
            self.rack_capacity = [(k * up / factor, k * down / factor) for k in sizes]
        self.rack_out: list[dict[Flow, None]] = [{} for _ in range(racks)]
        self.rack_in: list[dict[Flow, None]] = [{} for _ in range(racks)]
        self.now = 0.0
        self.transfers = 0
        self.sent = [0] * (n + 1)
        self._heap: list[tuple[float, int, Flow]] = []
        self._tokens = itertools.count()
        self._dirty: list[dict[Flow, None]] = []
        self.audit = config.audit
        self.log: list[Transfer] | None = [] if config.audit else None
        self.peak_up = [0.0] * (n + 1)
        self.peak_down = [0.0] * n

    def start(self, source: int, target: int, piece: int, size: int) -> None:
        cross = self.rack_of[source] != self.rack_of[target]
        flow = Flow(source, target, piece, size, self.now, cross)
        self.uploads[source][flow] = None
        self.downloads[target][flow] = None
        if cross and self.rack_capacity is not None:
            if source != self.origin:
                self.rack_out[self.rack_of[source]][flow] = None
            self.rack_in[self.rack_of[target]][flow] = None
        self._touch(flow)

    def busy(self, source: int) -> int:
        return len(self.uploads[source])

    def pop_finished(self) -> Flow | None:
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
        dirty: dict[Flow, None] = {}
        for flows in self._dirty:
            dirty.update(flows)
        self._dirty = []
        for flow in dirty:
            self._reschedule(flow)
        if self.audit:
            self._record_peaks(dirty)

    def _touch(self, flow: Flow) -> None:
        """Mark `flow`'s links dirty: the live sets are kept, so transfers added later count."""
        self._dirty.append(self.uploads[flow.source])
        self._dirty.append(self.downloads[flow.target])
        if flow.cross and self.rack_capacity is not None:
            if flow.source != self.origin:
                self._dirty.append(self.rack_out[self.rack_of[flow.source]])
            self._dirty.append(self.rack_in[self.rack_of[flow.target]])

    def _reschedule(self, flow: Flow) -> None:
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

    def _record_peaks(self, flows: dict[Flow, None]) -> None:
        for node in {flow.source for flow in flows}:
            self.peak_up[node] = max(self.peak_up[node], sum(f.rate for f in self.uploads[node]))
        for node in {flow.target for flow in flows}:
            self.peak_down[node] = max(self.peak_down[node], sum(f.rate for f in self.downloads[node]))
