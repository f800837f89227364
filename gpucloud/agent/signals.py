"""The agent's sampler of the signals beyond XIDs: InfiniBand sysfs and the kernel log, turned
into `SignalReport`s for the control plane to judge (`health/signals.py`).

Each `sample()` reads the IB ports under the host root and compares them with the previous
reading (`ib_port_signals`: ports that left ACTIVE, counter growth), and parses the kernel log
lines that arrived since the last call (`parse_kernel_log`). The first sample only sets the
baseline for the ports: a port already down when the agent starts raises nothing.

The kernel log comes from a callable that returns, without blocking, the `(time, line)` pairs
read since its last call. Following the log (`journalctl -k -f -o short-iso`, or `/dev/kmsg`)
is its caller's job; this module starts no process and reads no clock but the one it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from gpucloud.health.signal_sources import IbPortReading, ib_port_signals, parse_kernel_line, read_ib_ports
from gpucloud.protocol.reports import AGENT_MAX_EVENTS, SignalObservation, SignalReport, utc_now

log = logging.getLogger(__name__)

KernelLines = Callable[[], Iterable[tuple[datetime, str]]]


def no_kernel_lines() -> list[tuple[datetime, str]]:
    return []


class SignalSampler:
    """Samples one node's signals; keeps the previous IB reading between calls."""

    def __init__(
        self,
        node_id: str,
        *,
        root: Path = Path("/"),
        kernel_lines: KernelLines = no_kernel_lines,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.node_id = node_id
        self._root = root
        self._kernel_lines = kernel_lines
        self._clock = clock
        self._ports: list[IbPortReading] | None = None

    def sample(self) -> list[SignalReport]:
        """What changed since the last call, in reports of at most `AGENT_MAX_EVENTS`
        observations each; none when nothing did."""
        at = self._clock()
        observations = self._kernel_observations()
        ports = read_ib_ports(self._root, at=at)
        if self._ports is not None:
            observations.extend(ib_port_signals(self._ports, ports))
        self._ports = ports
        return [
            SignalReport(node_id=self.node_id, at=at, observations=observations[start : start + AGENT_MAX_EVENTS])
            for start in range(0, len(observations), AGENT_MAX_EVENTS)
        ]

    def _kernel_observations(self) -> list[SignalObservation]:
        # Anyone with root on the node can write to the kernel log: a line whose fields break the
        # wire's bounds is dropped (and logged), not allowed to stop the sampling.
        observations = []
        for at, line in self._kernel_lines():
            try:
                observation = parse_kernel_line(line, at=at)
            except ValidationError:
                log.warning("kernel log line dropped: a field is out of the protocol's bounds: %.200s", line)
                continue
            if observation is not None:
                observations.append(observation)
        return observations
