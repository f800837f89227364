"""The ledger as a real HTTP server, on SQLite (and on Postgres when GPUCLOUD_TEST_POSTGRES_URL is set)."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpucloud.ledger.periods import period_bounds
from gpucloud.ledger.pricing import Rate
from support.ledger_auth import LedgerAuth
from support.ledger_harness import backends, ledger_database_url, ledger_in_thread, priced_ledger

pytestmark = pytest.mark.integration

PROBLEM = "https://gpucloud.dev/problems/ledger/"
JAN, FEB = period_bounds("2024-01")[0], period_bounds("2024-02")[0]
MINUTE = 60_000
H100_PRICE = 2_490_000
PRICE_BOOK = {
    "effective_from_ms": JAN - 86_400_000,
    "prices": [
        {"gpu_type": "h100", "price_per_hour_micro": H100_PRICE},
        {"gpu_type": "b200", "price_per_hour_micro": 5_990_000},
    ],
    "discounts": [{"tenant_id": "t-disc", "gpu_type": "h100", "percent": "12.5"}],
}


@pytest.fixture(params=backends())
def ledger(request, tmp_path: Path) -> Iterator[httpx.Client]:
    with priced_ledger(request.param, tmp_path, PRICE_BOOK) as client:
        yield client


def sample(
    seq: int,
    *,
    node: str = "n1",
    tenant: str = "t1",
    allocation: str = "a1",
    gpu_type: str = "h100",
    start: int = JAN,
    minutes: int = 1,
    gpus: int = 8,
) -> dict:
    start_ms = start + (seq - 1) * MINUTE
    return {
        "node_id": node,
        "seq": seq,
        "allocation_id": allocation,
        "tenant_id": tenant,
        "gpu_type": gpu_type,
        "gpu_count": gpus,
        "start_ms": start_ms,
        "end_ms": start_ms + minutes * MINUTE,
    }


def ingest(client: httpx.Client, samples: list[dict]) -> dict:
    response = client.post("/v1/usage:batch", json={"samples": samples})
    assert response.status_code == 200, response.text
    return response.json()


def usage(client: httpx.Client, tenant: str = "t1", **params) -> dict:
    response = client.get("/v1/usage", params={"tenant_id": tenant, **params})
    assert response.status_code == 200, response.text
    return response.json()


def test_readiness_is_open_and_checks_the_database(ledger: httpx.Client) -> None:
    ready = httpx.get(ledger.base_url.join("/readyz"), timeout=10)  # no credentials
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "price book": "ok"}
    assert httpx.get(ledger.base_url.join("/v1/invoices"), timeout=10).status_code == 401


def test_a_ledger_without_a_price_book_is_not_ready(tmp_path: Path) -> None:
    """Every sample would be rejected as unpriced: not ready, saying what makes one."""
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url:
        unpriced = httpx.get(f"{url}/readyz", timeout=10)
        assert unpriced.status_code == 503 and unpriced.headers["retry-after"]
        assert unpriced.json()["checks"] == {
            "database": "ok",
            "price book": "LookupError: no price book: run `gpucloud prepare` (it writes the list prices) "
            "or POST /v1/price-book/versions",
        }
        answer = httpx.post(f"{url}/v1/price-book/versions", json=PRICE_BOOK, auth=LedgerAuth(tmp_path), timeout=10)
        assert answer.status_code == 201, answer.text
        ready = httpx.get(f"{url}/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "price book": "ok"}


def test_each_sample_is_recorded_exactly_once(ledger: httpx.Client) -> None:
    samples = [sample(seq) for seq in range(1, 501)]
    assert ingest(ledger, samples[:300]) == {"accepted": 300, "duplicates": 0, "rejected": 0, "rejections": []}
    # A shipper that lost its acknowledgement resends; the overlap is counted, not stored twice.
    assert ingest(ledger, samples[200:]) == {"accepted": 200, "duplicates": 100, "rejected": 0, "rejections": []}
    assert ingest(ledger, samples)["duplicates"] == 500
    totals = usage(ledger)
    assert totals["sample_count"] == 500
    assert totals["gpu_ms"] == 500 * 8 * MINUTE
    assert totals["amount_micro"] == Rate(H100_PRICE).amount_for(500 * 8 * MINUTE)
    window = usage(ledger, start=JAN + 100 * MINUTE, end=JAN + 200 * MINUTE)
    assert window["sample_count"] == 100


def test_overlapping_samples_within_one_batch_keep_the_earlier_start(ledger: httpx.Client) -> None:
    first = sample(1)
    overlapping = dict(sample(2), start_ms=first["start_ms"] + 30_000, end_ms=first["end_ms"] + 30_000)
    answer = ingest(ledger, [overlapping, first, sample(3)])
    assert (answer["accepted"], answer["rejected"]) == (2, 1)
    assert answer["rejections"][0]["index"] == 0
    assert answer["rejections"][0]["problem"]["type"] == PROBLEM + "usage-overlap"


def test_same_id_with_different_content_is_rejected_and_flagged(ledger: httpx.Client) -> None:
    ingest(ledger, [sample(1), sample(2)])
    altered = dict(sample(2), gpu_count=4)
    answer = ingest(ledger, [sample(1), altered])
    assert (answer["accepted"], answer["duplicates"], answer["rejected"]) == (0, 1, 1)
    problem = answer["rejections"][0]["problem"]
    assert problem["type"] == PROBLEM + "sample-conflict"
    assert problem["status"] == 409 and problem["retryable"] is False
    conflicts = ledger.get("/v1/usage/conflicts", params={"node_id": "n1"}).json()
    assert [(c["id"], c["seq"], c["received"]["gpu_count"]) for c in conflicts] == [(problem["conflict_id"], 2, 4)]
    assert conflicts[0]["existing_sample_id"] is not None
    assert usage(ledger)["gpu_ms"] == 2 * 8 * MINUTE


BAD_INPUT = {
    "end-before-start": (lambda s: {**s, "end_ms": s["start_ms"]}, "invalid-interval", False),
    "longer-than-an-hour": (lambda s: {**s, "end_ms": s["start_ms"] + 61 * MINUTE}, "invalid-interval", False),
    "negative-start": (lambda s: {**s, "start_ms": -5}, "negative-value", False),
    "negative-gpu-count": (lambda s: {**s, "gpu_count": -8}, "negative-value", False),
    "negative-seq": (lambda s: {**s, "seq": -1}, "negative-value", False),
    "zero-gpus": (lambda s: {**s, "gpu_count": 0}, "invalid-field", False),
    "empty-tenant": (lambda s: {**s, "tenant_id": ""}, "invalid-field", False),
    "far-future": (
        lambda s: {**s, "start_ms": int(time.time() * 1000), "end_ms": int(time.time() * 1000) + 6 * MINUTE},
        "timestamp-in-future",
        True,
    ),
    "overlap": (lambda s: {**s, "seq": 99, "start_ms": JAN + 30_000, "end_ms": JAN + 90_000}, "usage-overlap", False),
    "unknown-allocation": (
        lambda s: {**s, "tenant_id": "t-events", "allocation_id": "a-unknown"},
        "unknown-allocation",
        True,
    ),
    "other-tenants-allocation": (lambda s: {**s, "allocation_id": "a-events"}, "allocation-mismatch", False),
    "wrong-gpu-type": (
        lambda s: {**s, "tenant_id": "t-events", "allocation_id": "a-events", "gpu_type": "b200"},
        "allocation-mismatch",
        False,
    ),
    "unpriced-gpu-type": (lambda s: {**s, "gpu_type": "mi300x"}, "unpriced-usage", True),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_rejected_per_sample_and_nothing_of_it_is_written(ledger: httpx.Client, case: str) -> None:
    ledger.post(
        "/v1/allocation-events",
        json={
            "event_id": "e1",
            "allocation_id": "a-events",
            "tenant_id": "t-events",
            "kind": "start",
            "at_ms": JAN,
            "gpu_type": "h100",
        },
    )
    ingest(ledger, [sample(1)])
    corrupt, problem_type, retryable = BAD_INPUT[case]
    bad = corrupt(sample(2, start=JAN + 5 * MINUTE))
    good = sample(3, start=JAN + 5 * MINUTE)
    before = {a["account"]: a for a in ledger.get("/v1/accounts").json()}
    answer = ingest(ledger, [bad, good])
    assert (answer["accepted"], answer["rejected"]) == (1, 1), answer
    problem = answer["rejections"][0]["problem"]
    assert answer["rejections"][0]["index"] == 0
    assert problem["type"] == PROBLEM + problem_type
    assert 400 <= problem["status"] < 500 and problem["retryable"] is retryable
    assert problem["detail"] and problem["title"]
    tenant_totals = [usage(ledger, tenant) for tenant in ("t1", "t-events")]
    assert sum(t["sample_count"] for t in tenant_totals) == 2
    after = {a["account"]: a for a in ledger.get("/v1/accounts").json()}
    added = after["tenant:t1:receivable"]["debit_micro"] - before["tenant:t1:receivable"]["debit_micro"]
    assert added == Rate(H100_PRICE).step(8 * MINUTE, 8 * MINUTE)
    assert ledger.get("/v1/usage/conflicts").json() == []


SCRAPE_TOKEN = "scrape-token"


def rejected_total(ledger: httpx.Client, reason: str) -> float:
    """`gpucloud_ledger_usage_rejected_total{reason}` as the ledger's `/metrics` says it."""
    answer = httpx.get(
        ledger.base_url.join("/metrics"), headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"}, timeout=10
    )
    assert answer.status_code == 200, answer.text
    for family in text_string_to_metric_families(answer.text):
        for found in family.samples:
            if found.name == "gpucloud_ledger_usage_rejected_total" and found.labels == {"reason": reason}:
                return found.value
    raise AssertionError(f"no gpucloud_ledger_usage_rejected_total{{reason={reason!r}}} in /metrics")


def test_a_rejected_sample_is_logged_with_its_reason_and_counted_by_reason(tmp_path: Path, caplog) -> None:
    """A GPU type the price book does not price: each of its samples is rejected, counted under
    `no_price`, and the log names node, allocation and why, once a minute per reason (a fleet's
    samples arrive by the thousand), with how many it left unsaid."""
    caplog.set_level(logging.WARNING, logger="gpucloud.ledger")
    with priced_ledger("sqlite", tmp_path, PRICE_BOOK, metrics_tokens=(SCRAPE_TOKEN,)) as ledger:
        before = {reason: rejected_total(ledger, reason) for reason in ("no_price", "overlap")}
        unpriced = [sample(seq, gpu_type="mi300x") for seq in (2, 3, 4)]
        answer = ingest(ledger, [sample(1), *unpriced])
        assert (answer["accepted"], answer["rejected"]) == (1, 3)
        assert rejected_total(ledger, "no_price") == before["no_price"] + 3
        assert rejected_total(ledger, "overlap") == before["overlap"]
        (line,) = [r for r in caplog.records if r.name == "gpucloud.ledger.rejections"]
        assert line.levelno == logging.WARNING
        assert line.getMessage() == (
            f"usage sample rejected (no_price): node n1, allocation a1, seq 2: "
            f"no price for mi300x at {JAN + MINUTE} (2 more in this batch)"
        )
        assert (line.node_id, line.allocation_id) == ("n1", "a1")

        ingest(ledger, [sample(5, gpu_type="mi300x")])  # within the minute: counted, not logged again
        assert rejected_total(ledger, "no_price") == before["no_price"] + 4
        assert len([r for r in caplog.records if r.name == "gpucloud.ledger.rejections"]) == 1


def test_a_malformed_batch_is_a_problem_json_422_and_writes_nothing(ledger: httpx.Client) -> None:
    response = ledger.post("/v1/usage:batch", json={"samples": [sample(1), {**sample(2), "gpu_count": "8"}]})
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["type"] == PROBLEM + "request-invalid"
    assert "samples.1.gpu_count" in response.json()["detail"]
    assert usage(ledger)["sample_count"] == 0


def test_corrections_are_reversal_postings(ledger: httpx.Client) -> None:
    ingest(ledger, [sample(seq) for seq in range(1, 11)])
    ingest(ledger, [sample(seq, allocation="a2") for seq in range(11, 21)])
    page = ledger.get("/v1/postings", params={"tenant_id": "t1", "page_size": 1}).json()
    original = page["items"][0]
    assert page["next_cursor"] is not None
    assert {(line["account"], line["side"]) for line in original["lines"]} == {
        ("tenant:t1:receivable", "debit"),
        ("revenue:gpu:h100", "credit"),
    }
    response = ledger.post(f"/v1/postings/{original['id']}:reverse", json={"reason": "node was faulty"})
    assert response.status_code == 201, response.text
    reversal = response.json()
    assert reversal["kind"] == "reversal" and reversal["reverses_posting_id"] == original["id"]
    assert reversal["amount_micro"] == -original["amount_micro"] and reversal["gpu_ms"] == -original["gpu_ms"]
    assert {(line["account"], line["side"], line["amount_micro"]) for line in reversal["lines"]} == {
        ("tenant:t1:receivable", "credit", original["amount_micro"]),
        ("revenue:gpu:h100", "debit", original["amount_micro"]),
    }
    again = ledger.post(f"/v1/postings/{original['id']}:reverse", json={"reason": "twice"})
    assert again.status_code == 409 and again.json()["type"] == PROBLEM + "state-conflict"
    assert ledger.post(f"/v1/postings/{reversal['id']}:reverse", json={"reason": "x"}).status_code == 409
    assert ledger.post("/v1/postings/999999:reverse", json={"reason": "x"}).status_code == 404
    totals = usage(ledger)
    assert totals["reversed_gpu_ms"] == original["gpu_ms"]
    assert totals["net_amount_micro"] == totals["amount_micro"] - original["amount_micro"]
    accounts = ledger.get("/v1/accounts").json()
    assert sum(a["debit_micro"] for a in accounts) == sum(a["credit_micro"] for a in accounts)
    receivable = next(a for a in accounts if a["account"] == "tenant:t1:receivable")
    assert receivable["balance_micro"] == totals["net_amount_micro"]
    everything = ledger.get("/v1/postings", params={"tenant_id": "t1", "page_size": 1000}).json()["items"]
    assert [p["id"] for p in everything] == sorted(p["id"] for p in everything) and len(everything) == 3


def test_reconciliation_flags_gaps_and_unallocated_usage(ledger: httpx.Client) -> None:
    day = JAN + 3 * 86_400_000  # 2024-01-04
    events = [
        ("start", None, day + 10 * MINUTE),
        ("node_added", "n1", day + 10 * MINUTE),
        ("node_added", "n2", day + 10 * MINUTE),
        ("node_removed", "n2", day + 40 * MINUTE),
        ("end", None, day + 70 * MINUTE),
    ]
    for i, (kind, node, at_ms) in enumerate(events):
        body = {
            "event_id": f"ev-{i}",
            "allocation_id": "a1",
            "tenant_id": "t1",
            "kind": kind,
            "at_ms": at_ms,
            "node_id": node,
            "gpu_type": "h100",
        }
        assert ledger.post("/v1/allocation-events", json=body).status_code == 201
    n1 = [sample(seq, node="n1", start=day + 9 * MINUTE) for seq in range(2, 62)]  # [10, 70) minutes
    n2 = [sample(seq, node="n2", start=day + 9 * MINUTE) for seq in range(2, 32) if seq != 15]  # [10, 40) minus one
    n2.append(sample(40, node="n2", start=day + 9 * MINUTE))  # after n2 left the allocation
    answer = ingest(ledger, n1 + n2)
    # Time the allocation did not hold the node is refused at ingest, for good.
    assert answer["accepted"] == 60 + 29
    (refused,) = answer["rejections"]
    assert refused["node_id"] == "n2" and refused["problem"]["type"].endswith("/node-not-in-allocation")
    assert refused["problem"]["retryable"] is False
    report = ledger.get("/v1/reconciliation", params={"tenant_id": "t1", "day": "2024-01-04"}).json()
    nodes = {node["node_id"]: node for node in report["allocations"][0]["nodes"]}
    assert nodes["n1"]["gaps"] == [] and nodes["n1"]["unallocated"] == []
    assert nodes["n1"]["allocated_ms"] == nodes["n1"]["metered_ms"] == 60 * MINUTE
    assert nodes["n2"]["gaps"] == [{"start_ms": day + 23 * MINUTE, "end_ms": day + 24 * MINUTE}]
    assert nodes["n2"]["unallocated"] == []
    assert nodes["n2"]["metered_gpu_ms"] == 29 * 8 * MINUTE
    assert (report["gap_count"], report["unallocated_count"], report["ok"]) == (1, 0, False)
    quiet = ledger.get("/v1/reconciliation", params={"tenant_id": "t1", "day": "2024-01-05"}).json()
    assert quiet["allocations"] == [] and quiet["ok"] is True
    assert ledger.get("/v1/reconciliation", params={"tenant_id": "t1", "day": "not-a-day"}).status_code == 422


def test_reconciliation_tolerates_the_moments_between_the_agents_and_the_control_planes_edges(
    ledger: httpx.Client,
) -> None:
    day = JAN + 3 * 86_400_000
    # The agent metered [10, 20) minutes; the control plane saw the provision 1.5 s after it
    # began and began the release 2 s before the agent stopped.
    added, removed = day + 10 * MINUTE + 1_500, day + 20 * MINUTE - 2_000
    events = [
        ("start", None, added),
        ("node_added", "n1", added),
        ("node_removed", "n1", removed),
        ("end", None, removed),
    ]
    for i, (kind, node, at_ms) in enumerate(events):
        body = {
            "event_id": f"edge-{i}",
            "allocation_id": "a1",
            "tenant_id": "t1",
            "kind": kind,
            "at_ms": at_ms,
            "node_id": node,
            "gpu_type": "h100",
        }
        assert ledger.post("/v1/allocation-events", json=body).status_code == 201
    assert ingest(ledger, [sample(seq, start=day + 9 * MINUTE) for seq in range(2, 12)])["accepted"] == 10
    params = {"tenant_id": "t1", "day": "2024-01-04"}
    report = ledger.get("/v1/reconciliation", params=params).json()
    (node,) = report["allocations"][0]["nodes"]
    assert report["ok"] and node["unallocated"] == [] and node["gaps"] == [] and node["edge_ms"] == 3_500
    strict = ledger.get("/v1/reconciliation", params={**params, "edge_tolerance_ms": 1_000}).json()
    (node,) = strict["allocations"][0]["nodes"]
    assert not strict["ok"] and node["unallocated"] == [
        {"start_ms": day + 10 * MINUTE, "end_ms": added},
        {"start_ms": removed, "end_ms": day + 20 * MINUTE},
    ]
    assert ledger.get("/v1/reconciliation", params={**params, "edge_tolerance_ms": -1}).status_code == 422

    # Midnight is no edge of an allocation that runs through it: 3 s unmetered there are a gap.
    for i, (kind, node, at_ms) in enumerate(
        (
            ("start", None, day - 10 * MINUTE),
            ("node_added", "n2", day - 10 * MINUTE),
            ("node_removed", "n2", day + 10 * MINUTE),
            ("end", None, day + 10 * MINUTE),
        )
    ):
        body = {
            "event_id": f"midnight-{i}",
            "allocation_id": "a2",
            "tenant_id": "t1",
            "kind": kind,
            "at_ms": at_ms,
            "node_id": node,
            "gpu_type": "h100",
        }
        assert ledger.post("/v1/allocation-events", json=body).status_code == 201
    before = [sample(seq, node="n2", allocation="a2", start=day - 10 * MINUTE) for seq in range(1, 11)]
    after = {**sample(11, node="n2", allocation="a2", start=day), "start_ms": day + 3_000, "end_ms": day + 10 * MINUTE}
    assert ingest(ledger, [*before, after])["accepted"] == 11
    report = ledger.get("/v1/reconciliation", params=params).json()
    (node,) = next(a for a in report["allocations"] if a["allocation_id"] == "a2")["nodes"]
    assert node["gaps"] == [{"start_ms": day, "end_ms": day + 3_000}] and node["edge_ms"] == 0


def close_and_fetch(client: httpx.Client, period: str) -> dict[str, bytes]:
    response = client.post(f"/v1/periods/{period}:close")
    assert response.status_code == 200, response.text
    return {
        invoice["tenant_id"]: client.get(f"/v1/periods/{period}/invoices/{invoice['tenant_id']}").content
        for invoice in response.json()["invoices"]
    }


JANUARY_USAGE = (
    [sample(seq, node="n1") for seq in range(1, 301)]
    + [sample(seq, node="n2", allocation="a2", gpu_type="b200", gpus=4) for seq in range(1, 101)]
    + [sample(seq, node="n3", tenant="t-disc", allocation="a3", start=JAN + 7_777) for seq in range(1, 201)]
)


def test_invoice_close_is_reproducible_and_late_usage_is_adjusted_next_period(
    ledger: httpx.Client, tmp_path: Path
) -> None:
    for start in range(0, len(JANUARY_USAGE), 128):
        ingest(ledger, JANUARY_USAGE[start : start + 128])
    assert ingest(ledger, [sample(1, node="n4", start=FEB)])["accepted"] == 1  # February usage
    january = close_and_fetch(ledger, "2024-01")
    assert sorted(january) == ["t-disc", "t1"]
    assert close_and_fetch(ledger, "2024-01") == january  # closing again: same bytes
    listed = ledger.get("/v1/periods/2024-01/invoices").json()
    assert [i["tenant_id"] for i in listed] == ["t-disc", "t1"]

    # The same usage, shuffled and batched differently, into a ledger of its own: same bytes.
    shuffled = JANUARY_USAGE[:]
    random.Random(3).shuffle(shuffled)
    with (
        ledger_database_url("sqlite", tmp_path, "replica") as replica_url,
        ledger_in_thread(replica_url, issuer_dir=tmp_path) as url,
        httpx.Client(base_url=url, timeout=30, auth=LedgerAuth(tmp_path)) as replica,
    ):
        replica.post("/v1/price-book/versions", json=PRICE_BOOK)
        for start in range(0, len(shuffled), 333):
            ingest(replica, shuffled[start : start + 333])
        assert close_and_fetch(replica, "2024-01") == january

    # Usage from January that arrives after January closed: an adjustment on February's invoice.
    late = [sample(seq, node="n1") for seq in range(301, 311)]
    assert ingest(ledger, late)["accepted"] == 10
    assert close_and_fetch(ledger, "2024-01") == january
    february = close_and_fetch(ledger, "2024-02")
    lines = json.loads(february["t1"])["lines"]
    # Earlier usage that arrived late is a line of its own usage period on the next invoice.
    kinds = {(line["kind"], line["usage_period"]): line for line in lines}
    assert kinds[("allocation", "2024-01")]["quantity"] == 10 * 8 * MINUTE
    assert kinds[("allocation", "2024-02")]["quantity"] == 8 * MINUTE
    postings = ledger.get("/v1/postings", params={"tenant_id": "t1", "page_size": 1000}).json()["items"]
    assert {p["billing_period"] for p in postings if p["usage_period"] == "2024-01"} == {"2024-01", "2024-02"}
    january_doc = json.loads(january["t1"])
    h100 = next(line for line in january_doc["lines"] if line["gpu_type"] == "h100")
    assert h100["amount_micro"] == Rate(H100_PRICE).amount_for(300 * 8 * MINUTE)
    disc = json.loads(january["t-disc"])["lines"][0]
    assert disc["discount_bp"] == 1250 and disc["amount_micro"] == Rate(H100_PRICE, 1250).amount_for(200 * 8 * MINUTE)


def test_a_period_closes_only_after_it_ended(ledger: httpx.Client) -> None:
    response = ledger.post("/v1/periods/2999-01:close")
    assert response.status_code == 409 and response.json()["type"] == PROBLEM + "state-conflict"
    assert ledger.post("/v1/periods/2024-13:close").status_code == 422
    assert ledger.get("/v1/periods/2024-01/invoices/t1").status_code == 404


def test_price_book_versions(ledger: httpx.Client) -> None:
    versions = ledger.get("/v1/price-book/versions").json()
    assert len(versions) == 1
    assert versions[0]["discounts"] == [{"tenant_id": "t-disc", "gpu_type": "h100", "discount_bp": 1250}]
    ingest(ledger, [sample(1, start=JAN + 10 * MINUTE)])
    retroactive = {"effective_from_ms": JAN, "prices": [{"gpu_type": "h100", "price_per_hour_micro": 1}]}
    response = ledger.post("/v1/price-book/versions", json=retroactive)
    assert response.status_code == 409 and response.json()["field"] == "effective_from_ms"
    later = {"effective_from_ms": FEB, "prices": [{"gpu_type": "h100", "price_per_hour_micro": 3_000_000}]}
    assert ledger.post("/v1/price-book/versions", json=later).status_code == 201
    ingest(ledger, [sample(1, node="n9", start=FEB)])
    assert usage(ledger, start=FEB)["amount_micro"] == Rate(3_000_000).amount_for(8 * MINUTE)
    twice = {"effective_from_ms": FEB + 1, "prices": [{"gpu_type": "h100", "price_per_hour_micro": 1}] * 2}
    assert ledger.post("/v1/price-book/versions", json=twice).status_code == 422
    bad_percent = {
        **later,
        "effective_from_ms": FEB + 2,
        "discounts": [{"tenant_id": "t", "gpu_type": "h100", "percent": "12.345"}],
    }
    assert ledger.post("/v1/price-book/versions", json=bad_percent).status_code == 422


def test_allocation_events_are_idempotent(ledger: httpx.Client) -> None:
    event = {"event_id": "e-1", "allocation_id": "a1", "tenant_id": "t1", "kind": "start", "at_ms": JAN}
    assert ledger.post("/v1/allocation-events", json=event).status_code == 201
    replay = ledger.post("/v1/allocation-events", json=event)
    assert replay.status_code == 200 and replay.json()["replayed"] is True
    assert ledger.post("/v1/allocation-events", json={**event, "at_ms": JAN + 1}).status_code == 409
    other_tenant = {**event, "event_id": "e-2", "tenant_id": "t2"}
    assert ledger.post("/v1/allocation-events", json=other_tenant).status_code == 409
    node_event = {**event, "event_id": "e-3", "kind": "node_added"}
    assert ledger.post("/v1/allocation-events", json=node_event).status_code == 422
    listed = ledger.get("/v1/allocation-events", params={"tenant_id": "t1"}).json()
    assert [e["event_id"] for e in listed] == ["e-1"]
