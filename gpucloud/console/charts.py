"""A node's readings as charts over time, drawn on the server as inline SVG (no script, no chart
library): ECC errors, GPU temperature, NVLink errors and PCIe replays, from the readings its
agent posted (`POST /v1/agents/readings`, kept in `node_reading`, read through the service of
`GET /v1/nodes/{id}/health`). Each chart says in words what it shows (its title and description,
and a line of text under it), and each series has a dash pattern of its own as well as a colour.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from gpucloud.protocol.reports import GpuReading, NodeReading

WIDTH, HEIGHT = 420, 140
LEFT, RIGHT, TOP, BOTTOM = 44, 8, 10, 22
# (stroke colour, dash pattern): told apart without colour too.
STYLES = (("#0550ae", ""), ("#a40e26", "6 3"), ("#1a7f37", "2 2"))


@dataclass(frozen=True)
class Series:
    name: str
    values: list[float | None]
    colour: str
    dash: str
    points: str

    @property
    def latest(self) -> float | None:
        return next((v for v in reversed(self.values) if v is not None), None)

    @property
    def peak(self) -> float | None:
        present = [v for v in self.values if v is not None]
        return max(present) if present else None


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    unit: str
    series: list[Series]
    y_max: float
    y_min: float
    first: datetime | None
    last: datetime | None
    count: int
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def summary(self) -> str:
        if not self.count:
            return "no readings yet"
        parts = [
            f"{s.name}: latest {_num(s.latest)}{self.unit}, highest {_num(s.peak)}{self.unit}" for s in self.series
        ]
        span = f"{self.count} readings, {self.first:%H:%M:%S} to {self.last:%H:%M:%S} UTC" if self.first else ""
        return "; ".join(parts) + (f" ({span})" if span else "")


def _num(value: float | None) -> str:
    if value is None:
        return "none"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _total(gpus: Sequence[GpuReading], value: Callable[[GpuReading], int | None]) -> float | None:
    present = [v for v in (value(g) for g in gpus) if v is not None]
    return float(sum(present)) if present else None


def _nvlink_errors(gpu: GpuReading) -> int | None:
    counts = [
        c for link in gpu.nvlinks if link.active for c in (link.replay, link.recovery, link.crc_flit, link.crc_data)
    ]
    present = [c for c in counts if c is not None]
    return sum(present) if present else None


# What each chart plots: (key, title, unit, [(series name, value of one reading)]).
METRICS: list[tuple[str, str, str, list[tuple[str, Callable[[NodeReading], float | None]]]]] = [
    (
        "temperature",
        "GPU temperature",
        " °C",
        [
            (
                "hottest GPU",
                lambda r: max((g.temperature_c for g in r.gpus if g.temperature_c is not None), default=None),
            ),
        ],
    ),
    (
        "ecc",
        "ECC errors (volatile, all GPUs)",
        "",
        [
            ("corrected", lambda r: _total(r.gpus, lambda g: g.ecc.volatile_corrected)),
            ("uncorrected", lambda r: _total(r.gpus, lambda g: g.ecc.volatile_uncorrected)),
        ],
    ),
    (
        "nvlink",
        "NVLink errors and inactive links",
        "",
        [
            ("errors (replay, recovery, CRC)", lambda r: _total(r.gpus, _nvlink_errors)),
            ("inactive links", lambda r: float(sum(1 for g in r.gpus for link in g.nvlinks if not link.active))),
        ],
    ),
    ("pcie", "PCIe replays (all GPUs)", "", [("replays", lambda r: _total(r.gpus, lambda g: g.pcie_replay))]),
]


def charts(readings: Sequence[NodeReading]) -> list[Chart]:
    """One chart per metric over `readings` (any order; drawn oldest to newest)."""
    ordered = sorted(readings, key=lambda r: r.timestamp)
    first = ordered[0].timestamp if ordered else None
    last = ordered[-1].timestamp if ordered else None
    span = (last - first).total_seconds() if first and last else 0.0
    xs = [
        LEFT + ((r.timestamp - first).total_seconds() / span if span and first else 0.5) * (WIDTH - LEFT - RIGHT)
        for r in ordered
    ]
    out = []
    for key, title, unit, metrics in METRICS:
        values = [[value(r) for r in ordered] for _, value in metrics]
        present = [v for column in values for v in column if v is not None]
        y_min = min(0.0, *present) if present else 0.0
        y_max = max(present) if present else 1.0
        if y_max <= y_min:
            y_max = y_min + 1.0
        series = []
        for i, ((name, _), column) in enumerate(zip(metrics, values, strict=True)):
            colour, dash = STYLES[i % len(STYLES)]
            points = " ".join(
                f"{x:.1f},{_y(v, y_min, y_max):.1f}" for x, v in zip(xs, column, strict=True) if v is not None
            )
            series.append(Series(name=name, values=column, colour=colour, dash=dash, points=points))
        out.append(Chart(key, title, unit, series, y_max, y_min, first, last, len(ordered)))
    return out


def _y(value: float, y_min: float, y_max: float) -> float:
    return TOP + (1 - (value - y_min) / (y_max - y_min)) * (HEIGHT - TOP - BOTTOM)
