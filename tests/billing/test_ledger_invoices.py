"""The ledger's read side for billing: the periods to close, invoices by tenant and id, drafts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpucloud.ledger.periods import period_bounds, period_of
from gpucloud.ledger.pricing import Rate
from support.ledger_harness import backends, priced_ledger

pytestmark = pytest.mark.integration

JAN, FEB = period_bounds("2024-01")[0], period_bounds("2024-02")[0]
MINUTE = 60_000
PRICE = 2_490_000


@pytest.fixture(params=backends())
def ledger(request, tmp_path: Path) -> Iterator[httpx.Client]:
    price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "h100", "price_per_hour_micro": PRICE}]}
    with priced_ledger(request.param, tmp_path, price_book) as client:
        yield client


def ingest(client: httpx.Client, *, node: str, tenant: str, start: int, count: int, allocation: str = "a1") -> None:
    samples = [
        {
            "node_id": node,
            "seq": seq,
            "allocation_id": allocation,
            "tenant_id": tenant,
            "gpu_type": "h100",
            "gpu_count": 8,
            "start_ms": start + seq * MINUTE,
            "end_ms": start + (seq + 1) * MINUTE,
        }
        for seq in range(count)
    ]
    answer = client.post("/v1/usage:batch", json={"samples": samples}).json()
    assert answer["accepted"] == count, answer


def test_periods_run_from_the_first_posting_to_now(ledger: httpx.Client) -> None:
    assert ledger.get("/v1/periods").json() == []
    ingest(ledger, node="n1", tenant="t1", start=JAN, count=3)
    periods = ledger.get("/v1/periods").json()
    assert periods[0] == {"period_id": "2024-01", "start_ms": JAN, "end_ms": FEB, "ended": True, "closed_ms": None}
    assert (periods[-1]["period_id"], periods[-1]["ended"]) == (period_of(time.time_ns() // 1_000_000), False)
    assert ledger.post("/v1/periods/2024-01:close").status_code == 200
    closed = ledger.get("/v1/periods").json()
    assert closed[0]["closed_ms"] is not None and all(p["closed_ms"] is None for p in closed[1:])


def test_a_draft_is_what_the_close_then_stores_byte_for_byte(ledger: httpx.Client) -> None:
    ingest(ledger, node="n1", tenant="t1", start=JAN, count=30)
    ingest(ledger, node="n2", tenant="t2", start=JAN, count=5, allocation="a2")
    draft = ledger.get("/v1/periods/2024-01/draft-invoices/t1")
    assert draft.status_code == 200
    assert draft.json()["total_micro"] == Rate(PRICE).amount_for(30 * 8 * MINUTE)
    nothing = ledger.get("/v1/periods/2024-01/draft-invoices/t-none").json()
    assert (nothing["lines"], nothing["total_micro"]) == ([], 0)

    ledger.post("/v1/periods/2024-01:close").raise_for_status()
    stored = ledger.get("/v1/periods/2024-01/invoices/t1")
    assert stored.content == draft.content
    assert ledger.get("/v1/periods/2024-01/draft-invoices/t1").status_code == 409  # final now

    mine = ledger.get("/v1/invoices", params={"tenant_id": "t1"}).json()
    assert [(i["period_id"], i["tenant_id"]) for i in mine] == [("2024-01", "t1")]
    assert len(ledger.get("/v1/invoices").json()) == 2
    by_id = ledger.get(f"/v1/invoices/{mine[0]['id']}", params={"tenant_id": "t1"})
    assert by_id.content == stored.content and by_id.headers["etag"] == f'"{mine[0]["sha256"]}"'
    # Another tenant's invoice is not found, just like a missing one.
    assert ledger.get(f"/v1/invoices/{mine[0]['id']}", params={"tenant_id": "t2"}).status_code == 404
    assert ledger.get("/v1/invoices/999999").status_code == 404
