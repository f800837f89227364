"""Issue 42: MTBF, MTTR and MTTS per GPU type, region and rack, and rolled up per pool
(`health/reliability.py`), on hand-computed numbers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpucloud.health.reliability import ROLLUP_RACK, IncidentTimes, reliability

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
START = NOW - timedelta(days=30)
H, M, D = timedelta(hours=1), timedelta(minutes=1), timedelta(days=1)


def _incident(
    rack: str,
    detected_at: datetime,
    *,
    status: str = "resolved",
    kind: str = "node",
    pulled: timedelta | None = M,
    stabilized: timedelta | None = None,
    gated: timedelta | None = None,
    gpu_type: str = "H100",
    region: str = "r1",
) -> IncidentTimes:
    return IncidentTimes(
        gpu_type=gpu_type,
        region=region,
        rack=rack,
        kind=kind,
        status=status,
        detected_at=detected_at,
        pulled_at=detected_at + pulled if pulled is not None else None,
        stabilized_at=detected_at + stabilized if stabilized is not None else None,
        gated_at=detected_at + gated if gated is not None else None,
    )


HOURS = {("H100", "r1", "a"): 7_200.0, ("H100", "r1", "b"): 3_600.0, ("A100", "r2", "c"): 1_000.0}
INCIDENTS = [
    # Rack a: three failures; two gated (6 h and 2 h), three stabilized (30, 10 and 20 minutes).
    _incident("a", NOW - 10 * D, stabilized=30 * M, gated=6 * H),
    _incident("a", NOW - 5 * D, stabilized=10 * M, gated=2 * H),
    _incident("a", NOW - 3 * D, status="rma", stabilized=20 * M),  # never repaired: no MTTR
    # Rack b: detected (and stabilized) before the window, gated within it two days after the fault.
    _incident("b", START - D, stabilized=H, gated=2 * D),
    _incident("b", NOW - 2 * D, status="abandoned", pulled=None),  # never pulled: no failure
    _incident("b", NOW - D, kind="fleet", stabilized=M),  # a fleet incident: not a node's
    _incident("b", NOW - H, status="open", stabilized=None),  # open, pulled: a failure
    # Abandoned after the pull: a failure; stabilized "before" the fault by the node's clock skew: 0 s.
    _incident("b", NOW - 20 * D, status="abandoned", stabilized=-2 * M),
    # Out of the window: at its start (the window is (start, now]), after now.
    _incident("a", START, status="open"),
    _incident("a", NOW + M, stabilized=M, gated=H),
]


def _by_place():
    rows = reliability(HOURS, INCIDENTS, start=START, now=NOW)
    return rows, {(r.gpu_type, r.region, r.rack): r for r in rows}


def test_each_racks_mtbf_mttr_and_mtts() -> None:
    _, rows = _by_place()
    a = rows[("H100", "r1", "a")]
    assert (a.node_hours, a.failures, a.repairs, a.stabilizations) == (7_200.0, 3, 2, 3)
    assert a.mtbf_h == pytest.approx(2_400.0)  # 7,200 / 3
    assert a.mttr_s == pytest.approx(14_400.0)  # (21,600 + 7,200) / 2
    assert a.mtts_s == pytest.approx(1_200.0)  # (1,800 + 600 + 1,200) / 3
    b = rows[("H100", "r1", "b")]
    assert (b.node_hours, b.failures, b.repairs, b.stabilizations) == (3_600.0, 2, 1, 1)
    assert b.mtbf_h == pytest.approx(1_800.0)  # 3,600 / 2
    assert b.mttr_s == pytest.approx(172_800.0)  # the repair gated within the window, fault before it
    assert b.mtts_s == 0.0  # a negative duration (clock skew) counts as zero


def test_a_rack_without_failures_or_repairs_has_no_mtbf_or_mttr() -> None:
    _, rows = _by_place()
    c = rows[("A100", "r2", "c")]
    assert (c.node_hours, c.failures, c.repairs) == (1_000.0, 0, 0)
    assert (c.mtbf_h, c.mttr_s, c.mtts_s) == (None, None, None)


def test_the_pool_rollup_sums_its_racks_and_averages_all_their_incidents() -> None:
    _, rows = _by_place()
    pool = rows[("H100", "r1", ROLLUP_RACK)]
    assert (pool.node_hours, pool.failures, pool.repairs, pool.stabilizations) == (10_800.0, 5, 3, 4)
    assert pool.mtbf_h == pytest.approx(2_160.0)  # 10,800 / 5
    assert pool.mttr_s == pytest.approx(67_200.0)  # (21,600 + 7,200 + 172,800) / 3, not the racks' mean
    assert pool.mtts_s == pytest.approx(900.0)  # (1,800 + 600 + 1,200 + 0) / 4
    other = rows[("A100", "r2", ROLLUP_RACK)]
    assert (other.node_hours, other.failures, other.mtbf_h) == (1_000.0, 0, None)


def test_racks_come_first_then_the_rollups_each_sorted() -> None:
    ordered, _ = _by_place()
    assert [(r.gpu_type, r.region, r.rack) for r in ordered] == [
        ("A100", "r2", "c"),
        ("H100", "r1", "a"),
        ("H100", "r1", "b"),
        ("A100", "r2", ROLLUP_RACK),
        ("H100", "r1", ROLLUP_RACK),
    ]


def test_a_rack_shows_for_an_incident_alone_and_nothing_for_nothing() -> None:
    rows = reliability({}, [_incident("z", NOW - D, stabilized=M, gated=H)], start=START, now=NOW)
    assert [(r.rack, r.failures, r.mttr_s) for r in rows] == [("z", 1, 3_600.0), (ROLLUP_RACK, 1, 3_600.0)]
    assert reliability({}, [], start=START, now=NOW) == []
