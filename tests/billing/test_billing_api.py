"""The control plane's billing API and `gpucloud invoices`: the ledger's data over real HTTP,
each tenant seeing only its own, operators the price book and the reconciliation report."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpucloud.db import session_scope
from gpucloud.devstack.stack import free_port
from gpucloud.ledger.periods import period_bounds
from gpucloud.ledger.pricing import Rate
from gpucloud.models.tables import Allocation
from support.forked import run_cli
from support.ledger_auth import auth_for, post_usage
from support.ledger_harness import ledger_in_thread

pytestmark = pytest.mark.integration

JAN = period_bounds("2024-01")[0]
MINUTE = 60_000
PRICE = 2_490_000
PROBLEMS = "https://gpucloud.dev/problems/"


@pytest.fixture
def ledger_url(tmp_path: Path) -> Iterator[str]:
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url:
        price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "H100", "price_per_hour_micro": PRICE}]}
        assert httpx.post(auth=auth_for(url), url=f"{url}/v1/price-book/versions", json=price_book).status_code == 201
        yield url


def add_allocation(db_url: str, tenant_id: str) -> str:
    with session_scope(db_url) as session:
        allocation = Allocation(tenant_id=tenant_id, gpu_type="H100", node_count=1, region="us-east-1")
        session.add(allocation)
        session.flush()
        return allocation.id


def meter(ledger_url: str, *, tenant_id: str, allocation_id: str, node: str, start: int, count: int) -> None:
    post_usage(ledger_url, tenant_id=tenant_id, allocation_id=allocation_id, node=node, start_ms=start, minutes=count)


def test_tenants_see_their_own_usage_and_invoices_only(db_url, make_harness, ledger_url) -> None:
    h = make_harness(db_url, nodes=1, ledger={"url": ledger_url})
    acme_id, acme_key = h.new_tenant()
    other_id, other_key = h.new_tenant()
    acme_alloc, other_alloc = add_allocation(db_url, acme_id), add_allocation(db_url, other_id)
    meter(ledger_url, tenant_id=acme_id, allocation_id=acme_alloc, node="n1", start=JAN, count=30)
    meter(ledger_url, tenant_id=other_id, allocation_id=other_alloc, node="n2", start=JAN, count=7)
    now = time.time_ns() // 1_000_000
    meter(ledger_url, tenant_id=acme_id, allocation_id=acme_alloc, node="n1-now", start=now - 10 * MINUTE, count=2)

    with h.client(acme_key) as acme, h.client(other_key) as other, h.operator as op:
        january = acme.get("/v1/usage", params={"allocation_id": acme_alloc, "period": "2024-01"}).json()
        assert (january["gpu_ms"], january["period"]) == (30 * 8 * MINUTE, "2024-01")
        assert january["amount_micro"] == Rate(PRICE).amount_for(30 * 8 * MINUTE)
        assert acme.get("/v1/usage").json()["gpu_ms"] == 32 * 8 * MINUTE
        foreign = acme.get("/v1/usage", params={"allocation_id": other_alloc})
        assert foreign.status_code == 404 and foreign.json()["type"] == PROBLEMS + "not-found"
        assert acme.get("/v1/usage", params={"period": "2024-13"}).status_code == 422
        assert op.get("/v1/usage").status_code == 422  # operators name the tenant
        assert op.get("/v1/usage", params={"tenant_id": other_id}).json()["gpu_ms"] == 7 * 8 * MINUTE

        draft = acme.get("/v1/invoices:draft")
        assert draft.status_code == 200 and draft.headers["invoice-status"] == "draft"
        assert json.loads(draft.content)["lines"][0]["quantity"] == 2 * 8 * MINUTE

        assert acme.get("/v1/invoices").json() == {"items": []}
        assert httpx.post(auth=auth_for(ledger_url), url=f"{ledger_url}/v1/periods/2024-01:close").status_code == 200
        [mine] = acme.get("/v1/invoices").json()["items"]
        assert (mine["period_id"], mine["tenant_id"], mine["line_count"]) == ("2024-01", acme_id, 1)
        invoice = acme.get(f"/v1/invoices/{mine['id']}")
        assert (
            invoice.content
            == httpx.get(auth=auth_for(ledger_url), url=f"{ledger_url}/v1/periods/2024-01/invoices/{acme_id}").content
        )
        assert invoice.headers["etag"] == f'"{mine["sha256"]}"'
        assert acme.get(f"/v1/invoices/{mine['id']}").content == invoice.content  # byte for byte, every time
        assert other.get(f"/v1/invoices/{mine['id']}").status_code == 404
        assert [i["tenant_id"] for i in op.get("/v1/invoices").json()["items"]] == sorted([acme_id, other_id])
        assert op.get(f"/v1/invoices/{mine['id']}").content == invoice.content

        env = {
            **os.environ,
            "GPUCLOUD_API__PORT": str(h.settings.api.port),
            "GPUCLOUD_API_KEY": acme_key,
            "COLUMNS": "200",
        }
        listing = run_cli(["invoices"], env=env, cwd=h.log_dir)
        assert listing.returncode == 0, listing.stderr
        assert "2024-01" in listing.stdout and acme_id in listing.stdout and other_id not in listing.stdout
        shown = run_cli(["invoices", "show", str(mine["id"])], env=env, cwd=h.log_dir)
        assert shown.returncode == 0, shown.stderr
        assert f"{mine['total_micro'] // 1_000_000}.{mine['total_micro'] % 1_000_000:06d}" in shown.stdout
        assert mine["sha256"] in shown.stdout
        draft = run_cli(["invoices", "draft"], env=env, cwd=h.log_dir)
        assert draft.returncode == 0 and "draft" in draft.stdout and acme_alloc in draft.stdout, draft.stderr
        as_json = run_cli(["invoices", "show", str(mine["id"]), "-o", "json"], env=env, cwd=h.log_dir)
        shown_json = json.loads(as_json.stdout)
        assert shown_json["sha256"] == mine["sha256"] and shown_json["invoice"]["total_micro"] == mine["total_micro"]


def test_operators_read_the_price_book_and_reconciliation(db_url, make_harness, ledger_url) -> None:
    h = make_harness(db_url, nodes=1, ledger={"url": ledger_url})
    _tenant_id, key = h.new_tenant()
    with h.operator as op, h.client(key) as tenant:
        assert [v["prices"] for v in op.get("/v1/billing/price-book/versions").json()] == [
            [{"gpu_type": "H100", "price_per_hour_micro": PRICE, "price_class": "on_demand"}]
        ]
        later = {"effective_from_ms": JAN, "prices": [{"gpu_type": "H100", "price_per_hour_micro": 2_000_000}]}
        assert op.post("/v1/billing/price-book/versions", json=later).status_code == 201
        assert len(op.get("/v1/billing/price-book/versions").json()) == 2
        report = op.get("/v1/billing/reconciliation", params={"tenant_id": "t-x", "day": "2024-01-05"}).json()
        assert (report["day"], report["ok"]) == ("2024-01-05", True)
        assert tenant.get("/v1/billing/price-book/versions").status_code == 403
        assert (
            tenant.get("/v1/billing/reconciliation", params={"tenant_id": "t-x", "day": "2024-01-05"}).status_code
            == 403
        )


def test_a_ledger_that_does_not_answer_is_a_503(db_url, make_harness) -> None:
    h = make_harness(db_url, nodes=1, ledger={"url": f"http://127.0.0.1:{free_port()}"})
    _tenant_id, key = h.new_tenant()
    with h.client(key) as tenant:
        answer = tenant.get("/v1/invoices")
        assert answer.status_code == 503 and answer.json()["type"] == PROBLEMS + "ledger-unavailable"
    unbilled = make_harness(db_url, nodes=1)
    _tenant_id, key = unbilled.new_tenant()
    with unbilled.client(key) as tenant:
        unbilled_answer = tenant.get("/v1/usage")
        assert unbilled_answer.status_code == 501
        assert unbilled_answer.json()["type"] == PROBLEMS + "billing-not-configured"
