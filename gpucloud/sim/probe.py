"""A simulated node's GPUs: N GPUs whose counters, XIDs and failures come from the fault model
(`sim/faults.py`) or from a test injecting them, answered in the agent's reading models with the
same semantics as NVML (a lost GPU disappears from the readings, a reset clears volatile
counters), so the health rules cannot tell the two apart.
"""

from __future__ import annotations

import math
import random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpucloud.health.xid import classify_xid
from gpucloud.protocol import reports
from gpucloud.sim.faults import NVLINK_COUNTERS, NVLINKS_PER_GPU, Counter, CounterDrift, Fault, FaultModel

_GPU_IDLE = 0x001


@dataclass
class _SimGpu:
    """One simulated GPU's counters, kept as floats so slow drifts accumulate exactly."""

    index: int
    uuid: str
    links: int
    counters: dict[Counter, float] = field(default_factory=lambda: dict.fromkeys(Counter, 0.0))
    link_counters: list[dict[Counter, float]] = field(init=False)
    aggregate_corrected: float = 0.0
    aggregate_uncorrected: float = 0.0
    remap_pending: bool = False
    remap_failure: bool = False
    clock_event_reasons: int = 0

    def __post_init__(self) -> None:
        self.link_counters = [dict.fromkeys(NVLINK_COUNTERS, 0.0) for _ in range(self.links)]

    def bump(self, counter: Counter, amount: float, link: int) -> None:
        if counter in NVLINK_COUNTERS:
            self.link_counters[link][counter] += amount
            return
        self.counters[counter] += amount
        if counter is Counter.ECC_CORRECTED:
            self.aggregate_corrected += amount
        elif counter is Counter.ECC_UNCORRECTED:
            self.aggregate_uncorrected += amount

    def reset(self) -> None:
        """A GPU reset: volatile counters clear, a pending remap takes effect, links retrain."""
        for counter in (Counter.ECC_CORRECTED, Counter.ECC_UNCORRECTED, Counter.PCIE_REPLAY):
            self.counters[counter] = 0.0
        self.link_counters = [dict.fromkeys(NVLINK_COUNTERS, 0.0) for _ in range(self.links)]
        self.remap_pending = False


class SimulatedProbe:
    """N simulated GPUs on one node, seeded, driven by a fault model and by injection.

    Time comes from `clock`; whenever the probe is asked anything, it first advances to the
    clock's `now`: counter drifts accumulate and, with a `fault_model`, faults are drawn for the
    time that passed. A fleet simulator that draws faults for all nodes at once passes no model
    and routes each drawn fault here with `apply_fault`. Faults NVML cannot see (a NIC, a switch,
    host maintenance) are only collected in `host_conditions`, for the fleet simulator to act on.
    """

    def __init__(
        self,
        node_id: str,
        *,
        gpu_count: int = 8,
        seed: int = 0,
        fault_model: FaultModel | None = None,
        clock: Callable[[], datetime] = reports.utc_now,
        gpu_name: str = "NVIDIA H100 80GB HBM3",
        nvlinks_per_gpu: int = NVLINKS_PER_GPU,
    ):
        self.node_id = node_id
        self._clock = clock
        self._fault_model = fault_model
        # String seeds hash the same in every process, and naming the node gives each node of
        # a fleet sharing one seed its own stream.
        self._fault_rng = random.Random(f"{seed}:{node_id}:faults")
        self._noise_rng = random.Random(f"{seed}:{node_id}:noise")
        self._gpu_name = gpu_name
        self.gpus = [
            _SimGpu(i, f"GPU-{uuid.UUID(int=self._noise_rng.getrandbits(128))}", nvlinks_per_gpu)
            for i in range(gpu_count)
        ]
        self._drifts: list[CounterDrift] = []
        self._events: list[reports.XidEvent] = []
        self._fatal: reports.ProbeFatal | None = None
        self._now = clock()
        self._closed = False
        self._changed = threading.Condition()
        self.host_conditions: set[str] = set()
        self.faults_applied: list[Fault] = []

    def read(self) -> reports.NodeReading:
        with self._changed:
            self._advance(self._clock())
            return reports.NodeReading(
                node_id=self.node_id,
                timestamp=self._now,
                is_gpu_node=True,
                gpus=tuple(self._gpu_reading(gpu) for gpu in self._visible_gpus()),
                fatal_error=self._fatal,
            )

    def wait_events(self, timeout_s: float) -> list[reports.XidEvent]:
        """Queued XIDs at once, else wait up to `timeout_s` for an injection (like NVML blocks)."""
        with self._changed:
            self._advance(self._clock())
            if not self._events and timeout_s > 0 and not self._closed:
                self._changed.wait_for(lambda: self._events or self._closed, timeout=timeout_s)
                self._advance(self._clock())
            events, self._events = self._events, []
            return events

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def inject_xid(self, xid: int, *, gpu_index: int = 0, message: str | None = None) -> reports.XidEvent:
        with self._changed:
            self._advance(self._clock())
            return self._queue_xid(xid, gpu_index, self._now, message)

    def inject_drift(self, drift: CounterDrift) -> None:
        with self._changed:
            self._advance(self._clock())
            self._drifts.append(drift)

    def bump(self, counter: Counter, amount: int = 1, *, gpu_index: int = 0, link: int = 0) -> None:
        with self._changed:
            self._advance(self._clock())
            self.gpus[gpu_index].bump(counter, amount, link)

    def set_fatal(self, kind: reports.FatalKind | None, *, gpu_index: int | None = None, detail: str = "") -> None:
        with self._changed:
            self._fatal = None if kind is None else reports.ProbeFatal(kind=kind, gpu_index=gpu_index, detail=detail)

    def set_clock_event_reasons(self, mask: int, *, gpu_index: int | None = None) -> None:
        """Force clock event reason bits on one GPU or all (e.g. 0x40, hardware thermal slowdown)."""
        with self._changed:
            for gpu in self.gpus if gpu_index is None else [self.gpus[gpu_index]]:
                gpu.clock_event_reasons = mask

    def apply_fault(self, fault: Fault) -> list[reports.XidEvent]:
        """Make a drawn fault happen now; returns the XIDs it queued."""
        with self._changed:
            self._advance(self._clock())
            return self._apply(fault, self._now)

    def reset(self) -> None:
        """A GPU reset or reboot: clears what a reset clears; degrading parts keep drifting."""
        with self._changed:
            self._advance(self._clock())
            self._fatal = None
            for gpu in self.gpus:
                gpu.reset()

    def repair(self) -> None:
        """Hardware reseated or replaced: the drifts and an exhausted remapper go too."""
        with self._changed:
            self._drifts.clear()
            self.host_conditions.clear()
            for gpu in self.gpus:
                gpu.remap_failure = False
        self.reset()

    def _advance(self, now: datetime) -> None:
        if now <= self._now:
            return
        dt_s = (now - self._now).total_seconds()
        start = self._now
        faults = self._fault_model.next_faults([self.node_id], dt_s, self._fault_rng) if self._fault_model else []
        for fault in faults:
            at = start + timedelta(seconds=fault.offset_s)
            self._drift_to(at)
            self._apply(fault, at)
        self._drift_to(now)

    def _drift_to(self, at: datetime) -> None:
        hours = (at - self._now) / timedelta(hours=1)
        for drift in self._drifts:
            self.gpus[drift.gpu_index].bump(drift.counter, drift.per_hour * hours, drift.link)
        self._now = at

    def _apply(self, fault: Fault, at: datetime) -> list[reports.XidEvent]:
        self.faults_applied.append(fault)
        gpu = self.gpus[fault.gpu_index]
        for counter, amount in fault.bumps.items():
            gpu.bump(counter, amount, fault.link)
        gpu.remap_pending = gpu.remap_pending or fault.remap_pending
        gpu.remap_failure = gpu.remap_failure or fault.remap_failure
        self._drifts.extend(fault.drifts)
        if fault.fatal is not None:
            self._fatal = reports.ProbeFatal(
                kind=fault.fatal, gpu_index=fault.gpu_index, detail=f"simulated {fault.category} fault"
            )
        if fault.host_condition is not None:
            self.host_conditions.add(fault.host_condition)
        return [self._queue_xid(xid, fault.gpu_index, at, None) for xid in fault.xids]

    def _queue_xid(self, xid: int, gpu_index: int, at: datetime, message: str | None) -> reports.XidEvent:
        event = reports.XidEvent(
            node_id=self.node_id,
            gpu_index=gpu_index,
            gpu_uuid=self.gpus[gpu_index].uuid,
            xid=xid,
            timestamp=at,
            message=message or f"XID {xid}: {classify_xid(xid).meaning}",
        )
        self._events.append(event)
        self._changed.notify_all()
        return event

    def _visible_gpus(self) -> list[_SimGpu]:
        """What NVML would enumerate: nothing without a driver, and never a GPU that is lost."""
        fatal = self._fatal
        if fatal is not None and fatal.kind in (
            reports.FatalKind.DRIVER_NOT_LOADED,
            reports.FatalKind.DRIVER_MISMATCH,
        ):
            return []
        if fatal is not None and fatal.kind is reports.FatalKind.GPU_LOST:
            return [g for g in self.gpus if g.index != fatal.gpu_index]
        return self.gpus

    def _gpu_reading(self, gpu: _SimGpu) -> reports.GpuReading:
        noise = self._noise_rng.gauss
        return reports.GpuReading(
            index=gpu.index,
            uuid=gpu.uuid,
            name=self._gpu_name,
            # The simulated GPUs idle: no workload runs on them.
            temperature_c=round(32 + noise(0, 0.5)),
            power_w=round(70 + noise(0, 2), 1),
            ecc=reports.EccCounts(
                volatile_corrected=math.floor(gpu.counters[Counter.ECC_CORRECTED]),
                volatile_uncorrected=math.floor(gpu.counters[Counter.ECC_UNCORRECTED]),
                aggregate_corrected=math.floor(gpu.aggregate_corrected),
                aggregate_uncorrected=math.floor(gpu.aggregate_uncorrected),
            ),
            remapped_rows=reports.RemappedRows(
                correctable=math.floor(gpu.counters[Counter.REMAPPED_CORRECTABLE]),
                uncorrectable=math.floor(gpu.counters[Counter.REMAPPED_UNCORRECTABLE]),
                pending=gpu.remap_pending,
                failure=gpu.remap_failure,
            ),
            nvlinks=tuple(self._link_reading(gpu, link) for link in range(gpu.links)),
            pcie_replay=math.floor(gpu.counters[Counter.PCIE_REPLAY]),
            clock_event_reasons=gpu.clock_event_reasons | _GPU_IDLE,
        )

    @staticmethod
    def _link_reading(gpu: _SimGpu, link: int) -> reports.NvLinkReading:
        counters = gpu.link_counters[link]
        return reports.NvLinkReading(
            link=link,
            active=True,
            replay=math.floor(counters[Counter.NVLINK_REPLAY]),
            recovery=math.floor(counters[Counter.NVLINK_RECOVERY]),
            crc_flit=math.floor(counters[Counter.NVLINK_CRC_FLIT]),
            crc_data=math.floor(counters[Counter.NVLINK_CRC_DATA]),
        )
