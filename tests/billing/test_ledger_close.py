"""The pure period close: deterministic lines, canonical bytes, adjustments, integrity checks."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from gpucloud.ledger.close import (
    CloseIntegrityError,
    ItemAggregate,
    LineAggregate,
    build_invoices,
    build_invoices_v1,
    canonical_json,
)
from gpucloud.ledger.pricing import PriceBookHistory, PriceBookVersion, Rate

pytestmark = pytest.mark.unit

PRICES = PriceBookHistory(
    [
        PriceBookVersion(
            1,
            0,
            {"h100": 2_490_000, "b200": 5_000_000},
            {("t1", "h100"): 1250},
            class_prices={("h100", "preemptible"): 1_000_000, ("h100", "reserved"): 1_800_000},
        )
    ]
)


def line(tenant: str, allocation: str, gpu_type: str, period: str, gpu_ms: int, *, count: int = 1) -> LineAggregate:
    rate = PRICES.by_id(1).rate_for(tenant, gpu_type)
    return LineAggregate(tenant, allocation, gpu_type, period, 1, count, gpu_ms, rate.amount_for(gpu_ms))


USAGE = [
    line("t1", "a1", "h100", "2024-02", 3_600_000 * 8, count=60),
    line("t1", "a2", "b200", "2024-02", 1_234_567, count=3),
    line("t1", "a1", "h100", "2024-01", 60_000, count=1),
    line("t2", "a9", "h100", "2024-02", 999, count=1),
]
REVERSALS = [LineAggregate("t1", "a2", "b200", "2024-02", 1, 3, -1_234_567, -Rate(5_000_000).amount_for(1_234_567))]


def item(
    tenant: str, kind: str, item_id: str, gpu_type: str, price_class: str, period: str, gpu_ms: int
) -> ItemAggregate:
    rate = PRICES.by_id(1).rate_for(tenant, gpu_type, price_class)
    sign = -1 if kind == "reversal" else 1
    amount = sign * rate.amount_for(gpu_ms)
    return ItemAggregate(
        tenant, kind, item_id, kind == "reservation", gpu_type, price_class, period, 1, sign * gpu_ms, amount
    )


ITEMS = [
    item("t1", "allocation", "a1", "h100", "on_demand", "2024-02", 3_600_000 * 8),
    item("t1", "allocation", "a3", "h100", "preemptible", "2024-02", 3_600_000 * 8),
    item("t1", "reservation", "r1", "h100", "reserved", "2024-02", 3_600_000 * 16),
    item("t1", "allocation", "a4", "h100", "reserved", "2024-02", 0),
    item("t1", "allocation", "a2", "b200", "on_demand", "2024-02", 1_234_567),
    item("t1", "reversal", "a2", "b200", "on_demand", "2024-02", 1_234_567),
    item("t2", "allocation", "a9", "h100", "on_demand", "2024-02", 999),
]


def test_invoices_are_canonical_and_independent_of_input_order() -> None:
    invoices = build_invoices("2024-02", items=ITEMS, meter_usage=USAGE, prices=PRICES)
    shuffled = ITEMS[:]
    random.Random(7).shuffle(shuffled)
    again = build_invoices("2024-02", items=shuffled, meter_usage=USAGE, prices=PRICES)
    assert [i.body for i in invoices] == [i.body for i in again]
    assert [i.tenant_id for i in invoices] == ["t1", "t2"]
    first = invoices[0]
    assert first.body == canonical_json(json.loads(first.body))
    assert first.sha256 == hashlib.sha256(first.body).hexdigest()


def test_lines_are_held_time_by_price_class_with_quantity_and_price() -> None:
    t1 = build_invoices("2024-02", items=ITEMS, meter_usage=USAGE, prices=PRICES)[0]
    lines = [(ln.kind, ln.reservation_id or ln.allocation_id, ln.price_class, ln.quantity, ln.price) for ln in t1.lines]
    # The reserved-class allocation's nothing is left out; the reversal follows its line's kind.
    assert lines == [
        ("reservation", "r1", "reserved", 3_600_000 * 16, 1_800_000),
        ("allocation", "a1", "on_demand", 3_600_000 * 8, 2_490_000),
        ("allocation", "a2", "on_demand", 1_234_567, 5_000_000),
        ("allocation", "a3", "preemptible", 3_600_000 * 8, 1_000_000),
        ("reversal", "a2", "on_demand", -1_234_567, 5_000_000),
    ]
    by_id = {(ln.kind, ln.allocation_id or ln.reservation_id): ln for ln in t1.lines}
    # 8 GPU-hours at 2.49, less t1's 12.5 %; 8 at the preemptible 1.00 less 12.5 %; 16 at 1.80.
    assert by_id[("allocation", "a1")].amount_micro == 8 * 2_178_750
    assert by_id[("allocation", "a3")].amount_micro == 8 * 875_000
    assert by_id[("reservation", "r1")].amount_micro == 16 * 1_575_000
    assert by_id[("reservation", "r1")].allocation_id is None
    assert t1.total_micro == sum(ln.amount_micro for ln in t1.lines)
    document = json.loads(t1.body)
    assert document["schema"] == "gpucloud.invoice/v2"
    assert (document["quantity_unit"], document["total_micro"]) == ("GPU-ms", t1.total_micro)
    assert {"quantity", "price", "price_class"} <= set(document["lines"][0])


def test_a_line_whose_amount_is_not_the_price_of_its_quantity_stops_the_close() -> None:
    wrong = ItemAggregate("t1", "allocation", "a1", False, "h100", "preemptible", "2024-02", 1, 3_600_000, 2_178_750)
    with pytest.raises(CloseIntegrityError, match="preemptible"):
        build_invoices("2024-02", items=[wrong], meter_usage=[], prices=PRICES)


def test_v1_lines_are_kinded_and_totalled() -> None:
    t1 = build_invoices_v1("2024-02", usage=USAGE, reversals=REVERSALS, prices=PRICES)[0]
    kinds = [(line.allocation_id, line.kind, line.usage_period) for line in t1.lines]
    assert kinds == [
        ("a1", "usage", "2024-02"),
        ("a1", "adjustment", "2024-01"),
        ("a2", "usage", "2024-02"),
        ("a2", "reversal", "2024-02"),
    ]
    assert t1.lines[0].amount_micro == 8 * 2_178_750
    assert t1.lines[0].discount_bp == 1250
    assert t1.total_micro == sum(line.amount_micro for line in t1.lines)
    document = json.loads(t1.body)
    assert (document["schema"], document["total_micro"]) == ("gpucloud.invoice/v1", t1.total_micro)
    assert document["period"]["id"] == "2024-02"


def test_a_posted_amount_that_disagrees_with_the_price_book_stops_the_close() -> None:
    tampered = LineAggregate("t1", "a1", "h100", "2024-02", 1, 1, 3_600_000, 1)
    with pytest.raises(CloseIntegrityError):
        build_invoices("2024-02", items=[], meter_usage=[tampered], prices=PRICES)
    with pytest.raises(CloseIntegrityError):
        build_invoices_v1("2024-02", usage=[tampered], reversals=[], prices=PRICES)


def test_canonical_json_is_compact_sorted_utf8() -> None:
    assert canonical_json({"b": 1, "a": [2, {"d": "é", "c": None}]}) == '{"a":[2,{"c":null,"d":"é"}],"b":1}'.encode()
