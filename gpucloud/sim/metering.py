"""Usage metering for the simulated fleet: every node's meter, durable spool and shipper.

The same parts a real agent uses (`gpucloud/agent/spool.py`), one set per node, driven by one
thread for the whole fleet instead of two per node:

- A node is metered from the moment it is provisioned for an allocation until its workload stops
  (release; a reboot, reflash or re-image behind the control plane's back). Each start and stop
  is metered at once, so the last partial interval of an allocation is cut at its real end, then
  every interval boundary cuts whole intervals.
- Each node's spool (a SQLite file `<spool dir>/<node id>.db`) is drained to the ledger's
  `POST /v1/usage:batch` with `Shipper.ship_once`, backing off while the ledger does not take
  batches. Spools outlive the sim: on start it opens those it finds and ships their backlog.

Only nodes that were ever provisioned get a spool, so a large idle fleet costs nothing. The
intervals each node was metered for are kept in memory (`report`): the ground truth that tests
and the demo compare the ledger's totals with.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from gpucloud.agent.shipper import Shipper
from gpucloud.agent.spool import DEFAULT_BATCH_SIZE, Meter, NodeAllocation, Spool, wall_clock_ms
from gpucloud.ledger.client import LedgerUnavailable, UsageLedger
from gpucloud.retry import Backoff, retry_call_async
from gpucloud.web import tls
from gpucloud.web.http_client import async_http_client

log = logging.getLogger(__name__)

ACKED_RETENTION_MS = 3_600_000


@dataclass
class _NodeMeter:
    spool: Spool
    meter: Meter
    shipper: Shipper
    lock: threading.Lock = field(default_factory=threading.Lock)
    current: NodeAllocation | None = None
    history: list[NodeAllocation] = field(default_factory=list)

    @property
    def is_open(self) -> bool:
        return self.current is not None and self.current.ended_ms is None


class FleetMetering:
    def __init__(
        self,
        spool_dir: Path,
        ledger_url: str,
        *,
        interval_ms: int,
        node_ids: Iterable[str] = (),
        batch_size: int = DEFAULT_BATCH_SIZE,
        backoff_max_s: float = 10.0,
        clock_ms: Callable[[], int] = wall_clock_ms,
        token: Callable[[], str] | None = None,
    ) -> None:
        self.spool_dir = spool_dir
        self.ledger_url = ledger_url
        self.interval_ms = interval_ms
        self.batch_size = batch_size
        self._backoff_max_s = backoff_max_s
        self._clock_ms = clock_ms
        # `token`: the ledger's bearer token (the simulated fleet ships every node's usage with
        # an operator token the control plane gives it).
        self._ledger = UsageLedger(ledger_url, token=token)
        self._meters: dict[str, _NodeMeter] = {}
        self._meters_lock = threading.Lock()
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        for node_id in node_ids:
            if self._spool_path(node_id).exists():
                self._node(node_id)  # a backlog from before a restart: ship it

    def _spool_path(self, node_id: str) -> Path:
        return self.spool_dir / f"{node_id}.db"

    def _node(self, node_id: str) -> _NodeMeter:
        with self._meters_lock:
            found = self._meters.get(node_id)
            if found is not None:
                return found
            spool = Spool(self._spool_path(node_id), node_id, clock_ms=self._clock_ms)
            node: _NodeMeter

            def current() -> NodeAllocation | None:
                return node.current

            # A sample for an allocation the ledger has not heard of yet comes back soon: its
            # events are on their way from the control plane.
            shipper = Shipper(
                spool,
                self._ledger,
                batch_size=self.batch_size,
                retry_rejected_after_ms=min(60_000, 5 * self.interval_ms),
                clock_ms=self._clock_ms,
            )
            node = _NodeMeter(
                spool, Meter(spool, current, interval_ms=self.interval_ms, clock_ms=self._clock_ms), shipper
            )
            self._meters[node_id] = node
            return node

    def is_open(self, node_id: str) -> bool:
        node = self._meters.get(node_id)
        return node is not None and node.is_open

    def start(self, node_id: str, allocation: NodeAllocation) -> None:
        """The node now runs this allocation's workload (a repeat for the one it runs is a no-op)."""
        node = self._node(node_id)
        with node.lock:
            if node.current is not None and node.is_open:
                if node.current.allocation_id == allocation.allocation_id:
                    return
                self._end(node, allocation.started_ms)
            node.current = allocation
            node.history.append(allocation)
            node.meter.tick()

    def stop(self, node_id: str, at_ms: int) -> None:
        """The node's workload stopped (if it ran one)."""
        node = self._meters.get(node_id)
        if node is None:
            return
        with node.lock:
            if node.is_open:
                self._end(node, at_ms)

    @staticmethod
    def _end(node: _NodeMeter, at_ms: int) -> None:
        """End the open allocation at `at_ms`, or where the meter already is if a tick passed
        that moment before the stop arrived (it is taken before a hop to this thread): what
        was metered may have shipped and is not taken back, so the node's record of what it ran
        (`history`, the ground truth) must not end short of it. The ledger's close bills the
        tenant's held time in any case."""
        assert node.current is not None  # callers end an open allocation only
        metered_to = node.spool.meter_cursor(node.current.allocation_id) or 0
        ended = replace(node.current, ended_ms=max(at_ms, node.current.started_ms, metered_to))
        node.current = ended
        node.history[-1] = ended
        node.meter.tick()

    def run(self, stop: threading.Event) -> None:
        """Meter at every interval boundary and ship continuously, until ``stop`` is set."""
        next_tick_ms = 0
        ship_after_ms = 0
        backoff = Backoff(first_s=0.2, cap_s=self._backoff_max_s, jitter=0.5)
        failures = 0
        while not stop.is_set():
            now_ms = self._clock_ms()
            if now_ms >= next_tick_ms:
                self._tick_all(now_ms)
                next_tick_ms = (now_ms // self.interval_ms + 1) * self.interval_ms
            if now_ms >= ship_after_ms:
                try:
                    self._ship_all()
                    failures = 0
                except Exception as error:
                    failures += 1
                    ship_after_ms = now_ms + int(backoff.delay_s(failures) * 1000)
                    log.warning(
                        "usage not shipped (%s); the spools keep it, retrying in %.1f s",
                        error,
                        backoff.ceiling_s(failures),
                        exc_info=not isinstance(error, LedgerUnavailable),
                    )
            stop.wait(min(0.5, max(0.01, (next_tick_ms - self._clock_ms()) / 1000)))

    def _tick_all(self, now_ms: int) -> None:
        for node in list(self._meters.values()):
            try:
                with node.lock:
                    node.meter.tick()
                node.spool.prune_acked(older_than_ms=now_ms - ACKED_RETENTION_MS)
            except Exception:
                log.exception("metering %s failed; retrying at the next interval", node.spool.node_id)

    def _ship_all(self) -> None:
        for node in list(self._meters.values()):
            while node.shipper.ship_once().sent >= self.batch_size:
                pass

    def report(self) -> dict:
        """Per node: the allocations it was metered for (the ground truth) and its spool's lag."""
        nodes = {}
        with self._meters_lock:
            meters = sorted(self._meters.items())
        for node_id, node in meters:
            lag = node.spool.lag()
            nodes[node_id] = {
                "allocations": [asdict(a) for a in node.history],
                "pending": lag.pending,
                "deferred": lag.deferred,
                "rejected": lag.rejected,
                "oldest_pending_age_ms": lag.oldest_pending_age_ms,
                "last_seq": node.spool.last_seq(),
                "samples": node.spool.appended(),
            }
        return {
            "ledger_url": self.ledger_url,
            "interval_ms": self.interval_ms,
            "pending": sum(n["pending"] for n in nodes.values()),
            "nodes": nodes,
        }

    def close(self) -> None:
        for node in self._meters.values():
            node.spool.close()
        self._ledger.close()


@dataclass(frozen=True)
class MeteringSpec:
    ledger_url: str
    spool_dir: Path
    interval_s: float = 60.0


class WorkloadFollower:
    """Starts and stops a simulated node's meter as its workload starts and stops.

    A provision names its allocation (`allocation_id`, as the real agent's API takes it); one
    from a control plane that does not send it is looked up in the control plane's node record,
    which names it from the reservation on, while the control plane is provisioning the node.
    """

    LOOKUP_ATTEMPTS = 5
    LOOKUP_BACKOFF = Backoff(first_s=0.2, cap_s=3.2)

    def __init__(self, metering: FleetMetering, *, control_plane_url: str | None, operator_token: str | None) -> None:
        self.metering = metering
        self._control_plane_url = control_plane_url
        self._headers = {"Authorization": f"Bearer {operator_token}"}

    async def __call__(self, node) -> None:
        now_ms = wall_clock_ms()
        if not node.workload_running:
            if self.metering.is_open(node.id):
                await asyncio.to_thread(self.metering.stop, node.id, now_ms)
            return
        if self.metering.is_open(node.id):
            return
        allocation_id = node.allocation_id or await self._allocation_of(node.id)
        if allocation_id is None:
            log.error("%s runs a workload of %s but its allocation is unknown: not metered", node.id, node.tenant_id)
            return
        allocation = NodeAllocation(
            allocation_id=allocation_id,
            tenant_id=node.tenant_id,
            gpu_type=node.gpu_type,
            gpu_count=node.gpu_count,
            started_ms=now_ms,
        )
        await asyncio.to_thread(self.metering.start, node.id, allocation)

    async def _allocation_of(self, node_id: str) -> str | None:
        if self._control_plane_url is None:
            return None
        async with async_http_client(
            base_url=self._control_plane_url, headers=self._headers, timeout="agent_lookup", trust=tls.client_verify()
        ) as client:

            async def allocation_id() -> str | None:
                response = await client.get(f"/v1/nodes/{node_id}")
                if response.status_code != 200:
                    raise httpx.HTTPStatusError(
                        f"HTTP {response.status_code}", request=response.request, response=response
                    )
                return response.json().get("allocation_id")

            try:
                return await retry_call_async(
                    allocation_id,
                    retry_on=httpx.HTTPError,
                    backoff=self.LOOKUP_BACKOFF,
                    attempts=self.LOOKUP_ATTEMPTS,
                    deadline_s=None,
                )
            except httpx.HTTPError:
                return None
