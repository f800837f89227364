"""The agent's signal sampler over a temporary sysfs tree and fixture kernel log lines, and the
`SignalReport` it sends."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpucloud.agent.signals import SignalSampler
from gpucloud.protocol.reports import AGENT_MAX_EVENTS, Signal, SignalObservation, SignalReport

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=UTC)
MINUTE = timedelta(minutes=1)

AER = "pcieport 0000:00:01.0: AER: Corrected error received: 0000:3b:00.0"
LINK_DOWN = "mlx5_core 0000:0c:00.0 ibp12s0: Link down"
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
MOUNT = "EXT4-fs (nvme0n1p1): mounted filesystem"


def ib_port(root: Path, device: str, port: int, *, state: str = "4: ACTIVE", **counters: int) -> None:
    port_dir = root / "sys" / "class" / "infiniband" / device / "ports" / str(port)
    (port_dir / "counters").mkdir(parents=True, exist_ok=True)
    (port_dir / "state").write_text(f"{state}\n")
    for name, value in counters.items():
        (port_dir / "counters" / name).write_text(f"{value}\n")


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


class KernelLog:
    """Lines appended by the test; each call hands over what arrived since the last one."""

    def __init__(self) -> None:
        self.pending: list[tuple[datetime, str]] = []

    def __call__(self) -> Iterator[tuple[datetime, str]]:
        lines, self.pending = self.pending, []
        return iter(lines)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_the_first_sample_sets_the_ports_baseline_and_the_next_reports_growth(tmp_path: Path, clock: Clock):
    ib_port(tmp_path, "mlx5_0", 1, link_downed=1, symbol_error=40, port_rcv_errors=0)
    sampler = SignalSampler("n-1", root=tmp_path, clock=clock)
    assert sampler.sample() == []

    ib_port(tmp_path, "mlx5_0", 1, link_downed=1, symbol_error=140, port_rcv_errors=0)
    clock.now = T0 + MINUTE
    [report] = sampler.sample()
    assert (report.node_id, report.at) == ("n-1", T0 + MINUTE)
    [grew] = report.observations
    assert (grew.signal, grew.source, grew.count, grew.span) == (Signal.IB_SYMBOL_ERRORS, "mlx5_0/1", 100, MINUTE)

    clock.now = T0 + 2 * MINUTE
    assert sampler.sample() == [], "the reading just taken is the new baseline"


def test_a_port_that_leaves_active_is_a_link_down(tmp_path: Path, clock: Clock):
    ib_port(tmp_path, "mlx5_0", 1)
    ib_port(tmp_path, "mlx5_1", 1, state="1: DOWN")
    sampler = SignalSampler("n-1", root=tmp_path, clock=clock)
    sampler.sample()
    ib_port(tmp_path, "mlx5_0", 1, state="1: DOWN")
    [report] = sampler.sample()
    assert [(o.signal, o.source) for o in report.observations] == [(Signal.IB_LINK_DOWN, "mlx5_0/1")]


def test_kernel_lines_are_read_once_and_only_signals_kept(tmp_path: Path, clock: Clock):
    kernel = KernelLog()
    sampler = SignalSampler("n-1", root=tmp_path, kernel_lines=kernel, clock=clock)
    kernel.pending = [(T0, AER), (T0, XID), (T0, MOUNT), (T0 + MINUTE, LINK_DOWN)]
    [report] = sampler.sample()
    assert [(o.signal, o.source, o.at) for o in report.observations] == [
        (Signal.PCIE_AER_CORRECTABLE, "0000:3b:00.0", T0),
        (Signal.IB_LINK_DOWN, "ibp12s0", T0 + MINUTE),
    ]
    assert sampler.sample() == []


def test_a_host_without_infiniband_or_kernel_source_reports_nothing(tmp_path: Path, clock: Clock):
    sampler = SignalSampler("n-1", root=tmp_path, clock=clock)
    assert sampler.sample() == sampler.sample() == []


def test_a_line_out_of_the_wires_bounds_is_dropped_not_fatal(tmp_path: Path, clock: Clock):
    kernel = KernelLog()
    forged = f"pcieport 0000:00:01.0: AER: Corrected error received: {'x' * 500}"
    kernel.pending = [(T0, forged), (T0, AER)]
    [report] = SignalSampler("n-1", root=tmp_path, kernel_lines=kernel, clock=clock).sample()
    assert [o.source for o in report.observations] == ["0000:3b:00.0"]


def test_a_flood_is_split_into_reports_the_wire_accepts(tmp_path: Path, clock: Clock):
    kernel = KernelLog()
    kernel.pending = [(T0, AER)] * (AGENT_MAX_EVENTS + 1)
    reports = SignalSampler("n-1", root=tmp_path, kernel_lines=kernel, clock=clock).sample()
    assert [len(r.observations) for r in reports] == [AGENT_MAX_EVENTS, 1]


def test_a_report_survives_the_wire_and_refuses_what_is_out_of_bounds():
    seen = SignalObservation(signal=Signal.IB_SYMBOL_ERRORS, at=T0, source="mlx5_0/1", count=7, span=MINUTE)
    report = SignalReport(node_id="n-1", at=T0, observations=[seen])
    assert SignalReport.model_validate_json(report.model_dump_json()) == report
    with pytest.raises(ValidationError):
        SignalReport(node_id="n-1", at=T0, observations=[])
    with pytest.raises(ValidationError):
        SignalObservation(signal=Signal.THERMAL, at=T0, source="x" * 129)
    with pytest.raises(ValidationError):
        SignalObservation(signal=Signal.THERMAL, at=T0, span=-MINUTE)
