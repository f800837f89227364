"""Issue 42: `GET /v1/fleet/spares` answers an operator (any role: it reads) the spares per pool,
with the health settings' policy, and refuses a tenant's key with 403."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import col, select

from gpucloud.db import session_scope
from gpucloud.health.spares import LLAMA3_405B_FAILURES_PER_NODE_HOUR
from gpucloud.models.api_schemas import FleetSpares
from gpucloud.models.operator_roles import Role
from gpucloud.models.tables import Node
from gpucloud.services import tenants
from support.nodes import enroll
from support.operators import bearer, operator_api, role_token

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def _fleet(db_url: str) -> None:
    ids = enroll(db_url, [f"n-{i:02d}" for i in range(12)])
    with session_scope(db_url) as session:
        for i, node in enumerate(session.exec(select(Node).where(col(Node.id).in_(ids))).all()):
            node.state = "available" if i < 2 else "active"
            session.add(node)


def test_an_operator_reads_the_spares_per_pool(tmp_path) -> None:
    with operator_api(tmp_path) as (client, settings):
        _fleet(settings.database_url)
        token = role_token(settings, "op-read", Role.READ_ONLY)
        resp = client.get("/v1/fleet/spares", headers=bearer(token))
        assert resp.status_code == 200, resp.text
        fleet = FleetSpares.model_validate(resp.json())
        assert fleet.window_s == timedelta(days=30).total_seconds()
        (pool,) = fleet.pools
        assert (pool.pool, pool.nodes, pool.spares_held) == ("H100/r1", 12, 2)
        assert pool.rate_source == "llama3_default"
        assert pool.failures_per_node_hour == LLAMA3_405B_FAILURES_PER_NODE_HOUR
        assert pool.spares_needed == 1 and pool.shortfall == 0 and pool.probability == 0.99


def test_the_route_takes_the_health_settings(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPUCLOUD_HEALTH__SPARES_PROBABILITY", "0.5")
    monkeypatch.setenv("GPUCLOUD_HEALTH__SPARES_REPLACEMENT_TARGET_S", str(24 * 3600))
    with operator_api(tmp_path) as (client, settings):
        _fleet(settings.database_url)
        resp = client.get("/v1/fleet/spares", headers=bearer(settings.operator_token))
        (pool,) = resp.json()["pools"]
        assert pool["probability"] == 0.5 and pool["replacement_target_hours"] == 24
        assert pool["expected_out"] == pytest.approx(12 * LLAMA3_405B_FAILURES_PER_NODE_HOUR * 48)
        assert pool["spares_needed"] == 0


def test_a_tenant_is_refused(tmp_path) -> None:
    with operator_api(tmp_path) as (client, settings):
        with session_scope(settings.database_url) as session:
            *_, key = tenants.create(session, name="acme", quotas=[], actor="operator:test")
        resp = client.get("/v1/fleet/spares", headers=bearer(key))
        assert resp.status_code == 403, resp.text
        assert client.get("/v1/fleet/spares").status_code == 401
