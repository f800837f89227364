"""The probe interface of the host agent: how it sees a node's GPUs.

`read()` every 30-60 s, `wait_events()` in a loop for XIDs as they happen, `close()` at the end.
`NvmlProbe` (`adapters/nvml.py`) reads real GPUs; `SimulatedProbe` (`sim/probe.py`) plays N GPUs
whose counters, XIDs and failures come from the fault model or from a test injecting them, in
the same models with the same semantics, so the health rules cannot tell the two apart.
`detect_probe` is the one place that picks between them; the agent's entrypoint hands it the
simulation it may fall back on (a dev machine), which lives with the simulators above this floor.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from gpucloud.protocol.reports import NodeReading, XidEvent, utc_now


class Probe(Protocol):
    def read(self) -> NodeReading: ...

    def wait_events(self, timeout_s: float) -> list[XidEvent]: ...

    def close(self) -> None: ...


def detect_probe(
    node_id: str,
    *,
    simulated: Callable[[], Probe] | None = None,
    clock: Callable[[], datetime] = utc_now,
) -> Probe:
    """NVML where the library is installed, else `simulated()` when given (a dev machine).

    A node whose NVML loads but whose driver is broken is still a GPU node: it gets the NVML
    probe, which reports the failure as fatal, rather than a simulation that would hide it.
    Without `simulated` a node without NVML gets the NVML probe too, which says it is not a GPU
    node.
    """
    from gpucloud.adapters.nvml import NvmlProbe, ProbeError

    probe = NvmlProbe(node_id, clock=clock)
    try:
        is_gpu_node = probe.read().is_gpu_node
    except ProbeError:
        is_gpu_node = True
    if is_gpu_node or simulated is None:
        return probe
    probe.close()
    return simulated()
