"""`gpucloud incidents list|show|write-up|root-cause|resolve` against a canned API: tables keep
the ids whole, `--json` and `-o json` print one document, the write-up prints as Markdown, a root
cause and a resolve's note are sent as the API takes them, and a missing incident exits 3."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from gpucloud.cli import common
from gpucloud.cli.main import app
from gpucloud.client.base import ApiClient

pytestmark = pytest.mark.unit

INCIDENT = "inc_0123456789abcdef0123"
WRITE_UP = "# Incident inc_0123456789abcdef0123: node n1 pulled\n\n## Timeline\n"


def _incident(**changes) -> dict:
    return {
        "id": INCIDENT,
        "kind": "node",
        "status": "resolved",
        "phase": "closed",
        "node_ids": ["node-a1"],
        "suspected_component": "GPU 3",
        "category": "faulty_gpu",
        "summary": "node node-a1 pulled: xid_79",
        "detected_at": "2026-12-06T10:00:00Z",
        "pulled_at": "2026-12-06T10:00:01Z",
        "stabilized_at": "2026-12-06T10:00:20Z",
        "diagnosed_at": "2026-12-06T10:01:00Z",
        "repaired_at": "2026-12-06T10:01:10Z",
        "repaired_by": "reset",
        "gated_at": "2026-12-06T10:01:30Z",
        "closed_at": "2026-12-06T10:01:30Z",
        "tenant_ids": ["ten_a"],
        "allocation_ids": ["alloc_a"],
        "replacement_node_ids": ["node-b2"],
        "gpu_count": 8,
        "gpu_hours_lost": 0.0444,
        "signals": [],
        "actions": [{"at": "2026-12-06T10:00:01+00:00", "event": "cordon", "from": "active", "to": "active"}],
        "root_cause": None,
        "follow_ups": None,
        "root_cause_by": None,
        "root_cause_at": None,
        "created_at": "2026-12-06T10:00:02Z",
        "updated_at": "2026-12-06T10:01:30Z",
        **changes,
    }


@pytest.fixture
def sent(monkeypatch) -> list[httpx.Request]:
    """The requests the CLI made, to a canned API."""
    requests: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        path = request.url.path
        if path == "/v1/incidents":
            return httpx.Response(200, json={"items": [_incident()], "next_page_token": ""})
        if path == f"/v1/incidents/{INCIDENT}":
            return httpx.Response(200, json=_incident())
        if path == f"/v1/incidents/{INCIDENT}/write-up":
            return httpx.Response(200, text=WRITE_UP, headers={"content-type": "text/markdown"})
        if path == f"/v1/incidents/{INCIDENT}:resolve":
            body = json.loads(request.content)
            return httpx.Response(200, json=_incident(kind="fleet", trigger="breaker_trip", repaired_by=body["note"]))
        if path == f"/v1/incidents/{INCIDENT}/root-cause":
            body = json.loads(request.content)
            return httpx.Response(200, json=_incident(root_cause=body["root_cause"], follow_ups=body.get("follow_ups")))
        return httpx.Response(404, json={"title": "incident not found", "detail": "no incident 'inc_x'"})

    original = ApiClient.__init__

    def init(self, base_url: str, token: str, **options) -> None:
        original(self, base_url, token, **{**options, "transport": httpx.MockTransport(handle)})

    monkeypatch.setattr(ApiClient, "__init__", init)
    monkeypatch.setattr(common.console, "width", 80)
    monkeypatch.setenv("GPUCLOUD_API_URL", "http://api.test")
    monkeypatch.setenv("GPUCLOUD_API_KEY", "gpc_test")
    return requests


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result.output


def test_list_prints_a_table_with_whole_ids_and_json_on_request(sent) -> None:
    listed = run("incidents", "list", "--status", "resolved")
    assert INCIDENT in listed and "…" not in listed and "resolved" in listed and "20s" in listed
    assert sent[-1].url.params["status"] == "resolved"
    assert json.loads(run("incidents", "list", "--json"))[0]["id"] == INCIDENT
    assert json.loads(run("incidents", "list", "-o", "json"))[0]["gpu_hours_lost"] == 0.0444


def test_show_prints_phases_and_actions(sent) -> None:
    shown = run("incidents", "show", INCIDENT)
    for part in ("stabilized", "gated", "1m 30s", "GPU 3", "reset", "cordon", "not written yet"):
        assert part in shown
    assert json.loads(run("incidents", "show", INCIDENT, "--json"))["repaired_by"] == "reset"


def test_write_up_prints_the_markdown_as_it_is(sent) -> None:
    assert run("incidents", "write-up", INCIDENT) == WRITE_UP
    assert json.loads(run("incidents", "write-up", INCIDENT, "-o", "json")) == {"id": INCIDENT, "write_up": WRITE_UP}


def test_root_cause_sends_the_cause_and_follow_ups(sent) -> None:
    out = run("incidents", "root-cause", INCIDENT, "a riser", "--follow-up", "reseat", "--follow-up", "watch", "--json")
    assert json.loads(out)["root_cause"] == "a riser"
    assert json.loads(sent[-1].content) == {"root_cause": "a riser", "follow_ups": ["reseat", "watch"]}
    run("incidents", "root-cause", INCIDENT, "a riser")
    assert json.loads(sent[-1].content) == {"root_cause": "a riser"}  # the follow-ups written stay


def test_a_missing_incident_exits_not_found(sent) -> None:
    run("incidents", "show", "inc_x", code=3)


def test_resolve_sends_the_note_and_list_filters_by_kind(sent) -> None:
    out = run("incidents", "resolve", INCIDENT, "--note", "pulls were right", "--json")
    assert json.loads(out)["repaired_by"] == "pulls were right"
    assert sent[-1].method == "POST" and json.loads(sent[-1].content) == {"note": "pulls were right"}
    run("incidents", "list", "--kind", "fleet")
    assert sent[-1].url.params["kind"] == "fleet"
