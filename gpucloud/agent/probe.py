"""The probe interface of the host agent: how it sees a node's GPUs.

`read()` every 30-60 s, `wait_events()` in a loop for XIDs as they happen, `close()` at the end.
`NvmlProbe` (`agent/nvml.py`) reads real GPUs; `SimulatedProbe` (`sim/probe.py`) plays N GPUs
whose counters, XIDs and failures come from the fault model or from a test injecting them, in
the same models with the same semantics, so the health rules cannot tell the two apart.
`gpucloud.bootstrap.detect_probe` is the one place that picks between them.
"""

from __future__ import annotations

from typing import Protocol

from gpucloud.protocol.reports import NodeReading, XidEvent


class Probe(Protocol):
    def read(self) -> NodeReading: ...

    def wait_events(self, timeout_s: float) -> list[XidEvent]: ...

    def close(self) -> None: ...
