"""Issue 42: the MTBF, MTTR and MTTS gauges per GPU type, region and rack (and `rack=""` per
pool) that the spares check sets from the fleet's node-hours and incidents
(`services/reliability.py`), on a SQLite database of the test's own."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY
from sqlmodel import col, select

from gpucloud.activities.reconciler import ReconcilerActivities
from gpucloud.config import Settings
from gpucloud.db import Database, migrate, session_scope
from gpucloud.health.reliability import ROLLUP_RACK
from gpucloud.models.health_tables import Incident
from gpucloud.models.messages import SweepResult
from gpucloud.models.tables import Node, new_id, utcnow
from gpucloud.services import reliability, spares
from support.nodes import enroll

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
GPU, REGION = "B200", "rel1"  # labels no other test sets
H, M = timedelta(hours=1), timedelta(minutes=1)


@pytest.fixture
def db_url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'reliability.db'}"
    migrate(url)
    return url


def _nodes(db_url: str, prefix: str, count: int, *, rack: str, now: datetime = NOW) -> list[str]:
    ids = enroll(db_url, [f"{prefix}-{i:03d}" for i in range(count)], gpu_type=GPU, region=REGION, rack=rack)
    with session_scope(db_url) as session:
        for node in session.exec(select(Node).where(col(Node.id).in_(ids))).all():
            node.state, node.created_at, node.state_entered_at = "active", now - 60 * 24 * H, now - 60 * 24 * H
            session.add(node)
    return ids


def _incident(
    db_url: str,
    node_id: str,
    detected_at: datetime,
    *,
    status: str = "resolved",
    stabilized: timedelta | None = None,
    gated: timedelta | None = None,
) -> None:
    incident_id = new_id("inc")
    with session_scope(db_url) as session:
        session.add(
            Incident(
                id=incident_id,
                workflow_id=f"incident-{incident_id}",
                status=status,
                node_id=node_id,
                node_ids=[node_id],
                detected_at=detected_at,
                pulled_at=detected_at + M,
                stabilized_at=detected_at + stabilized if stabilized is not None else None,
                gated_at=detected_at + gated if gated is not None else None,
            )
        )


def _gauge(family: str, rack: str) -> float | None:
    return REGISTRY.get_sample_value(family, {"gpu_type": GPU, "region": REGION, "rack": rack})


def _fleet(db_url: str, now: datetime = NOW) -> None:
    ra = _nodes(db_url, "ra", 10, rack="ra", now=now)  # 10 × 720 = 7,200 node-hours in the 30 days
    rb = _nodes(db_url, "rb", 4, rack="rb", now=now)  # 2,880
    _incident(db_url, ra[0], now - 10 * 24 * H, stabilized=30 * M, gated=6 * H)
    _incident(db_url, ra[1], now - 5 * 24 * H, stabilized=10 * M, gated=2 * H)
    _incident(db_url, rb[0], now - H, status="open")  # pulled, not yet stabilized


def test_a_spares_check_sets_each_rack_and_pools_gauges(db_url) -> None:
    _fleet(db_url)
    with session_scope(db_url) as session:
        check = spares.check_spares(session, now=NOW)
    (pool,) = [p for p in check.spares.pools if p.gpu_type == GPU]
    assert pool.failures == 3 and pool.node_hours == pytest.approx(10_080.0)  # the same record
    assert _gauge("gpucloud_mtbf_hours", "ra") == pytest.approx(3_600.0)  # 7,200 / 2
    assert _gauge("gpucloud_mtbf_hours", "rb") == pytest.approx(2_880.0)  # 2,880 / 1
    assert _gauge("gpucloud_mtbf_hours", ROLLUP_RACK) == pytest.approx(3_360.0)  # 10,080 / 3
    assert _gauge("gpucloud_mttr_seconds", "ra") == pytest.approx(14_400.0)  # (6 h + 2 h) / 2
    assert _gauge("gpucloud_mttr_seconds", "rb") is None  # nothing gated there
    assert _gauge("gpucloud_mttr_seconds", ROLLUP_RACK) == pytest.approx(14_400.0)
    assert _gauge("gpucloud_mtts_seconds", "ra") == pytest.approx(1_200.0)  # (30 min + 10 min) / 2
    assert _gauge("gpucloud_mtts_seconds", "rb") is None

    with session_scope(db_url) as session:  # the record emptied: the series go, none kept stale
        session.execute(Incident.__table__.delete())  # type: ignore[attr-defined]
        spares.check_spares(session, now=NOW)
    for family in ("gpucloud_mtbf_hours", "gpucloud_mttr_seconds", "gpucloud_mtts_seconds"):
        assert [_gauge(family, rack) for rack in ("ra", "rb", ROLLUP_RACK)] == [None, None, None]


def test_fleet_reliability_reads_what_the_gauges_show(db_url) -> None:
    _fleet(db_url)
    with session_scope(db_url) as session:
        rows = reliability.fleet_reliability(session, start=NOW - 30 * 24 * H, now=NOW)
    by_rack = {r.rack: r for r in rows if r.gpu_type == GPU}
    assert set(by_rack) == {"ra", "rb", ROLLUP_RACK}
    assert (by_rack[ROLLUP_RACK].failures, by_rack[ROLLUP_RACK].repairs) == (3, 2)
    assert by_rack["rb"].mtbf_h == pytest.approx(2_880.0)


def test_the_reconcilers_throttled_spares_check_sets_them(db_url, tmp_path) -> None:
    now = utcnow()
    _fleet(db_url, now=now)
    settings = Settings(data_dir=tmp_path, health={"spares_check_interval_s": 3600})
    activities = ReconcilerActivities(client=None, db=Database(db_url), settings=settings)  # type: ignore[arg-type]
    result = SweepResult()
    asyncio.run(activities._check_spares_if_due(result))
    assert result.errors == []
    assert _gauge("gpucloud_mtbf_hours", ROLLUP_RACK) == pytest.approx(3_360.0, rel=1e-3)
    assert _gauge("gpucloud_mttr_seconds", "ra") == pytest.approx(14_400.0)
