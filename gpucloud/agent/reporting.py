"""What a node's agent sends on its own: heartbeats, readings, XID events and the signals beyond
XIDs (`agent/signals.py`: InfiniBand sysfs, the kernel log) to the control plane (`Reporter`,
through the node protocol's `ReportClient`), and its metered usage to the ledger
(`AgentMetering`: a meter and a shipper over one durable spool)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from pydantic import ValidationError

from gpucloud.agent.enrollment import ConfigDriveEnroller
from gpucloud.agent.host import HostState
from gpucloud.agent.shipper import Shipper
from gpucloud.agent.signals import SignalSampler
from gpucloud.agent.spool import Meter, Spool
from gpucloud.ledger.client import UsageLedger
from gpucloud.protocol.reporter import ReportClient
from gpucloud.protocol.reports import (
    AGENT_MAX_EVENTS,
    AGENT_MAX_SIGNAL_REPORTS,
    NodeReading,
    SignalReport,
    WorkloadStatus,
    XidEvent,
)

if TYPE_CHECKING:
    from gpucloud.agent.app import Agent

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 10_000  # kept while the control plane is unreachable; oldest dropped first
# A batch the control plane refuses as malformed or too large is refused again on every retry:
# dropped, so it does not hold back the reports behind it.
REFUSED_FOR_GOOD = frozenset({413, 422})
MAX_PENDING_SIGNAL_REPORTS = 1_000  # likewise, signal reports (each up to AGENT_MAX_EVENTS observations)


class AgentMetering:
    """The node's meter and shipper, each on its own thread, over one durable spool."""

    def __init__(
        self,
        agent: Agent,
        spool_path: Path,
        ledger_url: str,
        *,
        interval_s: float = 60.0,
        token: Callable[[], str] | None = None,
    ) -> None:
        self.spool = Spool(spool_path, agent.state.node_id)
        self.meter = Meter(
            self.spool,
            lambda: agent.state.allocation,
            interval_ms=max(1, int(interval_s * 1000)),
            lock=agent.state.meter_lock,
        )
        # `token`: the ledger takes this node's usage only with a token for this node.
        self.shipper = Shipper(self.spool, UsageLedger(ledger_url, token=token))
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.meter.run, args=(self._stop,), name="meter", daemon=True),
            threading.Thread(target=self.shipper.run, args=(self._stop,), name="shipper", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self.meter.tick()  # a workload that ended since the last tick is cut at its end
        self.shipper.close()
        self.spool.close()

    def report(self) -> dict:
        lag = self.spool.lag()
        return dataclasses.asdict(lag)


class _CurrentCredential(httpx.Auth):
    """The node's credential as it is now (a wipe replaces it while the agent runs)."""

    def __init__(self, state: HostState) -> None:
        self.state = state

    def auth_flow(self, request: httpx.Request):
        if self.state.credential:
            request.headers["Authorization"] = f"Bearer {self.state.credential}"
        yield request


class Reporter:
    """Pushes heartbeats, readings, XID events and signal reports to the control plane; events
    and signal reports wait while it is down (a port that went down is reported once, when the
    sampler sees it change). Readings do not: their counters are cumulative, so the next one
    delivered carries what the lost ones would have shown.

    `signals` samples the signals beyond XIDs once every reading period (default: a sampler of
    this host's InfiniBand sysfs, without the kernel log)."""

    def __init__(
        self,
        agent: Agent,
        client: httpx.AsyncClient,
        *,
        enrollment_file: Path | None = None,
        signals: SignalSampler | None = None,
    ) -> None:
        self.agent = agent
        client.auth = _CurrentCredential(agent.state)
        self.reports = ReportClient(client)
        # A re-imaged boot's config drive, redeemed for the node's credential (`agent/enrollment.py`).
        self.enroller = ConfigDriveEnroller(agent.state, enrollment_file, self.reports) if enrollment_file else None
        self.pending: list[XidEvent] = []
        self.latest: NodeReading | None = None
        self.signals = signals if signals is not None else SignalSampler(agent.state.node_id)
        self.pending_signals: list[SignalReport] = []

    async def heartbeat_once(self) -> None:
        try:
            workload: WorkloadStatus | None = None
            if self.agent.workloads is not None:
                workload = await asyncio.to_thread(self.agent.workloads.report)
            beat = self.agent.state.heartbeat(workload)
            resp = await self.reports.heartbeats([beat])
            resp.raise_for_status()
        except (httpx.HTTPError, ValidationError) as exc:  # a state the protocol refuses is not sent
            log.warning("heartbeat not delivered: %s", exc)

    async def read_once(self) -> NodeReading:
        """Read the probe and push the reading; the reading either way."""
        self.latest = await asyncio.to_thread(self.agent.probe.read)
        try:
            resp = await self.reports.readings([self.latest])
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("reading not delivered (dropped; the next one carries its counters): %s", exc)
        return self.latest

    async def events_once(self, wait_s: float) -> int:
        """Wait up to `wait_s` for XIDs, then push what is pending; the number delivered."""
        tenant = self.agent.state.tenant_id
        new = await asyncio.to_thread(self.agent.probe.wait_events, wait_s)
        self.pending += [e if e.tenant_id else e.model_copy(update={"tenant_id": tenant}) for e in new]
        del self.pending[:-MAX_PENDING_EVENTS]
        if not self.pending:
            return 0
        batch = self.pending[:AGENT_MAX_EVENTS]
        try:
            resp = await self.reports.events(batch)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("%d XID events not delivered (kept): %s", len(self.pending), exc)
            return 0
        del self.pending[: len(batch)]
        return len(batch)

    async def signals_once(self) -> int:
        """Sample the signals beyond XIDs and push what is pending; the reports delivered."""
        try:
            self.pending_signals += await asyncio.to_thread(self.signals.sample)
        except OSError as exc:  # sysfs read mid-change, a log source gone: the next period tries again
            log.warning("signals not sampled: %s", exc)
        if self.agent.workloads is not None:
            # The tenant's workload past its progress timeout: the workload's fault, counted.
            hang = await asyncio.to_thread(self.agent.workloads.hung)
            if hang is not None:
                self.pending_signals.append(
                    SignalReport(node_id=self.agent.state.node_id, at=hang.at, observations=[hang])
                )
        del self.pending_signals[:-MAX_PENDING_SIGNAL_REPORTS]
        delivered = 0
        while self.pending_signals:
            batch = self.pending_signals[:AGENT_MAX_SIGNAL_REPORTS]
            try:
                resp = await self.reports.signals(batch)
                if resp.status_code in REFUSED_FOR_GOOD:
                    log.warning("%d signal reports refused (dropped): %s", len(batch), resp.text[:500])
                    del self.pending_signals[: len(batch)]
                    continue
                resp.raise_for_status()
            except httpx.HTTPError as exc:
                log.warning("%d signal reports not delivered (kept): %s", len(self.pending_signals), exc)
                break
            del self.pending_signals[: len(batch)]
            delivered += len(batch)
        return delivered

    async def sample_once(self) -> None:
        """One reading period: the probe's reading, then the signals."""
        await self.read_once()
        await self.signals_once()

    async def run(self, *, heartbeat_s: float, reading_s: float, event_wait_s: float = 1.0) -> None:
        async def every(period: float, step: Callable) -> None:
            while True:
                await step()
                await asyncio.sleep(period)

        async def events() -> None:
            while True:
                await self.events_once(event_wait_s)

        steps = [every(heartbeat_s, self.heartbeat_once), every(reading_s, self.sample_once), events()]
        if self.enroller is not None:
            steps.append(every(heartbeat_s, self.enroller.once))
        await asyncio.gather(*steps)
