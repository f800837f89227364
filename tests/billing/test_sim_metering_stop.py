"""A simulated node's stop that arrives after its meter passed the stop's moment (the stop's time
is taken before a hop to the metering thread; under load a tick can come in between): the
node's record of what it ran ends where the meter is, so what the agents metered (the ground
truth the billing tests compare the ledger with) never falls short of what was shipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.agent.spool import NodeAllocation
from gpucloud.sim.metering import FleetMetering

pytestmark = pytest.mark.unit

INTERVAL_MS = 2_000


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def _metered_ms(metering: FleetMetering, node_id: str) -> int:
    """GPU-ms in the node's spool (every sample, shipped or not)."""
    spool = metering._node(node_id).spool
    return sum((s.end_ms - s.start_ms) * s.gpu_count for s in spool.pending(limit=1_000, now_ms=10**15))


def test_a_late_stop_ends_the_allocation_where_the_meter_already_is(tmp_path: Path) -> None:
    clock = Clock(1_000_000)
    metering = FleetMetering(tmp_path / "spools", "http://127.0.0.1:9", interval_ms=INTERVAL_MS, clock_ms=clock)
    allocation = NodeAllocation("alloc-1", "tenant-1", "H100", 8, started_ms=clock.now_ms)
    metering.start("n1", allocation)

    clock.now_ms += 3_500  # the release happens here (1_003_500) ...
    stopped_at = clock.now_ms
    clock.now_ms += 700  # ... and a tick passes the 1_004_000 boundary before the stop arrives
    metering._tick_all(clock.now_ms)
    metering.stop("n1", stopped_at)

    (record,) = metering.report()["nodes"]["n1"]["allocations"]
    assert record["ended_ms"] == 1_004_000  # not 1_003_500: the meter had already billed to here
    truth = (record["ended_ms"] - record["started_ms"]) * record["gpu_count"]
    assert truth == _metered_ms(metering, "n1") == 4_000 * 8
    metering.close()


def test_a_stop_in_time_ends_the_allocation_at_its_moment(tmp_path: Path) -> None:
    clock = Clock(1_000_000)
    metering = FleetMetering(tmp_path / "spools", "http://127.0.0.1:9", interval_ms=INTERVAL_MS, clock_ms=clock)
    metering.start("n1", NodeAllocation("alloc-1", "tenant-1", "H100", 8, started_ms=clock.now_ms))

    clock.now_ms += 3_500
    metering.stop("n1", clock.now_ms)

    (record,) = metering.report()["nodes"]["n1"]["allocations"]
    assert record["ended_ms"] == 1_003_500
    assert _metered_ms(metering, "n1") == 3_500 * 8
    metering.close()
