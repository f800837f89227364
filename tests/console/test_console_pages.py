"""The console's operator and tenant pages over plain HTTP (no browser, no Temporal): each page
shows what the API's service answers for the same data, every action asks for its reason and
confirmation and is recorded as the API's is (the operator's or the key's name), a tenant sees
its own only, and a new API key's secret is shown once."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlmodel import select

from gpucloud.api.app import create_app
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.health_tables import OperatorAlertRecord
from gpucloud.models.incident_messages import IncidentInput
from gpucloud.models.tables import ApiKey, Node, NodeTransition
from gpucloud.protocol.reports import ReadingBatch
from gpucloud.services import incidents
from support.console import make_tenant as _tenant
from support.console import sign_in as _sign_in
from support.console import text as _text
from support.nodes import enroll
from support.operators import bearer
from support.readings import node_reading

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

OPERATOR_TOKEN = "console-pages-operator-token"
OPERATOR_PAGES = ("/fleet", "/allocations", "/queue", "/tenants", "/incidents", "/alerts")
TENANT_PAGES = ("/allocations", "/queue", "/incidents", "/usage", "/models", "/api-keys")


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path, api={"operator_token": OPERATOR_TOKEN, "credential_cache_s": 0})


@pytest.fixture
def client(settings):
    app = create_app(settings, temporal=object())  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False, follow_redirects=False) as c:
        yield c


def test_every_page_of_each_role_answers_and_lists_the_nav(client, settings):
    _sign_in(client, OPERATOR_TOKEN)
    for path in OPERATOR_PAGES:
        page = client.get(f"/console{path}")
        assert page.status_code == 200, (path, page.text[:500])
        assert f'href="/console{path}" aria-current="page"' in page.text, path
        assert all(f'href="/console{p}"' in page.text for p in OPERATOR_PAGES), path
    client.cookies.clear()
    _, _, key = _tenant(settings)
    _sign_in(client, key)
    for path in TENANT_PAGES:
        page = client.get(f"/console{path}")
        assert page.status_code == 200, (path, page.text[:500])
        assert f'href="/console{path}" aria-current="page"' in page.text, path
    for path in ("/fleet", "/tenants", "/alerts"):
        assert client.get(f"/console{path}").status_code == 403, path


def test_the_node_page_charts_the_readings_the_agents_posted(client, settings):
    (node_id,) = enroll(settings.database_url, ["n0001"])
    now = datetime.now(UTC).replace(microsecond=0)
    readings = [node_reading(node_id, now - timedelta(minutes=10 - i), corrected=i * 3) for i in range(5)]
    posted = client.post(
        "/v1/agents/readings",
        json=ReadingBatch(readings=readings).model_dump(mode="json"),
        headers=bearer(OPERATOR_TOKEN),
    )
    assert posted.status_code == 200, posted.text
    _sign_in(client, OPERATOR_TOKEN)
    page = client.get(f"/console/nodes/{node_id}")
    assert page.status_code == 200
    for key in ("temperature", "ecc", "nvlink", "pcie"):
        assert f'id="chart-{key}"' in page.text, key
    ecc = page.text.split('id="chart-ecc"')[1].split("</figure>")[0]
    assert ecc.count("<polyline") == 2  # corrected and uncorrected
    points = re.search(r'<polyline points="([^"]+)"', ecc)
    assert points and len(points.group(1).split()) == 5
    # The numbers in words too: corrected errors rose to 12 on GPU 2.
    assert "corrected: latest 12, highest 12" in _text(ecc)
    temperature = page.text.split('id="chart-temperature"')[1].split("</figure>")[0]
    assert "hottest GPU: latest 60 °C" in _text(temperature)


def test_node_actions_ask_for_a_reason_and_confirmation_and_name_the_operator(client, settings):
    (node_id,) = enroll(settings.database_url, ["n0002"])
    csrf = _sign_in(client, OPERATOR_TOKEN)
    page = client.get(f"/console/nodes/{node_id}")
    for label in ("Reason for the cordon", "Reason for the drain", "Reason for the maintenance"):
        assert label in page.text, label
    assert "no BMC: power actions need one" in page.text
    asked = client.post(f"/console/nodes/{node_id}/maintenance", data={"csrf_token": csrf, "enabled": "on"})
    assert asked.status_code == 422
    assert 'id="reason-maintenance-error"' in asked.text and 'id="confirm-maintenance-error"' in asked.text
    done = client.post(
        f"/console/nodes/{node_id}/maintenance",
        data={"csrf_token": csrf, "enabled": "on", "reason": "firmware update", "confirm": "yes"},
    )
    assert done.status_code == 303 and done.headers["location"].endswith("done=maintenance_on")
    with session_scope(settings.database_url) as session:
        assert session.get(Node, node_id).maintenance is True
        event = session.exec(
            select(NodeTransition).where(NodeTransition.node_id == node_id).order_by(NodeTransition.seq.desc())
        ).first()
    assert event.actor == "operator:bootstrap" and "firmware update" in event.cause
    after = client.get(done.headers["location"])
    assert 'id="node-maintenance">yes' in after.text and "Turn maintenance off" in after.text
    # Power on a node without a BMC: the API's refusal, beside the action.
    refused = client.post(
        f"/console/nodes/{node_id}/power",
        data={"csrf_token": csrf, "power_action": "cycle", "reason": "hung", "confirm": "yes"},
    )
    assert refused.status_code == 409 and "has no BMC" in refused.text
    (with_bmc,) = enroll(
        settings.database_url, ["n0012"], bmc_url="https://bmc.invalid", bmc_system_id="1", bmc_credential_ref="env:X"
    )
    assert "Send power action" in client.get(f"/console/nodes/{with_bmc}").text
    bad = client.post(
        f"/console/nodes/{with_bmc}/power",
        data={"csrf_token": csrf, "power_action": "reboot", "reason": "hung", "confirm": "yes"},
    )
    api = client.post(f"/v1/nodes/{with_bmc}/power", json={"action": "reboot"}, headers=bearer(OPERATOR_TOKEN))
    assert bad.status_code == 422 and api.status_code == 422
    assert api.json()["errors"][0]["message"] in _text(bad.text)


def test_tenants_alerts_and_incidents_for_the_operator(client, settings):
    tenant_id, _, _ = _tenant(settings)
    enroll(settings.database_url, ["n0003"])
    with session_scope(settings.database_url) as session:
        session.add(OperatorAlertRecord(kind="breaker_open", pool="H100/r1", node_id="n0003", reason="5 pulls in 1h"))
        incident = incidents.open_incident(
            session,
            workflow_id="incident-n0003",
            inp=IncidentInput(node_id="n0003", detected_at=datetime.now(UTC), reason="XID 79: GPU fell off the bus"),
        )
        incident_id = incident.id
    csrf = _sign_in(client, OPERATOR_TOKEN)
    tenant = client.get(f"/console/tenants/{tenant_id}")
    assert tenant.status_code == 200 and "64" in tenant.text and "GPUs of H100 in r1" in _text(tenant.text)
    assert client.get("/console/tenants/ten_nope").status_code == 404
    alerts = client.get("/console/alerts")
    assert "breaker_open" in alerts.text and "5 pulls in 1h" in alerts.text
    listed = client.get("/console/incidents")
    assert f'href="/console/incidents/{incident_id}"' in listed.text
    page = client.get(f"/console/incidents/{incident_id}")
    assert page.status_code == 200 and "Write-up" in page.text and "Timeline" in page.text
    empty = client.post(f"/console/incidents/{incident_id}/root-cause", data={"csrf_token": csrf, "root_cause": ""})
    assert empty.status_code == 422 and 'id="root_cause-error"' in empty.text
    saved = client.post(
        f"/console/incidents/{incident_id}/root-cause",
        data={"csrf_token": csrf, "root_cause": "a <b>riser</b> card", "follow_ups": "replace risers\n\ncheck tray 2"},
    )
    assert saved.status_code == 303
    api = client.get(f"/v1/incidents/{incident_id}", headers=bearer(OPERATOR_TOKEN)).json()
    assert api["root_cause"] == "a <b>riser</b> card" and api["follow_ups"] == ["replace risers", "check tray 2"]
    assert api["root_cause_by"] == "operator:bootstrap"
    shown = client.get(saved.headers["location"])
    assert "<b>riser</b>" not in shown.text and "&lt;b&gt;riser&lt;/b&gt;" in shown.text  # no raw HTML


def test_a_tenant_sees_only_its_own_incidents_and_no_billing_without_a_ledger(client, settings):
    _, _, key = _tenant(settings)
    enroll(settings.database_url, ["n0004"])
    with session_scope(settings.database_url) as session:
        incident_id = incidents.open_incident(
            session, workflow_id="incident-n0004", inp=IncidentInput(node_id="n0004", detected_at=datetime.now(UTC))
        ).id
    _sign_in(client, key)
    assert incident_id not in client.get("/console/incidents").text
    assert client.get(f"/console/incidents/{incident_id}").status_code == 404
    usage = client.get("/console/usage")
    assert usage.status_code == 200 and "Billing is not configured" in usage.text
    assert client.get("/console/usage?period=2026-13x").status_code == 422
    assert client.get("/console/models/nope").status_code == 404


def test_api_keys_create_rotate_and_revoke_show_each_secret_once(client, settings):
    tenant_id, first_key_id, key = _tenant(settings)
    csrf = _sign_in(client, key)
    created = client.post("/console/api-keys", data={"csrf_token": csrf})
    assert created.status_code == 201 and created.headers["cache-control"] == "no-store"
    secret = re.search(r'id="new-key" readonly value="([^"]+)"', created.text)
    assert secret and secret.group(1).startswith("gpc_")
    new_id = secret.group(1)[len("gpc_") :].split(".")[0]
    assert client.get("/v1/api-keys", headers=bearer(secret.group(1))).status_code == 200  # a live key
    listing = client.get("/console/api-keys")
    assert new_id in listing.text and secret.group(1) not in listing.text  # never again
    # Rotate without the grace the API requires: the API's words; then with it.
    asked = client.post(f"/console/api-keys/{new_id}/rotate", data={"csrf_token": csrf, "confirm": "yes"})
    assert asked.status_code == 422 and f'id="grace-{new_id}-error"' in asked.text
    rotated = client.post(
        f"/console/api-keys/{new_id}/rotate", data={"csrf_token": csrf, "grace_period_s": "0", "confirm": "yes"}
    )
    assert rotated.status_code == 201 and f"replaces {new_id}" in rotated.text
    assert client.get("/v1/api-keys", headers=bearer(secret.group(1))).status_code == 401
    unconfirmed = client.post(f"/console/api-keys/{first_key_id}/revoke", data={"csrf_token": csrf})
    assert unconfirmed.status_code == 422
    with session_scope(settings.database_url) as session:
        assert session.exec(select(ApiKey).where(ApiKey.id == first_key_id)).one().revoked_at is None
    # Revoking the key this session signed in with ends the session.
    revoked = client.post(f"/console/api-keys/{first_key_id}/revoke", data={"csrf_token": csrf, "confirm": "yes"})
    assert revoked.status_code == 303
    assert client.get("/console/api-keys").status_code == 303
    ops = client.get(f"/v1/tenants/{tenant_id}/api-keys", headers=bearer(OPERATOR_TOKEN)).json()["items"]
    assert {k["id"]: k["revoked_at"] is not None for k in ops}[first_key_id]
