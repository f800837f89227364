"""Price classes and capacity reservations on the invoice: the bill says what was bought.

Invoice lines are held time by price class (on-demand, preemptible) and reservations' windows
at the reserved price, with quantity (GPU-ms) and price; the meters' usage and its difference
to held time is in the reconciliation report.
"""

from __future__ import annotations

import functools
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
MINUTE, HOUR = 60_000, 3_600_000
ON_DEMAND, PREEMPTIBLE, RESERVED = 2_490_000, 990_000, 1_790_000
PRICE_BOOK = {
    "effective_from_ms": 0,
    "prices": [
        {"gpu_type": "H100", "price_per_hour_micro": ON_DEMAND},
        {"gpu_type": "H100", "price_class": "preemptible", "price_per_hour_micro": PREEMPTIBLE},
        {"gpu_type": "H100", "price_class": "reserved", "price_per_hour_micro": RESERVED},
    ],
}


@pytest.fixture(params=backends())
def ledger(request, tmp_path: Path) -> Iterator[httpx.Client]:
    with priced_ledger(request.param, tmp_path, PRICE_BOOK) as client:
        yield client


event = functools.partial(post_allocation_event, gpu_type="H100")


def held(ledger: httpx.Client, allocation: str, start: int, minutes: int, price_class: str | None = None) -> None:
    """One node held for ``minutes`` from ``start``, as the control plane reports it."""
    event(ledger, allocation, "start", start, price_class=price_class)
    event(ledger, allocation, "node_added", start, f"{allocation}-n1")
    event(ledger, allocation, "node_removed", start + minutes * MINUTE, f"{allocation}-n1")
    event(ledger, allocation, "end", start + minutes * MINUTE)


def meter(ledger: httpx.Client, allocation: str, minutes: list[int], *, start: int) -> None:
    samples = [
        {
            "node_id": f"{allocation}-n1",
            "seq": minute,
            "allocation_id": allocation,
            "tenant_id": "t1",
            "gpu_type": "H100",
            "gpu_count": 8,
            "start_ms": start + minute * MINUTE,
            "end_ms": start + (minute + 1) * MINUTE,
        }
        for minute in minutes
    ]
    answer = ledger.post("/v1/usage:batch", json={"samples": samples}).json()
    assert answer["accepted"] == len(samples), answer


def reservation(
    ledger: httpx.Client, reservation_id: str, start: int, end: int, nodes: int = 1, gpu_type: str = "H100"
) -> httpx.Response:
    body = {
        "reservation_id": reservation_id,
        "tenant_id": "t1",
        "gpu_type": gpu_type,
        "node_count": nodes,
        "start_ms": start,
        "end_ms": end,
    }
    return ledger.post("/v1/reservations", json=body)


def invoice(ledger: httpx.Client, period: str) -> dict:
    closed = ledger.post(f"/v1/periods/{period}:close")
    assert closed.status_code == 200, closed.text
    found = ledger.get(f"/v1/periods/{period}/invoices/t1")
    assert found.status_code == 200, found.text
    return json.loads(found.content)


def lines(document: dict) -> list[tuple]:
    return [
        (
            line["kind"],
            line["allocation_id"] or line["reservation_id"],
            line["price_class"],
            line["quantity"],
            line["price"],
        )
        for line in document["lines"]
    ]


def test_on_demand_and_preemptible_allocations_of_the_same_held_time_bill_at_their_prices(
    ledger: httpx.Client,
) -> None:
    start = JAN + 2 * 86_400_000
    held(ledger, "a-od", start, 60)
    held(ledger, "a-pre", start, 60, price_class="preemptible")
    # The agents' meters are provisional (rated on demand while the period is open) and not billed.
    meter(ledger, "a-pre", list(range(50)), start=start)
    draft = json.loads(ledger.get("/v1/periods/2024-01/draft-invoices/t1").content)
    document = invoice(ledger, "2024-01")
    gpu_ms = 60 * MINUTE * 8
    assert lines(document) == [
        ("allocation", "a-od", "on_demand", gpu_ms, ON_DEMAND),
        ("allocation", "a-pre", "preemptible", gpu_ms, PREEMPTIBLE),
    ]
    amounts = [line["amount_micro"] for line in document["lines"]]
    assert amounts == [Rate(ON_DEMAND).amount_for(gpu_ms), Rate(PREEMPTIBLE).amount_for(gpu_ms)]
    assert document["total_micro"] == sum(amounts) == draft["total_micro"]
    assert document["schema"] == "gpucloud.invoice/v2"
    # Closing again reproduces the same bytes.
    assert invoice(ledger, "2024-01") == document


def test_a_preemptible_allocation_whose_meters_match_is_still_labelled_preemptible(tmp_path: Path) -> None:
    """Without a preemptible price it falls back to on-demand: same money, still its own class."""
    book = {"effective_from_ms": 0, "prices": [{"gpu_type": "H100", "price_per_hour_micro": ON_DEMAND}]}
    with priced_ledger("sqlite", tmp_path, book) as ledger:
        start = JAN + 3 * 86_400_000
        held(ledger, "a-pre", start, 30, price_class="preemptible")
        meter(ledger, "a-pre", list(range(30)), start=start)  # exactly what was held
        document = invoice(ledger, "2024-01")
        gpu_ms = 30 * MINUTE * 8
        assert lines(document) == [("allocation", "a-pre", "preemptible", gpu_ms, ON_DEMAND)]
        assert document["total_micro"] == Rate(ON_DEMAND).amount_for(gpu_ms)


def test_a_reservation_used_for_half_its_window_is_billed_for_all_of_it(ledger: httpx.Client) -> None:
    start = JAN + 4 * 86_400_000
    assert reservation(ledger, "r1", start, start + 2 * HOUR, nodes=2).status_code == 201
    # One reserved-class allocation on one of the two nodes for an hour: covered, adds nothing.
    held(ledger, "a-res", start, 60, price_class="reserved")
    meter(ledger, "a-res", list(range(60)), start=start)
    document = invoice(ledger, "2024-01")
    gpu_ms = 2 * HOUR * 2 * 8
    assert lines(document) == [("reservation", "r1", "reserved", gpu_ms, RESERVED)]
    assert document["total_micro"] == Rate(RESERVED).amount_for(gpu_ms)
    assert invoice(ledger, "2024-01") == document


def test_a_reservation_across_the_period_end_is_split_between_the_periods(ledger: httpx.Client) -> None:
    assert reservation(ledger, "r1", FEB - 3 * HOUR, FEB + HOUR).status_code == 201
    january, february = invoice(ledger, "2024-01"), invoice(ledger, "2024-02")
    assert [(line["usage_period"], line["quantity"]) for line in january["lines"]] == [("2024-01", 3 * HOUR * 8)]
    assert [(line["usage_period"], line["quantity"]) for line in february["lines"]] == [("2024-02", HOUR * 8)]
    assert february["total_micro"] == Rate(RESERVED).amount_for(HOUR * 8)


def test_a_resent_reservation_is_a_no_op_and_a_different_one_under_its_id_is_a_conflict(ledger: httpx.Client) -> None:
    start = JAN + 5 * 86_400_000
    first = reservation(ledger, "r1", start, start + HOUR)
    assert first.status_code == 201 and first.json()["gpus_per_node"] == 8
    again = reservation(ledger, "r1", start, start + HOUR)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    conflict = reservation(ledger, "r1", start, start + 2 * HOUR)
    assert conflict.status_code == 409 and conflict.json()["field"] == "reservation_id"
    assert [r["reservation_id"] for r in ledger.get("/v1/reservations", params={"tenant_id": "t1"}).json()] == ["r1"]
    assert invoice(ledger, "2024-01")["total_micro"] == Rate(RESERVED).amount_for(HOUR * 8)


def test_a_reservation_sent_in_another_case_is_billed_as_the_catalog_names_it(ledger: httpx.Client) -> None:
    """The price book names `H100`: a reservation stored as `h100` would never meet its price."""
    start = JAN + 7 * 86_400_000
    first = reservation(ledger, "r1", start, start + HOUR, gpu_type="h100")
    assert first.status_code == 201 and first.json()["gpu_type"] == "H100", first.text
    again = reservation(ledger, "r1", start, start + HOUR)  # the same content, spelt as the catalog does
    assert again.status_code == 200 and again.json()["replayed"] is True
    document = invoice(ledger, "2024-01")
    assert lines(document) == [("reservation", "r1", "reserved", HOUR * 8, RESERVED)]


def test_a_reservation_of_a_gpu_type_the_catalog_does_not_sell_is_refused(ledger: httpx.Client) -> None:
    answer = ledger.post(
        "/v1/reservations",
        json={"reservation_id": "r", "tenant_id": "t1", "gpu_type": "Z9", "node_count": 1, "start_ms": 0, "end_ms": 1},
    )
    assert answer.status_code == 422 and answer.json()["field"] == "gpu_type"
    backwards = reservation(ledger, "r2", JAN + HOUR, JAN)
    assert backwards.status_code == 422 and backwards.json()["field"] == "end_ms"


def test_the_reconciliation_report_shows_metered_against_held_per_allocation(ledger: httpx.Client) -> None:
    start = JAN + 6 * 86_400_000
    held(ledger, "a1", start, 60, price_class="preemptible")
    meter(ledger, "a1", list(range(45)), start=start)  # the agent stopped 15 minutes early
    report = ledger.get("/v1/reconciliation", params={"tenant_id": "t1", "day": "2024-01-07"}).json()
    (allocation,) = report["allocations"]
    assert allocation["price_class"] == "preemptible"
    assert (allocation["held_gpu_ms"], allocation["metered_gpu_ms"]) == (60 * MINUTE * 8, 45 * MINUTE * 8)
    assert allocation["metered_minus_held_gpu_ms"] == -15 * MINUTE * 8
    # The invoice bills the held hour, not the metered 45 minutes.
    assert lines(invoice(ledger, "2024-01")) == [("allocation", "a1", "preemptible", 60 * MINUTE * 8, PREEMPTIBLE)]


def test_a_price_class_on_an_event_other_than_start_is_refused(ledger: httpx.Client) -> None:
    body = {
        "event_id": "e",
        "allocation_id": "a",
        "tenant_id": "t1",
        "kind": "end",
        "at_ms": JAN,
        "price_class": "preemptible",
    }
    answer = ledger.post("/v1/allocation-events", json=body)
    assert answer.status_code == 422 and answer.json()["field"] == "price_class"
