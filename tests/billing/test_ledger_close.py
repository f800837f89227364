"""The pure period close: deterministic lines, canonical bytes, adjustments, integrity checks."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from gpucloud.ledger.close import CloseIntegrityError, LineAggregate, build_invoices, canonical_json
from gpucloud.ledger.pricing import PriceBookHistory, PriceBookVersion, Rate

pytestmark = pytest.mark.unit

PRICES = PriceBookHistory([PriceBookVersion(1, 0, {"h100": 2_490_000, "b200": 5_000_000}, {("t1", "h100"): 1250})])


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


def test_invoices_are_canonical_and_independent_of_input_order() -> None:
    invoices = build_invoices("2024-02", usage=USAGE, reversals=REVERSALS, prices=PRICES)
    shuffled = USAGE[:]
    random.Random(7).shuffle(shuffled)
    again = build_invoices("2024-02", usage=shuffled, reversals=REVERSALS, prices=PRICES)
    assert [i.body for i in invoices] == [i.body for i in again]
    assert [i.tenant_id for i in invoices] == ["t1", "t2"]
    first = invoices[0]
    assert first.body == canonical_json(json.loads(first.body))
    assert first.sha256 == hashlib.sha256(first.body).hexdigest()


def test_lines_are_kinded_and_totalled() -> None:
    t1 = build_invoices("2024-02", usage=USAGE, reversals=REVERSALS, prices=PRICES)[0]
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
    assert document["total_micro"] == t1.total_micro
    assert document["period"]["id"] == "2024-02"


def test_a_posted_amount_that_disagrees_with_the_price_book_stops_the_close() -> None:
    tampered = LineAggregate("t1", "a1", "h100", "2024-02", 1, 1, 3_600_000, 1)
    with pytest.raises(CloseIntegrityError):
        build_invoices("2024-02", usage=[tampered], reversals=[], prices=PRICES)


def test_canonical_json_is_compact_sorted_utf8() -> None:
    assert canonical_json({"b": 1, "a": [2, {"d": "é", "c": None}]}) == '{"a":[2,{"c":null,"d":"é"}],"b":1}'.encode()
