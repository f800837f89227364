"""The bill follows what the tenant held (the control plane's allocation events), not what the
nodes' agents metered: a killed agent, an edited spool or a release from inside the node cannot
lower it, an allocation cancelled before it was ready costs nothing, and an event that reaches
the ledger after its period closed is trued up on the next invoice.

The real ledger over HTTP, on SQLite and on Postgres.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpucloud.ledger.periods import period_bounds
from gpucloud.ledger.pricing import Rate
from support.ledger_harness import backends, post_allocation_event, priced_ledger

pytestmark = pytest.mark.integration

JAN, FEB = period_bounds("2024-01")[0], period_bounds("2024-02")[0]
MINUTE = 60_000
PRICE = 2_490_000
RATE = Rate(PRICE)


@pytest.fixture(params=backends())
def ledger(request, tmp_path: Path) -> Iterator[httpx.Client]:
    price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "h100", "price_per_hour_micro": PRICE}]}
    with priced_ledger(request.param, tmp_path, price_book) as client:
        yield client


event = post_allocation_event


def meter(ledger: httpx.Client, allocation: str, node: str, minutes: list[int], *, start: int) -> dict:
    """What the node's agent ships: one sample per metered minute (offsets from ``start``)."""
    samples = [
        {
            "node_id": node,
            "seq": start // MINUTE + minute,
            "allocation_id": allocation,
            "tenant_id": "t1",
            "gpu_type": "h100",
            "gpu_count": 8,
            "start_ms": start + minute * MINUTE,
            "end_ms": start + (minute + 1) * MINUTE,
        }
        for minute in minutes
    ]
    return ledger.post("/v1/usage:batch", json={"samples": samples}).json()


def invoice(ledger: httpx.Client, period: str) -> dict:
    found = ledger.get(f"/v1/periods/{period}/invoices/t1")
    assert found.status_code == 200, found.text
    return json.loads(found.content)


def held_postings(ledger: httpx.Client) -> list[dict]:
    items = ledger.get("/v1/postings", params={"tenant_id": "t1", "page_size": 500}).json()["items"]
    return [p for p in items if p["source"] == "held"]


def test_an_agent_killed_for_ten_minutes_does_not_lower_the_bill(ledger: httpx.Client) -> None:
    start = JAN + 3 * 86_400_000
    event(ledger, "a1", "start", start)
    event(ledger, "a1", "node_added", start, "n1")
    event(ledger, "a1", "node_added", start, "n2")
    assert meter(ledger, "a1", "n1", list(range(60)), start=start)["accepted"] == 60
    # n2's tenant killed the agent for minutes 20-29: its meter has a 10-minute hole.
    assert meter(ledger, "a1", "n2", [*range(20), *range(30, 60)], start=start)["accepted"] == 50
    for node in ("n1", "n2"):
        event(ledger, "a1", "node_removed", start + 60 * MINUTE, node)
    event(ledger, "a1", "end", start + 60 * MINUTE)

    report = ledger.get("/v1/reconciliation", params={"tenant_id": "t1", "day": "2024-01-04"}).json()
    n2 = next(n for a in report["allocations"] for n in a["nodes"] if n["node_id"] == "n2")
    assert [(g["start_ms"], g["end_ms"]) for g in n2["gaps"]] == [(start + 20 * MINUTE, start + 30 * MINUTE)]

    draft = json.loads(ledger.get("/v1/periods/2024-01/draft-invoices/t1").content)
    assert ledger.post("/v1/periods/2024-01:close").status_code == 200
    billed = invoice(ledger, "2024-01")
    held_ms = 2 * 60 * 8 * MINUTE
    assert billed["total_micro"] == RATE.amount_for(held_ms) == draft["total_micro"]
    # One line: the held time, at the on-demand price. The meters' 110 minutes per node are in
    # the reconciliation report, not on the bill.
    lines = [(line["kind"], line["price_class"], line["quantity"], line["price"]) for line in billed["lines"]]
    assert lines == [("allocation", "on_demand", held_ms, RATE.price_per_hour_micro)]
    assert [p["gpu_ms"] for p in held_postings(ledger)] == [10 * 8 * MINUTE]

    # A close run again (the workflow retries) posts nothing more and stores the same bytes.
    assert ledger.post("/v1/periods/2024-01:close").status_code == 200
    assert len(held_postings(ledger)) == 1
    assert invoice(ledger, "2024-01") == billed


def test_metered_time_before_the_allocation_was_ready_is_credited(ledger: httpx.Client) -> None:
    start = JAN + 5 * 86_400_000
    ready = start + 90_000  # the agent metered from its provision; the allocation was ready 90 s in
    event(ledger, "a1", "start", ready)
    event(ledger, "a1", "node_added", ready, "n1")
    assert meter(ledger, "a1", "n1", list(range(1, 10)), start=start)["accepted"] == 9
    event(ledger, "a1", "node_removed", start + 10 * MINUTE, "n1")
    event(ledger, "a1", "end", start + 10 * MINUTE)
    ledger.post("/v1/periods/2024-01:close").raise_for_status()
    billed = invoice(ledger, "2024-01")
    assert billed["total_micro"] == RATE.amount_for((10 * MINUTE - 90_000) * 8)
    assert [line["quantity"] for line in billed["lines"]] == [(10 * MINUTE - 90_000) * 8]
    # The credit is a mirrored posting: the tenant's receivable is credited, revenue debited.
    (credit,) = held_postings(ledger)
    assert {(line["account"], line["side"]) for line in credit["lines"]} == {
        ("tenant:t1:receivable", "credit"),
        ("revenue:gpu:h100", "debit"),
    }


def test_an_allocation_cancelled_before_it_was_ready_costs_nothing(ledger: httpx.Client) -> None:
    start = JAN + 7 * 86_400_000
    event(ledger, "a1", "start", start + 5 * MINUTE)  # no node was ever added: it never became ready
    event(ledger, "a1", "end", start + 5 * MINUTE)
    # The nodes' agents metered their provisioning; the ledger refuses it for good.
    refused = meter(ledger, "a1", "n1", list(range(5)), start=start)
    assert refused["accepted"] == 0 and {r["problem"]["type"].rsplit("/", 1)[-1] for r in refused["rejections"]} == {
        "node-not-in-allocation"
    }
    ledger.post("/v1/periods/2024-01:close").raise_for_status()
    assert ledger.get("/v1/periods/2024-01/invoices/t1").status_code == 404
    assert held_postings(ledger) == []


def test_an_allocation_still_held_at_the_close_is_billed_to_its_end_and_a_late_end_is_credited_next(
    ledger: httpx.Client,
) -> None:
    start = FEB - 60 * MINUTE  # an hour before January ends; the control plane then lost the ledger
    event(ledger, "a1", "start", start)
    event(ledger, "a1", "node_added", start, "n1")
    ledger.post("/v1/periods/2024-01:close").raise_for_status()
    january = invoice(ledger, "2024-01")
    assert january["total_micro"] == RATE.amount_for(60 * 8 * MINUTE)  # no sample arrived: held time

    # The release happened 30 minutes before January ended; its events reach the ledger only now.
    event(ledger, "a1", "node_removed", FEB - 30 * MINUTE, "n1")
    event(ledger, "a1", "end", FEB - 30 * MINUTE)
    ledger.post("/v1/periods/2024-02:close").raise_for_status()
    february = invoice(ledger, "2024-02")
    (line,) = february["lines"]
    assert (line["kind"], line["usage_period"], line["quantity"]) == ("allocation", "2024-01", -30 * 8 * MINUTE)
    assert january["total_micro"] + february["total_micro"] == RATE.amount_for(30 * 8 * MINUTE)


def test_time_held_across_the_period_end_is_billed_in_each_period_once(ledger: httpx.Client) -> None:
    start = FEB - 10 * MINUTE
    event(ledger, "a1", "start", start)
    event(ledger, "a1", "node_added", start, "n1")
    assert meter(ledger, "a1", "n1", list(range(25)), start=start)["accepted"] == 25
    event(ledger, "a1", "node_removed", start + 25 * MINUTE, "n1")
    event(ledger, "a1", "end", start + 25 * MINUTE)
    ledger.post("/v1/periods/2024-01:close").raise_for_status()
    ledger.post("/v1/periods/2024-02:close").raise_for_status()
    january, february = invoice(ledger, "2024-01"), invoice(ledger, "2024-02")
    assert january["total_micro"] == RATE.amount_for(10 * 8 * MINUTE)
    assert february["total_micro"] == RATE.amount_for(15 * 8 * MINUTE)
    assert held_postings(ledger) == []  # meters and events agree: nothing to true up
