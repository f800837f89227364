"""Issue 42: spare capacity per pool from the fleet's own record (`services/spares.py`), on a
SQLite database of the test's own: the nodes, node-hours and failures counted over the window,
the rate measured once there are enough node-hours and the Llama 3 default before, the spares
held, and one operator alert per pool short of spares until it recovers."""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY
from sqlmodel import col, select

from gpucloud.activities.reconciler import ReconcilerActivities
from gpucloud.config import Settings
from gpucloud.db import Database, migrate, session_scope
from gpucloud.health.spares import LLAMA3_405B_FAILURES_PER_NODE_HOUR, estimate_failure_rate, plan_spares
from gpucloud.models.health_tables import Incident, OperatorAlertRecord
from gpucloud.models.messages import SweepResult
from gpucloud.models.tables import Node, new_id
from gpucloud.services import spares
from support.nodes import enroll

pytestmark = pytest.mark.unit

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
POOL = "H100/r1"


@pytest.fixture
def db_url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'spares.db'}"
    migrate(url)
    return url


def _nodes(db_url: str, prefix: str, count: int, *, age: timedelta, state: str = "active", **fields) -> list[str]:
    ids = enroll(db_url, [f"{prefix}-{i:03d}" for i in range(count)], **fields)
    with session_scope(db_url) as session:
        for node in session.exec(select(Node).where(col(Node.id).in_(ids))).all():
            node.state, node.created_at, node.state_entered_at = state, NOW - age, NOW - age
            session.add(node)
    return ids


def _set(db_url: str, node_id: str, **values) -> None:
    with session_scope(db_url) as session:
        node = session.get(Node, node_id)
        assert node is not None
        for name, value in values.items():
            setattr(node, name, value)
        session.add(node)


def _incidents(
    db_url: str, node_ids: list[str], *, ago: timedelta, kind: str = "node", status: str = "resolved", pulled=True
) -> None:
    """An incident per node, detected `ago` (pulled a minute later unless `pulled` is false)."""
    at = NOW - ago
    with session_scope(db_url) as session:
        for node_id in node_ids:
            incident_id = new_id("inc")
            session.add(
                Incident(
                    id=incident_id,
                    workflow_id=f"incident-{incident_id}",
                    kind=kind,
                    status=status,
                    node_id=node_id,
                    node_ids=[node_id],
                    detected_at=at,
                    pulled_at=at + timedelta(minutes=1) if pulled else None,
                )
            )


def _fleet(db_url: str, policy: spares.SparesPolicy = spares.DEFAULT_POLICY):
    with session_scope(db_url) as session:
        return spares.pool_spares(session, now=NOW, policy=policy)


def _check(db_url: str, policy: spares.SparesPolicy = spares.DEFAULT_POLICY) -> spares.SparesCheck:
    with session_scope(db_url) as session:
        return spares.check_spares(session, now=NOW, policy=policy)


def _alerts(db_url: str) -> list[tuple[str, str | None]]:
    with session_scope(db_url) as session:
        rows = session.exec(select(OperatorAlertRecord).order_by(col(OperatorAlertRecord.seq))).all()
        return [(r.kind, r.pool) for r in rows]


def test_a_young_pool_plans_on_the_llama3_rate(db_url) -> None:
    _nodes(db_url, "n", 10, age=timedelta(days=1))
    (pool,) = _fleet(db_url).pools
    assert (pool.pool, pool.gpu_type, pool.region, pool.nodes) == (POOL, "H100", "r1", 10)
    assert pool.node_hours == pytest.approx(240.0) and pool.failures == 0
    assert pool.rate_source == "llama3_default"
    assert pool.failures_per_node_hour == LLAMA3_405B_FAILURES_PER_NODE_HOUR
    assert pool.measured_per_node_hour == 0.0
    # μ = 10 × 1.58e-4 × 72 = 0.114: P(N ≤ 0) = 0.89, P(N ≤ 1) = 0.994.
    assert pool.expected_out == pytest.approx(10 * LLAMA3_405B_FAILURES_PER_NODE_HOUR * 72)
    assert (pool.spares_needed, pool.spares_held, pool.shortfall) == (1, 0, 1)
    assert (pool.repair_hours, pool.replacement_target_hours, pool.probability) == (72.0, 0.0, 0.99)


def test_a_pool_with_enough_node_hours_plans_on_its_own_upper_bound(db_url) -> None:
    old = _nodes(db_url, "old", 100, age=timedelta(days=60))  # the whole 30-day window each
    _nodes(db_url, "new", 1, age=timedelta(days=10))
    [gone] = _nodes(db_url, "gone", 1, age=timedelta(days=60), state="rma")
    _set(db_url, gone, state_entered_at=NOW - timedelta(days=5))  # in the fleet for 25 days of the 30
    _incidents(db_url, [*old[:3], gone], ago=timedelta(days=7))
    _incidents(db_url, [old[3]], ago=timedelta(days=7), status="rma")
    _incidents(db_url, [old[4]], ago=timedelta(hours=1), status="open")  # still open: detected, counted
    # The workflow stopped waiting after the node was pulled: a failure all the same.
    _incidents(db_url, [old[5]], ago=timedelta(days=20), status="abandoned")
    # Not failures: abandoned before the node was ever pulled; a fleet incident; before the window.
    _incidents(db_url, [old[6]], ago=timedelta(days=3), status="abandoned", pulled=False)
    _incidents(db_url, [old[7]], ago=timedelta(days=3), kind="fleet")
    _incidents(db_url, old[8:12], ago=timedelta(days=31))
    (pool,) = _fleet(db_url).pools
    hours = 100 * 720 + 240 + 600
    assert pool.nodes == 101 and pool.failures == 7  # the RMA'd node is out of the fleet, its failure in
    assert pool.node_hours == pytest.approx(hours)
    assert pool.rate_source == "measured"
    assert pool.measured_per_node_hour == pytest.approx(7 / hours)
    upper = estimate_failure_rate(failures=7, node_hours=hours).upper_per_node_hour
    assert pool.failures_per_node_hour == pytest.approx(upper)
    plan = plan_spares(pool=POOL, nodes=101, spares_held=0, repair_hours=72, failures_per_node_hour=upper)
    assert pool.spares_needed == plan.spares_needed and pool.expected_out == pytest.approx(plan.expected_out)


def test_the_rate_source_switches_at_the_node_hours_threshold(db_url) -> None:
    _nodes(db_url, "n", 10, age=timedelta(days=60))  # 7,200 node-hours
    assert _fleet(db_url).pools[0].rate_source == "llama3_default"
    measured = spares.SparesPolicy(min_node_hours=7_200)
    (pool,) = _fleet(db_url, measured).pools
    assert pool.rate_source == "measured"
    # No failure in 7,200 node-hours: Garwood's bound is 3.0 failures' worth, above the default.
    assert pool.failures_per_node_hour == pytest.approx(-math.log(0.05) / 7_200)


def test_spares_held_are_the_nodes_a_reservation_could_take_now(db_url) -> None:
    free = _nodes(db_url, "free", 6, age=timedelta(days=1), state="available")
    _nodes(db_url, "res", 1, age=timedelta(days=1), state="reserved")
    _nodes(db_url, "out", 2, age=timedelta(days=1), state="retired")
    _set(db_url, free[0], cordoned=True)
    _set(db_url, free[1], maintenance=True)
    _set(db_url, free[2], health="suspect")
    _nodes(db_url, "a100", 3, age=timedelta(days=1), state="available", gpu_type="A100", region="r2")
    pools = {p.pool: p for p in _fleet(db_url).pools}
    assert set(pools) == {POOL, "A100/r2"}
    assert (pools[POOL].nodes, pools[POOL].spares_held) == (7, 3)
    assert (pools["A100/r2"].nodes, pools["A100/r2"].spares_held) == (3, 3)


def test_a_replacement_target_as_long_as_the_turnaround_needs_no_spares(db_url) -> None:
    _nodes(db_url, "n", 500, age=timedelta(days=1))
    assert _fleet(db_url).pools[0].spares_needed > 0
    relaxed = spares.SparesPolicy(repair_hours=72, replacement_target_hours=72)
    (pool,) = _fleet(db_url, relaxed).pools
    assert (pool.expected_out, pool.spares_needed, pool.shortfall) == (0.0, 0, 0)
    half = spares.SparesPolicy(repair_hours=72, replacement_target_hours=48)
    assert _fleet(db_url, half).pools[0].expected_out == pytest.approx(500 * LLAMA3_405B_FAILURES_PER_NODE_HOUR * 24)


def test_the_policy_comes_from_the_health_settings(tmp_path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        health={
            "spares_window_s": 7 * 86_400,
            "spares_repair_s": 48 * 3600,
            "spares_replacement_target_s": 3600,
            "spares_probability": 0.95,
            "spares_min_node_hours": 1_000,
        },
    )
    policy = spares.SparesPolicy.of(settings)
    assert policy == spares.SparesPolicy(
        window=timedelta(days=7),
        repair_hours=48,
        replacement_target_hours=1,
        probability=0.95,
        min_node_hours=1_000,
    )
    assert policy.uncovered_hours == 47
    defaults = spares.SparesPolicy.of(Settings(data_dir=tmp_path))
    assert defaults == spares.DEFAULT_POLICY


def _gauge(pool: str, kind: str) -> float | None:
    return REGISTRY.get_sample_value("gpucloud_spares", {"pool": pool, "kind": kind})


def test_a_short_pool_raises_one_alert_until_it_recovers(db_url) -> None:
    ids = _nodes(db_url, "n", 200, age=timedelta(days=1))  # all busy: no spare held
    first = _check(db_url)
    (pool,) = first.spares.pools
    assert pool.shortfall > 0 and first.raised == [POOL] and first.recovered == []
    assert _gauge(POOL, "needed") == pool.spares_needed and _gauge(POOL, "held") == 0
    [(kind, alerted)] = _alerts(db_url)
    assert (kind, alerted) == ("spares_shortfall", POOL)
    with session_scope(db_url) as session:
        reason = session.exec(select(OperatorAlertRecord)).one().reason
    assert f"needs {pool.spares_needed}" in reason and "llama3 default" in reason

    again = _check(db_url)  # still short: the open alert stands, no second one
    assert again.raised == [] and again.recovered == [] and len(_alerts(db_url)) == 1

    for node_id in ids[: pool.spares_needed]:
        _set(db_url, node_id, state="available")
    recovered = _check(db_url)
    assert recovered.raised == [] and recovered.recovered == [POOL]
    assert _alerts(db_url) == [("spares_shortfall", POOL), ("spares_recovered", POOL)]
    assert _gauge(POOL, "held") == pool.spares_needed
    assert _check(db_url).recovered == [] and len(_alerts(db_url)) == 2  # recovered once

    _set(db_url, ids[0], cordoned=True)  # short again: a new alert
    assert _check(db_url).raised == [POOL]
    assert [k for k, _ in _alerts(db_url)] == ["spares_shortfall", "spares_recovered", "spares_shortfall"]


def test_alerts_are_per_pool_and_a_pool_that_empties_recovers(db_url) -> None:
    h100 = _nodes(db_url, "h", 200, age=timedelta(days=1))
    _nodes(db_url, "a", 200, age=timedelta(days=1), gpu_type="A100", region="r2")
    assert sorted(_check(db_url).raised) == ["A100/r2", POOL]
    with session_scope(db_url) as session:
        for node in session.exec(select(Node).where(col(Node.id).in_(h100))).all():
            node.state = "retired"
            session.add(node)
    check = _check(db_url)
    assert check.raised == [] and check.recovered == [POOL]
    with session_scope(db_url) as session:
        assert spares.open_shortfalls(session) == {"A100/r2"}


def test_the_reconcilers_sweep_checks_spares_once_per_interval(db_url, tmp_path) -> None:
    _nodes(db_url, "n", 200, age=timedelta(days=1))
    settings = Settings(data_dir=tmp_path, health={"spares_check_interval_s": 3600})
    activities = ReconcilerActivities(client=None, db=Database(db_url), settings=settings)  # type: ignore[arg-type]
    result = SweepResult()
    asyncio.run(activities._check_spares_if_due(result))
    assert result.errors == [] and [k for k, _ in _alerts(db_url)] == ["spares_shortfall"]
    with session_scope(db_url) as session:
        session.execute(OperatorAlertRecord.__table__.delete())  # type: ignore[attr-defined]
    asyncio.run(activities._check_spares_if_due(result))  # within the interval: not checked
    assert _alerts(db_url) == []
    activities._spares_due = 0.0
    asyncio.run(activities._check_spares_if_due(result))
    assert [k for k, _ in _alerts(db_url)] == ["spares_shortfall"]


def test_a_failed_check_is_the_sweeps_error_not_its_failure(db_url, tmp_path, monkeypatch) -> None:
    settings = Settings(data_dir=tmp_path)
    activities = ReconcilerActivities(client=None, db=Database(db_url), settings=settings)  # type: ignore[arg-type]

    def broken(*args, **kwargs):
        raise RuntimeError("database gone")

    monkeypatch.setattr(spares, "check_spares", broken)
    result = SweepResult()
    asyncio.run(activities._check_spares_if_due(result))
    assert result.errors == ["spares check: database gone"]
