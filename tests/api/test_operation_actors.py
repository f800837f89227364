"""Issue 37, item 8: every operation and allocation event names who acted: `operator:<name>` for a
named operator, `tenant:<id>/key:<key id>` for a tenant, `system` for the platform's own loops.

Before: an operation had no actor, so an operator's cancel of a tenant's allocation, an
offboarding or a quota change recorded no name (quota and API-key changes left no record at all).

In process: the API app with a stand-in for Temporal that takes every start, signal and update."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlmodel import col, select
from typer.testing import CliRunner

from gpucloud.activities.tenant import TenantActivities
from gpucloud.api.app import create_app
from gpucloud.cli import resources as cli
from gpucloud.cli.main import app
from gpucloud.client.api import Gpucloud
from gpucloud.config import Settings
from gpucloud.db import Database, session_scope
from gpucloud.models.health_tables import AllocationEvent
from gpucloud.models.node_states import NodeState
from gpucloud.models.operator_roles import Role
from gpucloud.models.rollout_messages import RolloutPhase, RolloutProgress
from gpucloud.models.tables import Node, Operation, TenantStatus
from gpucloud.services import allocations as allocation_service
from gpucloud.services import tenants as tenant_service
from support.nodes import enroll
from support.operators import bearer, role_token

pytestmark = pytest.mark.unit

ALLOC = {"gpu_type": "H100", "node_count": 1, "region": "r1"}


class _Temporal:
    """Takes every workflow start, signal, query and update; a rollout's progress is the tenant's."""

    def __init__(self) -> None:
        self.rollout_tenant = ""

    async def start_workflow(self, *args, **kwargs) -> None:
        return None

    def get_workflow_handle(self, workflow_id: str) -> SimpleNamespace:
        async def answer(*args, **kwargs):
            return RolloutProgress(
                rollout_id=workflow_id, tenant_id=self.rollout_tenant, model_version="v", phase=RolloutPhase.ACTIVATING
            )

        return SimpleNamespace(signal=answer, query=answer, execute_update=answer, start_update=answer)


@pytest.fixture
def api(tmp_path):
    settings = Settings(data_dir=tmp_path)
    temporal = _Temporal()
    with TestClient(create_app(settings, temporal=temporal), raise_server_exceptions=False) as client:  # type: ignore[arg-type]
        yield client, settings, temporal


def _operations(settings: Settings, **where: str) -> list[Operation]:
    with session_scope(settings.database_url) as session:
        query = select(Operation).where(*(getattr(Operation, k) == v for k, v in where.items()))
        return list(session.exec(query.order_by(col(Operation.seq))).all())


def _onboarded(client: TestClient, settings: Settings, alice: str) -> tuple[str, str]:
    """A tenant alice onboards, made active (no workflow runs here); its id and first key."""
    quotas = [{"gpu_type": "H100", "region": "r1", "max_gpus": 64}]
    created = client.post("/v1/tenants", json={"name": "acme", "quotas": quotas}, headers=bearer(alice))
    assert created.status_code == 202, created.text
    body = created.json()
    assert body["operation"]["actor"] == "operator:alice"
    with session_scope(settings.database_url) as session:
        tenant_service.move(session, body["id"], source=[TenantStatus.ONBOARDING], target=TenantStatus.ACTIVE)
    return body["id"], body["api_key"]["key"]


def _available(settings: Settings, ids: list[str]) -> None:
    enroll(settings.database_url, ids)
    with session_scope(settings.database_url) as session:
        session.execute(sa.update(Node).where(col(Node.id).in_(ids)).values(state=NodeState.AVAILABLE, health="ok"))


def test_a_tenants_create_names_its_key_and_an_operators_cancel_names_the_operator(api, monkeypatch) -> None:
    client, settings, _ = api
    alice = role_token(settings, "alice", Role.ADMIN)
    tenant_id, key = _onboarded(client, settings, alice)
    key_id = key[4:].split(".")[0]
    _available(settings, ["n1"])

    created = client.post("/v1/allocations", json=ALLOC, headers=bearer(key))
    assert created.status_code == 202, created.text
    allocation_id = created.json()["allocation"]["id"]
    assert created.json()["operation"]["actor"] == f"tenant:{tenant_id}/key:{key_id}"

    cancelled = client.post(f"/v1/allocations/{allocation_id}/cancel", headers=bearer(alice))
    assert cancelled.status_code == 202, cancelled.text
    operation_id = cancelled.json()["operation"]["id"]
    # The tenant reads who cancelled its allocation, on the operation and in the event log.
    read = client.get(f"/v1/operations/{operation_id}", headers=bearer(key)).json()
    assert (read["kind"], read["actor"]) == ("cancel_allocation", "operator:alice")
    events = client.get(f"/v1/allocations/{allocation_id}/events", headers=bearer(key)).json()["items"]
    assert [(e["kind"], e["actor"]) for e in events] == [
        ("requested", f"tenant:{tenant_id}/key:{key_id}"),
        ("cancel_requested", "operator:alice"),
    ]

    # The CLI's tables show who acted (`operations show`, `allocations show`).
    def api_client(api_url=None, api_key=None, *, operator=False):
        return Gpucloud("http://testserver", alice, transport=client._transport)

    monkeypatch.setattr(cli, "api_client", api_client)
    monkeypatch.setenv("COLUMNS", "300")
    shown = CliRunner().invoke(app, ["operations", "show", operation_id])
    assert shown.exit_code == 0 and "actor" in shown.output and "operator:alice" in shown.output, shown.output
    shown = CliRunner().invoke(app, ["allocations", "show", allocation_id])
    assert shown.exit_code == 0 and f"tenant:{tenant_id}/key:{key_id}" in shown.output, shown.output


def test_quota_and_key_changes_and_offboarding_leave_operations_naming_the_operator(api) -> None:
    client, settings, _ = api
    alice = role_token(settings, "alice", Role.ADMIN)
    tenant_id, key = _onboarded(client, settings, alice)
    _available(settings, ["n1"])
    assert client.post("/v1/allocations", json=ALLOC, headers=bearer(key)).status_code == 202

    quotas = {"quotas": [{"gpu_type": "H100", "region": "*", "max_gpus": 16}]}
    assert client.put(f"/v1/tenants/{tenant_id}/quotas", json=quotas, headers=bearer(alice)).status_code == 200
    issued = client.post(f"/v1/tenants/{tenant_id}/api-keys", headers=bearer(alice))
    assert issued.status_code == 201, issued.text
    second = issued.json()["id"]
    assert client.delete(f"/v1/api-keys/{second}", headers=bearer(key)).status_code == 200  # the tenant's own
    offboarded = client.delete(f"/v1/tenants/{tenant_id}", headers=bearer(alice))
    assert offboarded.status_code == 202, offboarded.text
    assert offboarded.json()["operation"]["actor"] == "operator:alice"

    # Offboarding's own cancels (the workflow's activity) are done for the operator who offboarded.
    activities = TenantActivities(Database(settings.database_url), fabric=None, ledger=None)
    assert len(activities._record_cancels(tenant_id)) == 1

    key_id = key[4:].split(".")[0]
    recorded = [(op.kind, op.resource_id, op.status, op.actor) for op in _operations(settings, tenant_id=tenant_id)]
    assert recorded[2:] == [
        ("replace_quotas", tenant_id, "succeeded", "operator:alice"),
        ("issue_api_key", second, "succeeded", "operator:alice"),
        ("revoke_api_key", second, "succeeded", f"tenant:{tenant_id}/key:{key_id}"),
        ("delete_tenant", tenant_id, "running", "operator:alice"),
        ("cancel_allocation", recorded[1][1], "running", "operator:alice"),
    ]


def test_a_rollout_command_names_whoever_gave_it(api) -> None:
    client, settings, temporal = api
    fleet = role_token(settings, "bob", Role.FLEET)
    temporal.rollout_tenant = "acme-id"
    assert client.post("/v1/rollouts/rollout-1:pause", headers=bearer(fleet)).status_code == 200
    assert client.post("/v1/rollouts/rollout-1:abort", headers=bearer(fleet)).status_code == 202
    recorded = [(op.kind, op.tenant_id, op.actor) for op in _operations(settings, resource_id="rollout-1")]
    assert recorded == [("rollout_pause", "acme-id", "operator:bob"), ("rollout_abort", "acme-id", "operator:bob")]


def test_the_health_loops_events_name_the_system(api) -> None:
    _, settings, _ = api
    with session_scope(settings.database_url) as session:
        allocation = SimpleNamespace(id="alloc-x", tenant_id="t")
        allocation_service.record_event(session, allocation, "degraded", reason="xid 79")  # type: ignore[arg-type]
    with session_scope(settings.database_url) as session:
        assert session.exec(select(col(AllocationEvent.actor))).one() == "system"
