"""Signals beyond XIDs: the table, thresholds, the application class, kernel log and IB sysfs."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpucloud.health.categories import FaultCategory
from gpucloud.health.signal_sources import (
    IbPortReading,
    ib_port_signals,
    parse_kernel_line,
    parse_kernel_log,
    read_ib_ports,
)
from gpucloud.health.signals import (
    APPLICATION_SIGNALS,
    SIGNAL_TABLE,
    judge_signals,
)
from gpucloud.health.verdict import Action, Health, HealthVerdict
from gpucloud.protocol.reports import Signal, SignalObservation
from gpucloud.sim.faults import MANIFESTATIONS

pytestmark = pytest.mark.unit

T0 = datetime(2025, 1, 1, tzinfo=UTC)
DRAINING = {Action.DRAIN, Action.DRAIN_NOW, Action.RMA}
DOC = Path(__file__).parents[2] / "docs" / "health.md"


def seen(signal: Signal, at: datetime = T0, *, count: int = 1, source: str = "mlx5_0/1", **kw) -> SignalObservation:
    return SignalObservation(signal=signal, at=at, count=count, source=source, **kw)


def verdict(*observations: SignalObservation, now: datetime = T0, **kw) -> HealthVerdict:
    return HealthVerdict.of(judge_signals(observations, now=now, **kw))


# --- the table --------------------------------------------------------------------------------


def test_every_signal_has_a_row_in_a_known_category():
    assert set(SIGNAL_TABLE) == set(Signal)
    for row in SIGNAL_TABLE.values():
        assert isinstance(row.category, FaultCategory)
        assert (row.threshold is None) == (row.window is None)
        assert row.meaning


def test_every_llama3_category_without_an_xid_has_a_signal():
    """The categories the simulator can only show as a host condition are the ones no XID reports."""
    no_xid = {c for c, ways in MANIFESTATIONS.items() if any(m.host_condition for m in ways)}
    assert no_xid >= {FaultCategory.NETWORK, FaultCategory.NIC, FaultCategory.NCCL_WATCHDOG}
    covered = {row.category for row in SIGNAL_TABLE.values()}
    assert no_xid - covered == set()


def test_application_signals_never_drain():
    assert {Signal.WORKLOAD_HANG, Signal.NCCL_TIMEOUT} == APPLICATION_SIGNALS
    for signal in APPLICATION_SIGNALS:
        storm = [seen(signal, T0 + timedelta(minutes=i), count=1000, source=f"rank{i}") for i in range(50)]
        result = verdict(*storm, now=T0 + timedelta(hours=1))
        assert result.action == Action.NONE
        assert result.health == Health.OK
        assert "not acted on" in result.conditions[0].reason


def test_the_doc_lists_every_signal():
    section = DOC.read_text().split("## Signals beyond XIDs", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+) \|$", section, re.MULTILINE))
    assert set(rows) == {s.value for s in Signal}
    for signal, row in SIGNAL_TABLE.items():
        cells = [c.strip() for c in rows[signal.value].split("|")]
        assert cells[:3] == [row.category, row.health, row.action], signal


# --- thresholds ------------------------------------------------------------------------------


def test_symbol_errors_below_the_threshold_are_observed():
    result = verdict(seen(Signal.IB_SYMBOL_ERRORS, count=100))
    assert (result.health, result.action) == (Health.OK, Action.WATCH)
    assert result.conditions[0].name == "ib_symbol_errors"


def test_symbol_errors_above_the_threshold_drain():
    result = verdict(seen(Signal.IB_SYMBOL_ERRORS, count=101))
    assert (result.health, result.action) == (Health.SUSPECT, Action.DRAIN)


def test_a_threshold_counts_within_its_window_and_per_source():
    spread = [seen(Signal.IB_SYMBOL_ERRORS, T0 + timedelta(minutes=70 * i), count=60) for i in range(4)]
    assert verdict(*spread, now=T0 + timedelta(hours=4)).action == Action.WATCH
    close = [seen(Signal.IB_SYMBOL_ERRORS, T0 + timedelta(minutes=20 * i), count=60) for i in range(2)]
    assert verdict(*close, now=T0 + timedelta(hours=1)).action == Action.DRAIN
    two_ports = [seen(Signal.IB_SYMBOL_ERRORS, count=60, source=f"mlx5_{i}/1") for i in range(2)]
    assert verdict(*two_ports).action == Action.WATCH


def test_a_counter_delta_over_a_long_span_counts_pro_rata():
    day = seen(Signal.IB_SYMBOL_ERRORS, count=200, span=timedelta(hours=24))
    assert verdict(day).action == Action.WATCH
    minutes = seen(Signal.IB_SYMBOL_ERRORS, count=200, span=timedelta(minutes=5))
    assert verdict(minutes).action == Action.DRAIN


def test_one_occurrence_acts_without_a_threshold():
    assert verdict(seen(Signal.IB_LINK_DOWN)).action == Action.DRAIN
    assert verdict(seen(Signal.GPU_ROW_REMAP_FAILURE, source="GPU-0")).action == Action.RMA
    result = verdict(seen(Signal.SDC_SUSPECT, source="GPU-3"), seen(Signal.NCCL_TIMEOUT, source="rank0"))
    assert (result.health, result.action) == (Health.FAILED, Action.DRAIN)
    assert [c.name for c in result.conditions] == ["sdc_suspect", "nccl_timeout"]


def test_drain_level_signals_stay_until_cleared_and_watch_level_ones_expire():
    later = T0 + timedelta(days=3)
    assert verdict(seen(Signal.IB_LINK_DOWN), now=later).action == Action.DRAIN
    assert verdict(seen(Signal.IB_LINK_DOWN), now=later, cleared_at=T0 + timedelta(hours=1)).conditions == ()
    assert verdict(seen(Signal.NVRM_ERROR, source=""), now=later).conditions == ()
    assert verdict(seen(Signal.NVRM_ERROR, source=""), now=T0 + timedelta(hours=2)).action == Action.WATCH


def test_a_watch_level_breach_expires_while_later_counts_are_observed():
    old_burst = seen(Signal.IB_RCV_ERRORS, count=500)
    trickle = seen(Signal.IB_RCV_ERRORS, T0 + timedelta(days=2), count=5)
    result = verdict(old_burst, trickle, now=T0 + timedelta(days=2))
    assert (result.health, result.action) == (Health.OK, Action.WATCH)
    assert verdict(old_burst, trickle, now=T0 + timedelta(hours=1)).health == Health.SUSPECT


def test_a_signal_without_a_source_is_the_nodes():
    (condition,) = judge_signals([seen(Signal.HOST_MAINTENANCE, source="")], now=T0)
    assert condition.action in DRAINING
    assert "node" in condition.reason


# --- kernel log ------------------------------------------------------------------------------

AER_LINES = [
    ("pcieport 0000:00:01.0: AER: Corrected error received: 0000:3b:00.0", Signal.PCIE_AER_CORRECTABLE),
    (
        "pcieport 0000:00:01.0: AER: Multiple Corrected error message received from 0000:3b:00.0",
        Signal.PCIE_AER_CORRECTABLE,
    ),
    ("pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0", Signal.PCIE_AER_UNCORRECTABLE),
    (
        "pcieport 0000:00:01.0: AER: Uncorrected (Non-Fatal) error message received from 0000:3b:00.0",
        Signal.PCIE_AER_UNCORRECTABLE,
    ),
]


@pytest.mark.parametrize(("line", "signal"), AER_LINES)
def test_aer_lines(line: str, signal: Signal):
    observation = parse_kernel_line(f"[12345.678901] {line}", at=T0)
    assert observation is not None
    assert (observation.signal, observation.source, observation.at) == (signal, "0000:3b:00.0", T0)


def test_aer_detail_lines_are_not_counted_twice():
    lines = [
        "pcieport 0000:00:01.0: AER: Corrected error received: 0000:3b:00.0",
        "nvidia 0000:3b:00.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
        "nvidia 0000:3b:00.0:   device [10de:2330] error status/mask=00000001/0000e000",
        "nvidia 0000:3b:00.0:    [ 0] RxErr",
    ]
    assert [o.signal for o in parse_kernel_log([(T0, line) for line in lines])] == [Signal.PCIE_AER_CORRECTABLE]


def test_nvrm_xids_go_the_xid_path_and_other_failures_are_signals():
    assert parse_kernel_line("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", at=T0) is None
    assert parse_kernel_line("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15", at=T0) is None
    failed = parse_kernel_line("NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x25:0x65:1472)", at=T0)
    assert failed is not None
    assert (failed.signal, failed.source) == (Signal.NVRM_ERROR, "0000:3b:00.0")
    assertion = parse_kernel_line("NVRM: nvAssertFailedNoLog: Assertion failed: 0 @ rs_server.c:259", at=T0)
    assert assertion is not None and assertion.source == ""


def test_mlx5_link_and_firmware_events():
    down = parse_kernel_line("mlx5_core 0000:0c:00.0 ibp12s0: Link down", at=T0)
    assert down is not None and (down.signal, down.source) == (Signal.IB_LINK_DOWN, "ibp12s0")
    assert parse_kernel_line("mlx5_core 0000:0c:00.0 ibp12s0: Link up", at=T0) is None
    fatal = parse_kernel_line(
        "mlx5_core 0000:0c:00.0: poll_health:835:(pid 0): device's health compromised - reached miss count", at=T0
    )
    assert fatal is not None and (fatal.signal, fatal.source) == (Signal.NIC_ERROR, "0000:0c:00.0")
    module = parse_kernel_line(
        "mlx5_core 0000:0c:00.0: mlx5_port_module_event:1166:(pid 0): Port module event[error]: module 0, "
        "Cable error, High Temperature",
        at=T0,
    )
    assert module is not None and module.signal == Signal.NIC_ERROR
    assert parse_kernel_line("EXT4-fs (nvme0n1p1): mounted filesystem", at=T0) is None


# --- InfiniBand sysfs ------------------------------------------------------------------------


def ib_tree(root: Path, device: str, port: int, *, state: str = "4: ACTIVE", **counters: int) -> None:
    port_dir = root / "sys" / "class" / "infiniband" / device / "ports" / str(port)
    (port_dir / "counters").mkdir(parents=True, exist_ok=True)
    (port_dir / "state").write_text(f"{state}\n")
    for name, value in counters.items():
        (port_dir / "counters" / name).write_text(f"{value}\n")


def test_read_ib_ports_from_a_tree(tmp_path: Path):
    ib_tree(tmp_path, "mlx5_1", 1, state="1: DOWN", link_downed=0, symbol_error=0, port_rcv_errors=0)
    ib_tree(tmp_path, "mlx5_0", 1, link_downed=2, symbol_error=17, port_rcv_errors=3)
    ib_tree(tmp_path, "mlx5_0", 2, symbol_error=5)
    readings = read_ib_ports(tmp_path, at=T0)
    assert [(r.source, r.state) for r in readings] == [
        ("mlx5_0/1", "ACTIVE"),
        ("mlx5_0/2", "ACTIVE"),
        ("mlx5_1/1", "DOWN"),
    ]
    assert readings[0].counters == {"link_downed": 2, "symbol_error": 17, "port_rcv_errors": 3}
    assert readings[1].counters == {"link_downed": None, "symbol_error": 5, "port_rcv_errors": None}


def test_read_ib_ports_without_infiniband(tmp_path: Path):
    assert read_ib_ports(tmp_path, at=T0) == []


def port(at: datetime, *, state: str = "ACTIVE", source: str = "mlx5_0", **counters: int | None) -> IbPortReading:
    return IbPortReading(device=source, port=1, at=at, state=state, counters=counters)


def test_deltas_between_readings():
    later = T0 + timedelta(minutes=10)
    before = [port(T0, link_downed=1, symbol_error=10, port_rcv_errors=0)]
    after = [port(later, link_downed=1, symbol_error=250, port_rcv_errors=4)]
    observations = ib_port_signals(before, after)
    assert [(o.signal, o.count, o.span) for o in observations] == [
        (Signal.IB_SYMBOL_ERRORS, 240, timedelta(minutes=10)),
        (Signal.IB_RCV_ERRORS, 4, timedelta(minutes=10)),
    ]
    assert verdict(*observations, now=later).action == Action.DRAIN


def test_a_counter_reset_counts_from_zero():
    later = T0 + timedelta(minutes=10)
    observations = ib_port_signals([port(T0, symbol_error=5000)], [port(later, symbol_error=3)])
    assert [(o.signal, o.count) for o in observations] == [(Signal.IB_SYMBOL_ERRORS, 3)]
    assert ib_port_signals([port(T0, symbol_error=5000)], [port(later, symbol_error=0)]) == []


def test_a_port_that_goes_down_and_one_never_up():
    later = T0 + timedelta(minutes=1)
    went = ib_port_signals([port(T0)], [port(later, state="DOWN")])
    assert [(o.signal, o.source) for o in went] == [(Signal.IB_LINK_DOWN, "mlx5_0/1")]
    assert ib_port_signals([port(T0, state="DOWN")], [port(later, state="DOWN")]) == []
    assert ib_port_signals([], [port(later, state="DOWN")]) == []
