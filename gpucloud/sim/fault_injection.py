"""The simulated fleet failing like a real one: faults drawn from a fault model (`sim/faults.py`,
the Llama 3 405B mix by default), sped up by a time scale, applied to the simulated nodes and
reported to the control plane the way a node's agent reports them.

`gpucloud sim --faults llama3 --time-scale N` (and `gpucloud up --faults llama3`) runs it: every
`tick_s` the model draws the interruptions the fleet suffers in `tick_s * N` seconds of fleet
time. For each:

- the fault happens on the node's simulated GPUs (`sim/probe.py`, made on the node's first
  fault: counters bumped, drifts that keep rising, a GPU lost), drift rates sped up by the same
  time scale; the XIDs it shows are posted to `POST /v1/agents/events`, and every `reading_s`
  each faulty node's readings to `POST /v1/agents/readings`, by the node's own agent credential
  (the operator token for a node no wipe has handed one yet), so the health loop judges them
  (XID rules, and the ECC, NVLink and PCIe trends) as it judges a real agent's;
- a hardware fault stays on the node (its burn-in fails) until the rung of the repair ladder
  that fixes it has run (`FIXED_BY`); faults a repair cannot fix (silent data corruption, a
  bad cable) leave the node for RMA;
- faults of the software (application XIDs, an NCCL watchdog) leave the hardware alone.

A fault NVML cannot see (a switch port or cable, a NIC, host maintenance, silent data
corruption, the tail of other hardware, an NCCL watchdog timeout) names a host condition, which
shows as the signals a host agent would see (`sim/host_signals.py`); those go to
`POST /v1/agents/signals` with the XIDs, by the same credential, so the signal table pulls the
node without an XID (and an NCCL timeout, the workload's fault, is counted, never a pull).

A failed leaf switch (`switch_down_reports`, the simulator's `POST /v1/faults/switch_down`) takes
every port of every node behind it down together: each node reports `ib_link_down` on each of its
rails, by its own credential, as its agent would, so the control plane sees a burst behind one
switch (`health/correlation.py`) rather than that many broken nodes.

What was injected, by category, next to the paper's shares, is in `summary()` (the simulator's
`GET /v1/faults`), with the ground truth of every fault (`injections`: when, on which node, of
what category, whether it left a hardware fault, whom the node served then), which a benchmark
matches to the control plane's incidents. Once the repair ladder clears a node's hardware fault,
its GPUs are repaired too and its readings stop.

Fleet time follows the wall clock while the model runs (each step covers the wall time since the
last, times the scale), so `--time-scale` holds however late the loop's ticks come. A run too
short for the rare categories to come up by chance can ask for a minimum of each (`top_up`):
a category still short of it at its checkpoint is injected then, on a node drawn as the model
draws them, and counted as forced.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import httpx

from gpucloud.health.categories import FaultCategory
from gpucloud.protocol.actions import AgentAction
from gpucloud.protocol.reporter import ReportClient
from gpucloud.protocol.reports import Signal, SignalObservation, SignalReport, XidEvent
from gpucloud.sim.faults import LLAMA3_405B_MIX, Fault, FaultModel
from gpucloud.sim.host_signals import HOST_CONDITION_SIGNALS
from gpucloud.sim.probe import SimulatedProbe
from gpucloud.web import tls
from gpucloud.web.http_client import async_http_client

log = logging.getLogger(__name__)

# The mildest rung of the repair ladder (reset, reboot, reflash) that clears each category's
# hardware fault; None: no rung does (the node ends in RMA). Categories absent: no hardware fault.
FIXED_BY: dict[FaultCategory, AgentAction | None] = {
    FaultCategory.FAULTY_GPU: AgentAction.REBOOT,
    FaultCategory.HBM3: AgentAction.RESET,  # a row remap takes effect at the next GPU reset
    FaultCategory.GPU_SRAM: AgentAction.RESET,
    FaultCategory.GSP: AgentAction.REBOOT,
    FaultCategory.NETWORK: None,  # a cable or switch port: a technician's job
    FaultCategory.HOST_MAINTENANCE: AgentAction.REBOOT,
    FaultCategory.NIC: AgentAction.REFLASH,
    FaultCategory.SILENT_DATA_CORRUPTION: None,
    FaultCategory.OTHER: AgentAction.REBOOT,
}
MODELS = {"llama3": FaultModel}


class FleetFaults:
    """Draws and applies faults for a fleet (`nodes`: node id -> `SimNode`, read live)."""

    def __init__(
        self,
        nodes: dict[str, Any],
        *,
        model: FaultModel | None = None,
        time_scale: float = 1.0,
        seed: int = 0,
        control_plane_url: str | None = None,
        operator_token: str | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.nodes = nodes
        self.model = model or FaultModel()
        self.time_scale = time_scale
        self.rng = random.Random(seed)
        self.control_plane_url, self.operator_token = control_plane_url, operator_token
        self.clock = clock
        self.injected: Counter[str] = Counter()
        self.hardware: Counter[str] = Counter()
        self.xids_reported = self.readings_reported = self.signals_reported = 0
        self.fleet_seconds = 0.0
        self.probes: dict[str, SimulatedProbe] = {}  # the GPUs of nodes with a hardware fault
        self.by_node: dict[str, list[str]] = {}  # every category each node suffered, in order
        self.running = True  # paused: no faults drawn, fleet time stands still
        self._xids: list[XidEvent] = []  # drawn, not reported yet
        self._signals: list[SignalReport] = []  # host conditions' signals, not reported yet
        self.injections: list[dict[str, Any]] = []  # the ground truth: every fault, in order
        self.forced: Counter[str] = Counter()  # faults injected by `top_up`, not drawn
        self.minimum = 0
        self._checkpoints: list[tuple[float, FaultCategory]] = []  # (fleet seconds, category) due
        self._counted_from: Counter[str] = Counter()
        self._forced_rng = random.Random(seed + 1)  # the drawn faults replay as without a top-up

    def top_up(self, minimum: int, over_fleet_s: float) -> None:
        """Inject at least `minimum` faults of every category of the mix within the next
        `over_fleet_s` of fleet time: each category has a checkpoint, the commonest first and the
        rarest last (evenly spaced, the last at 11/12 of the span for the 11 Llama 3 categories),
        where the faults it is short of since this call are injected (`forced`)."""
        self.minimum = minimum
        categories = sorted(self.model.mix, key=lambda c: -self.model.mix[c])
        self._counted_from = Counter(self.injected)
        self._checkpoints = [
            (self.fleet_seconds + over_fleet_s * (i + 1) / (len(categories) + 1), category)
            for i, category in enumerate(categories)
        ]

    def step(self, dt_s: float) -> list[Fault]:
        """The faults of the next `dt_s` seconds of wall time (`dt_s * time_scale` of fleet time),
        applied to the nodes; the XIDs to report are returned with them."""
        fleet_dt = dt_s * self.time_scale
        start = self.fleet_seconds
        self.fleet_seconds += fleet_dt
        healthy = [node_id for node_id, node in self.nodes.items() if node.hardware_fault is None]
        faults = self.model.next_faults(healthy, fleet_dt, self.rng) if healthy else []
        for fault in faults:
            self._apply(fault, fleet_s=start + fault.offset_s)
        return faults + self._top_up_due()

    def _top_up_due(self) -> list[Fault]:
        """The faults of the categories whose checkpoint has passed short of the minimum."""
        forced: list[Fault] = []
        while self._checkpoints and self._checkpoints[0][0] <= self.fleet_seconds:
            _, category = self._checkpoints.pop(0)
            short = self.minimum - (self.injected[category.value] - self._counted_from[category.value])
            for _ in range(short):
                healthy = [node_id for node_id, node in self.nodes.items() if node.hardware_fault is None]
                if not healthy:
                    return forced
                fault = self.model.manifest(self._forced_rng.choice(healthy), category, 0.0, self._forced_rng)
                self._apply(fault, fleet_s=self.fleet_seconds, forced=True)
                forced.append(fault)
        return forced

    def _apply(self, fault: Fault, *, fleet_s: float | None = None, forced: bool = False) -> None:
        self.injected[fault.category.value] += 1
        if forced:
            self.forced[fault.category.value] += 1
        self.by_node.setdefault(fault.node_id, []).append(fault.category.value)
        node = self.nodes[fault.node_id]
        self.injections.append(
            {
                "node_id": fault.node_id,
                "category": fault.category.value,
                "at": self.clock().isoformat(),  # as its XIDs and signals are stamped
                "fleet_s": self.fleet_seconds if fleet_s is None else fleet_s,
                "xids": list(fault.xids),
                "host_condition": fault.host_condition,
                # It left a hardware fault (what a pull is for); else software, or a node already faulty.
                "hardware": fault.category in FIXED_BY and node.hardware_fault is None,
                "tenant_id": getattr(node, "tenant_id", None),
                "workload_running": bool(getattr(node, "workload_running", False)),
                "forced": forced,
            }
        )
        probe = self.probes.get(node.id) or SimulatedProbe(
            node.id, gpu_count=node.gpu_count, seed=self.rng.randrange(1 << 30), clock=self.clock
        )
        scaled = fault.model_copy(
            update={
                "drifts": tuple(d.model_copy(update={"per_hour": d.per_hour * self.time_scale}) for d in fault.drifts)
            }
        )
        self._xids += probe.apply_fault(scaled)
        if fault.host_condition is not None:
            self._signals.append(host_condition_report(fault, at=self.clock()))
        if fault.category not in FIXED_BY or node.hardware_fault is not None:
            return  # software: its XIDs are all the node shows
        self.probes[node.id] = probe
        shown = fault.host_condition or f"XID {', '.join(map(str, fault.xids))} on GPU {fault.gpu_index}"
        node.hardware_fault = f"{fault.category.value}: {shown}"
        node.fault_fixed_by = FIXED_BY[fault.category]
        self.hardware[fault.category.value] += 1

    def repaired(self) -> list[str]:
        """Nodes whose hardware fault a repair cleared: their GPUs are sound again."""
        fixed = [node_id for node_id in self.probes if self.nodes[node_id].hardware_fault is None]
        for node_id in fixed:
            self.probes.pop(node_id).repair()
        return fixed

    async def _post(self, node_id: str, what: str, send: Callable[..., Awaitable[httpx.Response]]) -> bool:
        """`send` the node's report as its agent would, with its credential (else the operator's)."""
        try:
            answer = await send(credential=self.nodes[node_id].credential or self.operator_token)
        except httpx.HTTPError as exc:
            log.warning("%s of %s not delivered: %s", what, node_id, exc)
            return False
        if answer.status_code >= 400:
            log.warning("%s of %s refused: HTTP %d %s", what, node_id, answer.status_code, answer.text[:200])
        return answer.status_code < 400

    async def report(self, reports: ReportClient) -> None:
        """Post the XIDs drawn since the last report, each node's as its agent would."""
        if self.control_plane_url is None:
            self._xids.clear()
            return
        pending, self._xids = self._xids, []
        by_node: dict[str, list[XidEvent]] = {}
        for event in pending:
            by_node.setdefault(event.node_id, []).append(event)
        for node_id, events in by_node.items():
            if await self._post(node_id, "XID events", functools.partial(reports.events, events)):
                self.xids_reported += len(events)

    async def report_signals(self, reports: ReportClient) -> None:
        """Post the host conditions' signals drawn since the last report, as the node's agent
        posts its `SignalSampler`'s: each node's reports in one batch, by its credential."""
        if self.control_plane_url is None:
            self._signals.clear()
            return
        pending, self._signals = self._signals, []
        by_node: dict[str, list[SignalReport]] = {}
        for signal_report in pending:
            by_node.setdefault(signal_report.node_id, []).append(signal_report)
        for node_id, node_reports in by_node.items():
            if await self._post(node_id, "signal reports", functools.partial(reports.signals, node_reports)):
                self.signals_reported += sum(len(r.observations) for r in node_reports)

    async def push_readings(self, reports: ReportClient) -> None:
        """Each faulty node's counters as its agent reads them (the trend rules' input)."""
        if self.control_plane_url is None:
            return
        for node_id, probe in list(self.probes.items()):
            reading = probe.read()
            if await self._post(node_id, "reading", functools.partial(reports.readings, [reading])):
                self.readings_reported += 1

    async def run(self, *, tick_s: float = 1.0, reading_s: float = 5.0) -> None:
        """Inject and report until cancelled."""
        since_readings = 0.0
        last: float | None = None  # when the last step ended (None: paused, fleet time stands still)
        async with async_http_client(timeout="agent_report", trust=tls.client_verify()) as client:
            reports = ReportClient(client, self.control_plane_url or "")
            while True:
                await asyncio.sleep(tick_s)
                self.repaired()
                if not self.running:
                    last = None
                    continue
                now = time.monotonic()
                # The wall time since the last step, however late this tick came (a busy host).
                self.step(tick_s if last is None else now - last)
                last = now
                await self.report(reports)
                await self.report_signals(reports)
                since_readings += tick_s
                if since_readings >= reading_s:
                    since_readings = 0.0
                    await self.push_readings(reports)

    def summary(self) -> dict:
        """What was injected by category, with the paper's share of each, and the fleet time."""
        total = sum(self.injected.values())
        paper_total = sum(LLAMA3_405B_MIX.values())
        return {
            "running": self.running,
            "fleet_days": self.fleet_seconds / 86_400,
            "injected": total,
            "xids_reported": self.xids_reported,
            "readings_reported": self.readings_reported,
            "signals_reported": self.signals_reported,
            "faulty_nodes": len(self.probes),
            "nodes": self.by_node,
            "minimum_per_category": self.minimum,
            "forced": dict(self.forced),
            "injections": self.injections,
            "by_category": {
                category.value: {
                    "injected": self.injected[category.value],
                    "share": self.injected[category.value] / total if total else 0.0,
                    "paper_share": LLAMA3_405B_MIX[category] / paper_total,
                    "hardware_faults": self.hardware[category.value],
                    "forced": self.forced[category.value],
                }
                for category in FaultCategory
            },
        }


def host_condition_report(fault: Fault, *, at: datetime) -> SignalReport:
    """The signals a host agent would report for `fault`'s host condition, each where a real
    host would see it: InfiniBand signals on the port of the GPU's rail (`mlx5_<gpu>/1`), a NIC's
    on its device, a thermal fault on the GPU, the rest on the node."""
    assert fault.host_condition is not None
    rail = f"mlx5_{fault.gpu_index}"
    where = {
        Signal.IB_LINK_DOWN: f"{rail}/1",
        Signal.IB_LINK_DOWNED: f"{rail}/1",
        Signal.NIC_ERROR: rail,
        Signal.THERMAL: f"gpu{fault.gpu_index}",
    }
    return SignalReport(
        node_id=fault.node_id,
        at=at,
        observations=[
            SignalObservation(
                signal=signal, at=at, source=where.get(signal, ""), detail=f"simulated {fault.host_condition}"
            )
            for signal in HOST_CONDITION_SIGNALS[fault.host_condition]
        ],
    )


def switch_down_reports(nodes: Iterable[Any], *, switch_id: str, at: datetime) -> list[SignalReport]:
    """What each node behind a failed leaf switch reports: every rail's port down (`mlx5_<i>/1`)."""
    return [
        SignalReport(
            node_id=node.id,
            at=at,
            observations=[
                SignalObservation(
                    signal=Signal.IB_LINK_DOWN,
                    at=at,
                    source=f"mlx5_{i}/1",
                    detail=f"simulated: leaf switch {switch_id} down",
                )
                for i in range(node.gpu_count)
            ],
        )
        for node in nodes
    ]


async def post_signal_reports(
    nodes: dict[str, Any], reports: list[SignalReport], *, control_plane_url: str, operator_token: str | None
) -> int:
    """Post each node's reports as its agent would (its credential, else the operator's), one
    request a node; how many nodes' reports the control plane took."""
    taken = 0
    async with async_http_client(timeout="agent_report", trust=tls.client_verify()) as client:
        client_reports = ReportClient(client, control_plane_url)
        for report in reports:
            credential = nodes[report.node_id].credential or operator_token
            try:
                answer = await client_reports.signals([report], credential=credential)
            except httpx.HTTPError as exc:
                log.warning("signal report of %s not delivered: %s", report.node_id, exc)
                continue
            if answer.status_code >= 400:
                log.warning(
                    "signal report of %s refused: HTTP %d %s", report.node_id, answer.status_code, answer.text[:200]
                )
            else:
                taken += 1
    return taken
