"""Where non-XID signals come from: kernel log lines and InfiniBand sysfs, parsed into
`SignalObservation`s for `health/signals.py`.

The parsers are pure. The one reader (`read_ib_ports`) takes the filesystem root it reads under
(`/` on a host, a temporary tree in tests) and the moment it reads at; nothing here reads a clock.

Formats, from their sources:

- PCIe AER (`drivers/pci/pcie/aer.c`): `pcieport 0000:00:01.0: AER: Corrected error received:
  0000:3b:00.0` (kernels before 6.x say `error received: <bdf>`, later ones `error message
  received from <bdf>`); severity is `Corrected`, `Uncorrected (Non-Fatal)` or `Uncorrected
  (Fatal)`, with `Multiple ` in front when several were folded into one message. The `PCIe Bus
  Error: severity=...` lines that follow repeat the same error and are not counted again.
- NVRM (the NVIDIA kernel module): `NVRM: Xid (PCI:0000:3b:00): 79, ...` is an XID and goes the
  XID path; other `NVRM:` lines that report a failure (`RmInitAdapter failed`, an assertion, a
  timeout) are `nvrm_error`. Banner lines (`loading NVIDIA UNIX ... Kernel Module`) are not.
- mlx5 (`drivers/net/ethernet/mellanox/mlx5/core`): `mlx5_core <bdf> <ifname>: Link down`, the
  firmware's `health compromised` / `Fatal error` reports and `Port module event[error]`.
- InfiniBand sysfs (`Documentation/ABI/stable/sysfs-class-infiniband`):
  `class/infiniband/<dev>/ports/<n>/state` reads `4: ACTIVE`; `counters/link_downed`,
  `counters/symbol_error` and `counters/port_rcv_errors` are counters that a reset (driver
  reload, `perfquery -R`) takes back to zero.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from pydantic import AwareDatetime, BaseModel, ConfigDict

from gpucloud.health.trends import counter_growth
from gpucloud.protocol.reports import Signal, SignalObservation

_AER = re.compile(
    r"AER: (?P<multiple>Multiple )?"
    r"(?P<severity>Corrected|Uncorrected \((?:Non-)?Fatal\)) error (?:message )?received(?::| from) "
    r"(?:id=)?(?P<device>\S+)"
)
_NVRM_XID = re.compile(r"NVRM: Xid \(")
_NVRM = re.compile(r"NVRM: (?P<message>.*)")
_NVRM_FAILURE = re.compile(r"fail|error|assert|timeout|timed out|fallen off|crash", re.IGNORECASE)
_PCI_ADDRESS = re.compile(r"(?:PCI:)?(?P<bdf>[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}(?:\.[0-7])?)")
_MLX5 = re.compile(r"mlx5_core (?P<bdf>[0-9a-f:.]+)(?: (?P<ifname>[\w.-]+))?: (?P<message>.*)")
_MLX5_LINK_DOWN = re.compile(r"\bLink down\b")
_MLX5_NIC_ERROR = re.compile(r"health compromised|Fatal error|Port module event\[error\]")


def parse_kernel_line(line: str, *, at: datetime) -> SignalObservation | None:
    """The signal a kernel log line reports, or None (an XID, a banner, a line about nothing)."""
    if match := _AER.search(line):
        uncorrectable = match["severity"].startswith("Uncorrected")
        return SignalObservation(
            signal=Signal.PCIE_AER_UNCORRECTABLE if uncorrectable else Signal.PCIE_AER_CORRECTABLE,
            at=at,
            source=match["device"],
            detail=f"{match['multiple'] or ''}{match['severity']}".strip(),
        )
    if _NVRM_XID.search(line):
        return None
    if (match := _NVRM.search(line)) and _NVRM_FAILURE.search(match["message"]):
        address = _PCI_ADDRESS.search(match["message"])
        return SignalObservation(
            signal=Signal.NVRM_ERROR, at=at, source=address["bdf"] if address else "", detail=match["message"].strip()
        )
    if match := _MLX5.search(line):
        source = match["ifname"] or match["bdf"]
        if _MLX5_LINK_DOWN.search(match["message"]):
            return SignalObservation(signal=Signal.IB_LINK_DOWN, at=at, source=source, detail=match["message"])
        if _MLX5_NIC_ERROR.search(match["message"]):
            return SignalObservation(signal=Signal.NIC_ERROR, at=at, source=source, detail=match["message"])
    return None


def parse_kernel_log(lines: Sequence[tuple[datetime, str]]) -> list[SignalObservation]:
    return [o for at, line in lines if (o := parse_kernel_line(line, at=at)) is not None]


_ACTIVE = "ACTIVE"
_COUNTERS = {
    "link_downed": Signal.IB_LINK_DOWNED,
    "symbol_error": Signal.IB_SYMBOL_ERRORS,
    "port_rcv_errors": Signal.IB_RCV_ERRORS,
}


class IbPortReading(BaseModel):
    """One InfiniBand port as sysfs showed it at `at`; a counter sysfs lacks is None."""

    model_config = ConfigDict(frozen=True)

    device: str
    port: int
    at: AwareDatetime
    state: str
    counters: dict[str, int | None]

    @property
    def source(self) -> str:
        return f"{self.device}/{self.port}"


def read_ib_ports(root: Path, *, at: datetime) -> list[IbPortReading]:
    """Every port under `<root>/sys/class/infiniband`, sorted; none on a host without IB."""
    base = root / "sys" / "class" / "infiniband"
    if not base.is_dir():
        return []
    readings = []
    for port_dir in sorted(base.glob("*/ports/*")):
        if not port_dir.name.isdigit():
            continue
        readings.append(
            IbPortReading(
                device=port_dir.parent.parent.name,
                port=int(port_dir.name),
                at=at,
                state=_state_name(_read(port_dir / "state")),
                counters={name: _counter(port_dir / "counters" / name) for name in _COUNTERS},
            )
        )
    return sorted(readings, key=lambda r: (r.device, r.port))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _state_name(text: str | None) -> str:
    """`4: ACTIVE` → `ACTIVE`; unreadable → `UNKNOWN`."""
    if not text:
        return "UNKNOWN"
    return text.split(":", 1)[-1].strip()


def _counter(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.isdigit() else None


def ib_port_signals(before: Sequence[IbPortReading], after: Sequence[IbPortReading]) -> list[SignalObservation]:
    """What changed between two readings: ports that were active and are not, and counter growth.

    A counter lower than before was reset and counts from zero, as in `health/trends.py`. A port
    not active in `before` (an unused port, one not yet trained) raises no link-down.
    """
    previous = {r.source: r for r in before}
    observations = []
    for reading in after:
        old = previous.get(reading.source)
        if old is None:
            continue
        if old.state == _ACTIVE and reading.state != _ACTIVE:
            observations.append(
                SignalObservation(
                    signal=Signal.IB_LINK_DOWN, at=reading.at, source=reading.source, detail=f"state {reading.state}"
                )
            )
        for name, signal in _COUNTERS.items():
            growth = counter_growth([(old.at, old.counters.get(name)), (reading.at, reading.counters.get(name))])
            if growth.total > 0:
                observations.append(
                    SignalObservation(
                        signal=signal,
                        at=reading.at,
                        source=reading.source,
                        count=growth.total,
                        span=reading.at - old.at,
                        detail=name,
                    )
                )
    return observations
