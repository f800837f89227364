"""The agent follows the kernel log (`agent/kernel_log.py`): records in `/dev/kmsg`'s format
become `(time, line)` pairs without blocking, continuation lines and what was there before it
started are skipped, and through the sampler a PCIe AER line and a NIC's link down become
signals. A log it may not read is off, not fatal."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpucloud.agent.kernel_log import KernelLog
from gpucloud.agent.signals import SignalSampler
from gpucloud.protocol.reports import Signal

pytestmark = pytest.mark.unit


def _record(seq: int, since_boot_s: float, message: str) -> bytes:
    return f"3,{seq},{int(since_boot_s * 1e6)},-;{message}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:17:00.0\n".encode()


def _now_since_boot() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def test_records_after_the_start_become_timed_lines(tmp_path: Path) -> None:
    log_file = tmp_path / "kmsg"
    log_file.write_bytes(_record(1, 1.0, "mlx5_core 0000:17:00.0 ibp23s0: Link down (an old one)"))
    follow = KernelLog(log_file)
    assert follow() == []  # what was logged before the agent started is not read again

    at = _now_since_boot()
    with log_file.open("ab") as f:
        f.write(_record(2, at, "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:17:00.0"))
        f.write(b"4,3,")  # a record still being written: read next time
    lines = follow()
    assert [line for _, line in lines] == [
        "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:17:00.0"
    ]
    assert abs(lines[0][0] - datetime.now(UTC)) < timedelta(seconds=5)
    with log_file.open("ab") as f:
        f.write(f"{int(at * 1e6)},-;mlx5_core 0000:17:00.0 ibp23s0: Link down\n".encode())
    assert [line for _, line in follow()] == ["mlx5_core 0000:17:00.0 ibp23s0: Link down"]
    assert follow() == []


def test_the_sampler_turns_followed_lines_into_signals(tmp_path: Path) -> None:
    log_file = tmp_path / "kmsg"
    log_file.write_bytes(b"")
    sampler = SignalSampler("node-1", root=tmp_path / "root", kernel_lines=KernelLog(log_file))
    assert sampler.sample() == []
    at = _now_since_boot()
    with log_file.open("ab") as f:
        f.write(_record(1, at, "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:17:00.0"))
        f.write(_record(2, at, "mlx5_core 0000:17:00.0 ibp23s0: Link down"))
        f.write(_record(3, at, "NVRM: Xid (PCI:0000:17:00): 79, pid=1, GPU has fallen off the bus."))
    [report] = sampler.sample()
    signals = [(o.signal, o.source) for o in report.observations]
    assert signals == [(Signal.PCIE_AER_UNCORRECTABLE, "0000:17:00.0"), (Signal.IB_LINK_DOWN, "ibp23s0")]


def test_a_log_it_may_not_read_is_off(tmp_path: Path, caplog) -> None:
    follow = KernelLog(tmp_path / "no-such-log")
    assert follow() == [] and follow() == []
    assert sum("cannot be read" in r.message for r in caplog.records) == 1


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg is not readable here")
def test_the_real_kmsg_is_read_without_blocking() -> None:
    follow = KernelLog()
    started = time.monotonic()
    lines = follow()
    assert time.monotonic() - started < 1.0
    assert all(isinstance(line, str) for _, line in lines)
    follow.close()
