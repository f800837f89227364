"""The console's rollouts, reservations and billing pages over plain HTTP (no browser), on every
database: each page shows what the API's service (or the ledger, through the one client) answers
for the same data; each action asks for its confirmation (and a rollout command for its reason)
and is recorded as the API records it, with the operator's or the key's name; a tenant sees its
own reservations only (another's is a 404); a POST without the CSRF token changes nothing.

Rollouts live in their workflows: a stand-in for Temporal answers the engine's listing, the
progress query and the updates, as `tests/api/test_operation_actors.py` does for the API."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import col, select
from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from gpucloud import bootstrap
from gpucloud.api.app import create_app
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.ledger.periods import period_bounds
from gpucloud.models import search_attributes as sa_keys
from gpucloud.models.registry_tables import ModelVersion, RegistryModel
from gpucloud.models.rollout_messages import NodeOutcome, RolloutPhase, RolloutProgress
from gpucloud.models.scheduling_tables import CapacityReservation
from gpucloud.models.tables import Allocation, Operation
from support.console import make_tenant as _tenant
from support.console import sign_in as _sign_in
from support.console import text as _text
from support.ledger_auth import auth_for, post_usage
from support.ledger_harness import ledger_in_thread
from support.operators import bearer

pytestmark = pytest.mark.integration

OPERATOR_TOKEN = "console-ops-operator-token"
DIGEST = "ab" * 32
OTHER_DIGEST = "cd" * 32
JAN = period_bounds("2024-01")[0]
HOUR = 3_600_000


class _Temporal:
    """The rollouts' workflows as the engine would answer for them: a listing of two (one
    running, one completed), each one's progress, and the updates, which it records."""

    def __init__(self, tenant_id: str) -> None:
        self.tenant_id = tenant_id
        started = datetime(2026, 12, 6, 9, 30, tzinfo=UTC)
        self.listing = [
            self._execution("rollout-live", DIGEST, WorkflowExecutionStatus.RUNNING, started, None),
            self._execution(
                "rollout-done", OTHER_DIGEST, WorkflowExecutionStatus.COMPLETED, started - timedelta(days=1), started
            ),
        ]
        self.progress = {
            "rollout-live": RolloutProgress(
                rollout_id="rollout-live",
                tenant_id=tenant_id,
                model_version=DIGEST,
                phase=RolloutPhase.BAKING,
                wave=2,
                waves=[["n1"], ["n2", "n3"], ["n4"]],
                activated=["n1", "n2"],
                rolled_back=["n3"],
                prefetched=["n1", "n2", "n3", "n4"],
                outcomes={
                    "n1": NodeOutcome(node_id="n1", ok=True, active=DIGEST, healthy=True, eval_score=0.91),
                    "n2": NodeOutcome(node_id="n2", ok=True, active=DIGEST, healthy=True),
                    "n3": NodeOutcome(node_id="n3", ok=False, detail="digest mismatch after activate", healthy=False),
                },
            ),
            "rollout-done": RolloutProgress(
                rollout_id="rollout-done", tenant_id=tenant_id, model_version=OTHER_DIGEST, phase=RolloutPhase.SUCCEEDED
            ),
        }
        self.updates: list[tuple[str, str, str]] = []

    def _execution(self, wid, digest, status, start, close) -> SimpleNamespace:
        attributes = sa_keys.typed((sa_keys.TENANT_ID, self.tenant_id), (sa_keys.MODEL_VERSION, digest))
        return SimpleNamespace(
            id=wid, typed_search_attributes=attributes, status=status, start_time=start, close_time=close
        )

    def list_workflows(self, query: str, *, page_size: int, next_page_token: bytes | None) -> SimpleNamespace:
        assert "RolloutWorkflow" in query
        listing = SimpleNamespace(current_page=None, next_page_token=None)

        async def fetch_next_page() -> None:
            listing.current_page = self.listing[:page_size]

        listing.fetch_next_page = fetch_next_page
        return listing

    def get_workflow_handle(self, workflow_id: str) -> SimpleNamespace:
        async def query(name, *args, **kwargs) -> RolloutProgress:
            if workflow_id not in self.progress:
                from temporalio.service import RPCError, RPCStatusCode

                raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
            return self.progress[workflow_id]

        async def update(name, arg, *args, **kwargs) -> RolloutProgress:
            progress = self.progress[workflow_id]
            if name == "resume" and not progress.paused:
                raise WorkflowUpdateFailedError(ApplicationError("the rollout is not paused"))
            self.updates.append((workflow_id, name, arg.reason))
            if name in ("pause", "resume"):
                self.progress[workflow_id] = progress.model_copy(update={"paused": name == "pause"})
            return self.progress[workflow_id]

        return SimpleNamespace(query=query, execute_update=update, start_update=update)


@pytest.fixture
def settings(tmp_path, db_url) -> Settings:
    return Settings(
        data_dir=tmp_path,
        database={"url": db_url},
        api={"operator_token": OPERATOR_TOKEN, "credential_cache_s": 0},
    )


def _client(settings: Settings, temporal: object = None) -> TestClient:
    app = create_app(settings, temporal=temporal or object())  # type: ignore[arg-type]
    return TestClient(app, raise_server_exceptions=False, follow_redirects=False)


def _operations(settings: Settings, resource_id: str) -> list[tuple[str, str, str | None]]:
    with session_scope(settings.database_url) as session:
        rows = session.exec(
            select(Operation).where(col(Operation.resource_id) == resource_id).order_by(col(Operation.seq))
        ).all()
        return [(op.kind, op.actor, op.tenant_id) for op in rows]


def _model(settings: Settings, tenant_id: str, name: str, digest: str) -> None:
    with session_scope(settings.database_url) as session:
        model = RegistryModel(tenant_id=tenant_id, name=name)
        session.add(model)
        session.flush()
        session.add(
            ModelVersion(
                tenant_id=tenant_id,
                model_id=model.id,
                digest=digest,
                total_size=1,
                chunk_count=1,
                file_count=1,
                key_id="k1",
                created_at=datetime.now(UTC),
                manifest_uri="file:///m",
            )
        )


def test_the_nav_of_each_role_lists_its_new_pages(settings):
    _, _, key = _tenant(settings, "acme")
    with _client(settings) as client:
        _sign_in(client, OPERATOR_TOKEN)
        for path in ("/reservations", "/billing"):
            page = client.get(f"/console{path}")
            assert page.status_code == 200, (path, page.text[:500])
            assert f'href="/console{path}" aria-current="page"' in page.text
            assert all(f'href="/console{p}"' in page.text for p in ("/rollouts", "/reservations", "/billing"))
        _sign_in(client, key)
        page = client.get("/console/reservations")
        assert page.status_code == 200 and 'href="/console/reservations" aria-current="page"' in page.text
        assert 'href="/console/rollouts"' not in page.text and 'href="/console/billing"' not in page.text
        for path in ("/rollouts", "/rollouts/rollout-live", "/billing"):
            assert client.get(f"/console{path}").status_code == 403, path


def test_rollouts_list_and_detail_show_what_the_api_answers(settings):
    tenant_id, _, _ = _tenant(settings, "acme")
    _model(settings, tenant_id, "llama-ft", DIGEST)
    temporal = _Temporal(tenant_id)
    with _client(settings, temporal) as client:
        api = client.get("/v1/rollouts", headers=bearer(OPERATOR_TOKEN)).json()["items"]
        _sign_in(client, OPERATOR_TOKEN)
        page = client.get("/console/rollouts")
        assert page.status_code == 200, page.text[:500]
        body = page.text.split('<table id="rollouts">')[1].split("<tbody>")[1].split("</tbody>")[0]
        rows = {re.search(r"/console/rollouts/(rollout-[\w-]+)", r).group(1): _text(r) for r in body.split("<tr>")[1:]}
        assert sorted(rows) == sorted(r["rollout_id"] for r in api) == ["rollout-done", "rollout-live"]
        live = rows["rollout-live"]
        # Model and version, status (with the workflow's phase), the wave under way, when it started.
        assert "llama-ft" in live and DIGEST[:12] in live and "running (baking)" in live
        assert "2 of 3" in live and "2026-12-06 09:30:00" in live
        done = rows["rollout-done"]
        assert "completed" in done and OTHER_DIGEST[:12] in done and "2026-12-05 09:30:00" in done

        detail = client.get("/console/rollouts/rollout-live")
        assert detail.status_code == 200
        api_one = client.get("/v1/rollouts/rollout-live", headers=bearer(OPERATOR_TOKEN)).json()
        assert api_one["wave"] == 2 and len(api_one["waves"]) == 3
        waves = {n: _text(detail.text.split(f'id="wave-{n}"')[1].split("</table>")[0]) for n in (1, 2, 3)}
        assert "Wave 1: 1 node, done" in waves[1] and "n1 ✓ activated" in waves[1] and "0.91" in waves[1]
        assert "Wave 2: 2 nodes, under way" in waves[2]
        assert "n2 ✓ activated" in waves[2] and "n3 ↺ rolled back" in waves[2]
        assert "digest mismatch after activate" in waves[2]
        assert "Wave 3: 1 node, pending" in waves[3] and "n4 … prefetched" in waves[3]
        assert "Reason to pause" in detail.text and "Reason to abort" in detail.text
        assert client.get("/console/rollouts/rollout-nope").status_code == 404
        assert client.get("/console/rollouts/node-1").status_code == 404


def test_rollout_commands_ask_reason_and_confirmation_and_name_the_operator(settings):
    tenant_id, _, _ = _tenant(settings, "acme")
    temporal = _Temporal(tenant_id)
    with _client(settings, temporal) as client:
        csrf = _sign_in(client, OPERATOR_TOKEN)
        # Without the CSRF token: refused, and nothing reaches the workflow.
        forged = client.post("/console/rollouts/rollout-live/abort", data={"reason": "forged", "confirm": "yes"})
        assert forged.status_code == 403 and temporal.updates == []
        asked = client.post("/console/rollouts/rollout-live/pause", data={"csrf_token": csrf})
        assert asked.status_code == 422
        assert 'id="reason-pause-error"' in asked.text and 'id="confirm-pause-error"' in asked.text
        assert temporal.updates == []
        paused = client.post(
            "/console/rollouts/rollout-live/pause",
            data={"csrf_token": csrf, "reason": "canary latency up", "confirm": "yes"},
        )
        assert paused.status_code == 303 and paused.headers["location"].endswith("done=pause")
        assert temporal.updates == [("rollout-live", "pause", "canary latency up")]
        after = client.get(paused.headers["location"])
        assert 'id="rollout-paused">yes' in after.text and "Reason to resume" in after.text
        # The API records a command the same way: the same kind, the operator's name, the tenant.
        assert client.post("/v1/rollouts/rollout-live:resume", headers=bearer(OPERATOR_TOKEN)).status_code == 200
        assert _operations(settings, "rollout-live") == [
            ("rollout_pause", "operator:bootstrap", tenant_id),
            ("rollout_resume", "operator:bootstrap", tenant_id),
        ]
        # A command the workflow refuses: its words beside the command, nothing recorded.
        refused = client.post(
            "/console/rollouts/rollout-live/resume", data={"csrf_token": csrf, "reason": "again", "confirm": "yes"}
        )
        assert refused.status_code == 409 and "the rollout is not paused" in _text(refused.text)
        aborted = client.post(
            "/console/rollouts/rollout-live/abort", data={"csrf_token": csrf, "reason": "bad eval", "confirm": "yes"}
        )
        assert aborted.status_code == 303
        assert temporal.updates[-1] == ("rollout-live", "abort", "bad eval")
        assert _operations(settings, "rollout-live")[-1] == ("rollout_abort", "operator:bootstrap", tenant_id)
        assert client.post("/console/rollouts/rollout-live/restart", data={"csrf_token": csrf}).status_code == 404


def _reservation(settings: Settings, tenant_id: str, *, status: str = "accepted", days: int = 3) -> str:
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(days=days)
    with session_scope(settings.database_url) as session:
        row = CapacityReservation(
            tenant_id=tenant_id,
            gpu_type="H100",
            region="r1",
            node_count=2,
            start_at=start,
            end_at=start + timedelta(hours=6),
            status=status,
        )
        session.add(row)
        session.flush()
        return row.id


def test_reservations_for_operators_and_tenants_and_a_tenants_cancel(settings, monkeypatch):
    acme_id, acme_key_id, acme_key = _tenant(settings, "acme")
    other_id, _, other_key = _tenant(settings, "globex")
    mine = _reservation(settings, acme_id)
    running = _reservation(settings, acme_id, status="active", days=1)
    foreign = _reservation(settings, other_id, days=5)
    with _client(settings) as client:
        _sign_in(client, OPERATOR_TOKEN)
        everyone = client.get("/console/reservations")
        api = client.get("/v1/reservations", headers=bearer(OPERATOR_TOKEN)).json()["items"]
        listed = re.findall(r'href="/console/reservations/(res[^"]+)"', everyone.text)
        assert [r["id"] for r in api] == [mine, running, foreign]  # as they were booked
        assert listed == [foreign, running, mine]  # the console: newest first
        # A page at a time: the API's keyset cursor, bound to the filters it was issued for.
        first = client.get("/v1/reservations", params={"page_size": 2}, headers=bearer(OPERATOR_TOKEN)).json()
        rest = client.get(
            "/v1/reservations",
            params={"page_size": 2, "page_token": first["next_page_token"]},
            headers=bearer(OPERATOR_TOKEN),
        ).json()
        assert [r["id"] for r in first["items"] + rest["items"]] == [mine, running, foreign]
        assert rest["next_page_token"] == ""
        other_filter = client.get(
            "/v1/reservations",
            params={"status": "active", "page_token": first["next_page_token"]},
            headers=bearer(OPERATOR_TOKEN),
        )
        assert other_filter.status_code == 400 and "different query" in other_filter.text
        monkeypatch.setattr("gpucloud.console.reservations.PAGE_SIZE", 2)
        paged = client.get("/console/reservations")
        [next_link] = re.findall(r'href="(/console/reservations\?page_token=[^"]+)" rel="next"', paged.text)
        assert re.findall(r'href="/console/reservations/(res[^"]+)"', paged.text) == [foreign, running]
        last = client.get(next_link.replace("&amp;", "&"))
        assert re.findall(r'href="/console/reservations/(res[^"]+)"', last.text) == [mine]
        assert "Last page" in last.text and 'href="/console/reservations">First page' in last.text
        monkeypatch.setattr("gpucloud.console.reservations.PAGE_SIZE", 50)
        assert other_id in everyone.text and acme_id in everyone.text
        only = client.get(f"/console/reservations?tenant={other_id}")
        assert re.findall(r'href="/console/reservations/(res[^"]+)"', only.text) == [foreign]
        one = _text(client.get(f"/console/reservations/{foreign}").text)
        assert "2 × H100 in r1" in one and "accepted" in one and other_id in one

        csrf = _sign_in(client, acme_key)
        own = client.get("/console/reservations")
        assert re.findall(r'href="/console/reservations/(res[^"]+)"', own.text) == [running, mine]
        assert [r["id"] for r in client.get("/v1/reservations", headers=bearer(acme_key)).json()["items"]] == [
            mine,
            running,
        ]
        assert client.get(f"/console/reservations/{foreign}").status_code == 404  # as in the API
        assert client.get(f"/v1/reservations/{foreign}", headers=bearer(acme_key)).status_code == 404
        assert (
            client.post(
                f"/console/reservations/{foreign}/cancel", data={"csrf_token": csrf, "confirm": "yes"}
            ).status_code
            == 404
        )
        page = client.get(f"/console/reservations/{mine}")
        assert f"Yes, cancel reservation {mine}" in page.text
        assert "Cancel reservation" not in client.get(f"/console/reservations/{running}").text

        forged = client.post(f"/console/reservations/{mine}/cancel", data={"confirm": "yes"})
        assert forged.status_code == 403
        unconfirmed = client.post(f"/console/reservations/{mine}/cancel", data={"csrf_token": csrf})
        assert unconfirmed.status_code == 422 and 'id="confirm-cancel-error"' in unconfirmed.text
        assert client.get(f"/v1/reservations/{mine}", headers=bearer(acme_key)).json()["status"] == "accepted"
        done = client.post(f"/console/reservations/{mine}/cancel", data={"csrf_token": csrf, "confirm": "yes"})
        assert done.status_code == 303
        assert client.get(f"/v1/reservations/{mine}", headers=bearer(acme_key)).json()["status"] == "cancelled"
        assert 'id="reservation-status">cancelled' in client.get(done.headers["location"]).text
        assert _operations(settings, mine) == [("reservation_cancel", f"tenant:{acme_id}/key:{acme_key_id}", acme_id)]
        refused = client.post(f"/console/reservations/{running}/cancel", data={"csrf_token": csrf, "confirm": "yes"})
        assert refused.status_code == 409 and "only an accepted reservation can be cancelled" in refused.text
        assert _operations(settings, running) == []

        # An operator's cancel, in the console and in the API: the operator's name on each.
        csrf = _sign_in(client, OPERATOR_TOKEN)
        assert (
            client.post(
                f"/console/reservations/{foreign}/cancel", data={"csrf_token": csrf, "confirm": "yes"}
            ).status_code
            == 303
        )
        again = _reservation(settings, other_id, days=9)
        assert client.post(f"/v1/reservations/{again}/cancel", headers=bearer(OPERATOR_TOKEN)).status_code == 200
        assert _operations(settings, foreign) == [("reservation_cancel", "operator:bootstrap", other_id)]
        assert _operations(settings, again) == [("reservation_cancel", "operator:bootstrap", other_id)]
        _sign_in(client, other_key)
        assert 'id="reservation-status">cancelled' in client.get(f"/console/reservations/{foreign}").text


def test_billing_without_a_ledger_says_so(settings):
    with _client(settings) as client:
        _sign_in(client, OPERATOR_TOKEN)
        page = client.get("/console/billing")
        assert page.status_code == 200 and "Billing is not configured" in page.text
        bad = client.get("/console/billing?period=2024-13&day=yesterday&tenant=a/b")
        assert bad.status_code == 422
        for field in ("period", "day", "tenant"):
            assert f'id="{field}-error"' in bad.text, field


def test_billing_shows_periods_invoices_by_price_class_and_the_reconciliation(settings, tmp_path):
    tenant_id, _, _ = _tenant(settings, "acme")
    with session_scope(settings.database_url) as session:
        alloc = Allocation(tenant_id=tenant_id, gpu_type="H100", node_count=1, region="r1")
        session.add(alloc)
        session.flush()
        alloc_id = alloc.id
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url:
        auth = auth_for(url)
        book = {"effective_from_ms": 0, "prices": [{"gpu_type": "H100", "price_per_hour_micro": 2_490_000}]}
        assert httpx.post(f"{url}/v1/price-book/versions", auth=auth, json=book).status_code == 201
        events = [("start", None, JAN), ("node_added", "n1", JAN), ("end", None, JAN + 2 * HOUR)]
        for i, (kind, node, at) in enumerate(events):
            event = {"event_id": f"e{i}", "allocation_id": alloc_id, "tenant_id": tenant_id, "kind": kind}
            event |= {"at_ms": at, "node_id": node, "gpu_type": "H100"}
            assert httpx.post(f"{url}/v1/allocation-events", auth=auth, json=event).status_code == 201
        post_usage(url, tenant_id=tenant_id, allocation_id=alloc_id, node="n1", start_ms=JAN, minutes=90)
        assert httpx.post(f"{url}/v1/periods/2024-01:close", auth=auth).status_code == 200
        settings = Settings(
            data_dir=tmp_path,
            database={"url": settings.database_url},
            api={"operator_token": OPERATOR_TOKEN, "credential_cache_s": 0},
            ledger={"url": url},
        )
        bootstrap.issue_api_delegate(settings)  # the API signs the ledger's calls with a delegate key
        with _client(settings) as client:
            _sign_in(client, OPERATOR_TOKEN)
            page = client.get(f"/console/billing?tenant={tenant_id}&day=2024-01-01")
            assert page.status_code == 200, page.text[:1000]
            ops = bearer(OPERATOR_TOKEN)
            (invoice,) = client.get("/v1/invoices?period=2024-01", headers=ops).json()["items"]
            document = client.get(f"/v1/invoices/{invoice['id']}", headers=ops).json()
            report = client.get(
                "/v1/billing/reconciliation", params={"tenant_id": tenant_id, "day": "2024-01-01"}, headers=ops
            ).json()
        periods = _text(page.text.split('id="periods"')[1].split("</table>")[0])
        assert "2024-01 (shown) closed" in periods
        invoices = _text(page.text.split('id="invoices"')[1].split("</table>")[0])
        on_demand = sum(line["amount_micro"] for line in document["lines"] if line["price_class"] == "on_demand")
        assert on_demand == invoice["total_micro"] > 0
        total = f"{invoice['total_micro'] / 1e6:,.2f}"
        assert f"{invoice['id']} {tenant_id} final {invoice['line_count']}" in invoices
        assert f"{on_demand / 1e6:,.2f} 0.00 0.00 {total}" in invoices  # on-demand, reserved, preemptible, total
        reconciliation = _text(page.text.split('id="reconciliation"')[1].split("</table>")[0])
        (row,) = report["allocations"]
        held, metered = row["held_gpu_ms"] / HOUR, row["metered_gpu_ms"] / HOUR
        assert (held, metered) == (16.0, 12.0)  # 2 h held, 90 min metered, of 8 GPUs
        assert f"{alloc_id} on-demand {held:,.2f} {metered:,.2f} {metered - held:,.2f} 1" in reconciliation
        verdict = _text(page.text.split('id="reconciliation-verdict"')[1].split("</p>")[0])
        assert report["ok"] is False and "Not reconciled" in verdict and f"{report['gap_count']} gap" in verdict
