"""Issue 37, item 11: input that cannot mean anything is a 422 naming the field, on the API and on
the ledger behind it, never a server error; and a server error names no exception.

Before: `GET /v1/usage?period=0000-01` was a 500 (no year 0), the draft invoice of that period a
503 (the ledger's 500 behind it, which no retry fixes), an invoice id past 64 bits a 503 (the
ledger's query overflowed), a body that is not UTF-8 a bare 400 that no operation documents, and
the ledger's 500 carried the exception's text (SQL, paths, another caller's data)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpucloud import bootstrap
from gpucloud.api.app import create_app as api_app
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.ledger.api import invoices
from gpucloud.ledger.app import create_app as ledger_app
from gpucloud.services import tenants
from gpucloud.web.service_tokens import Verifier
from support.ledger_auth import LedgerAuth

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

NOT_UTF8 = b"\xff\xfe{"


def _field(answer) -> str:
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    document = answer.json()
    return document.get("field") or document["errors"][0]["field"]


@pytest.fixture
def ledger(tmp_path: Path):
    auth = LedgerAuth(tmp_path)
    app = ledger_app(f"sqlite:///{tmp_path / 'ledger.db'}", control_plane=Verifier(auth.issuer.public_key))
    with TestClient(app, raise_server_exceptions=False) as client:
        client.auth = auth
        yield client


def test_the_ledger_refuses_periods_and_ids_that_cannot_exist(ledger) -> None:
    for period in ("0000-01", "1969-12", "9999-12"):
        assert _field(ledger.get(f"/v1/periods/{period}/invoices")) == "period_id", period
        assert _field(ledger.get("/v1/invoices", params={"period_id": period})) == "period_id", period
    assert ledger.get("/v1/periods/2024-01/invoices").status_code == 200
    assert _field(ledger.get("/v1/invoices/99999999999999999999")) == "invoice_id"
    assert ledger.get(f"/v1/invoices/{2**63 - 1}").status_code == 404


def test_a_body_that_is_not_utf8_is_the_ledgers_422(ledger) -> None:
    answer = ledger.post("/v1/price-book/versions", content=NOT_UTF8, headers={"content-type": "application/json"})
    assert _field(answer) == "body"


def test_the_ledgers_server_error_names_no_exception(ledger, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("SELECT secret FROM tenants WHERE password='hunter2'")

    monkeypatch.setattr(invoices, "find_invoices", broken)
    answer = ledger.get("/v1/invoices")
    assert answer.status_code == 500
    assert "hunter2" not in answer.text and "RuntimeError" not in answer.text
    assert answer.json()["type"].endswith("internal-error")


def test_the_api_refuses_periods_ids_and_bodies_that_cannot_mean_anything(tmp_path: Path, db_url: str) -> None:
    # The ledger's address answers nothing: every refusal below comes before the API would ask it.
    settings = Settings(data_dir=tmp_path, database={"url": db_url}, ledger={"url": "http://127.0.0.1:9"})
    bootstrap.issue_api_delegate(settings)  # the API signs its ledger calls with a delegate, as under `up`
    app = api_app(settings, temporal=object())  # type: ignore[arg-type]
    headers = {"Authorization": f"Bearer {settings.operator_token}"}
    with TestClient(app, raise_server_exceptions=False, headers=headers) as api:
        for path in ("/v1/usage", "/v1/invoices", "/v1/invoices:draft"):
            assert _field(api.get(path, params={"period": "0000-01", "tenant_id": "t"})) == "period", path
        assert _field(api.get("/v1/invoices/99999999999999999999")) == "invoice_id"
        for tenant in ("", "a/b", "x" * 65):  # would name another path of the ledger, or none
            answer = api.get("/v1/invoices:draft", params={"tenant_id": tenant})
            assert _field(answer) == "tenant_id", (tenant, answer.request.url)
        answer = api.post("/v1/nodes/n-1/cordon", content=NOT_UTF8, headers={"content-type": "application/json"})
        assert _field(answer) == "body"
        assert "not valid JSON" in answer.json()["detail"]


def test_a_replayed_refusal_is_still_a_problem_document(tmp_path: Path, db_url: str) -> None:
    """The first answer for an Idempotency-Key is kept and replayed: a 404 replayed as plain JSON
    contradicted the document (found by schemathesis)."""
    settings = Settings(data_dir=tmp_path, database={"url": db_url})
    with session_scope(db_url) as session:
        *_, key = tenants.create(session, name="replayer", quotas=[], actor="operator:test")
    app = api_app(settings, temporal=object())  # type: ignore[arg-type]
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "evaluate-once"}
    path = f"/v1/models/nope/versions/{'0' * 64}/evaluate"
    with TestClient(app, raise_server_exceptions=False, headers=headers) as api:
        first, again = (api.post(path, json={"evaluator": "sanity"}) for _ in range(2))
    assert first.status_code == again.status_code == 404
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert first.headers["content-type"] == again.headers["content-type"] == "application/problem+json"
