"""Issue 43 through the stack (API, worker, Temporal, simulated fleet): a create that finds the
pool full waits in its queue, shows its position, is placed and provisioned as soon as the nodes
come back to the pool, can be cancelled while queued (nothing held, nothing billed), and fails
with a clear reason when its `max_wait_s` runs out. The database logic is tested on both
databases in test_queue_service.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.models.workflow_ids import pool_scheduler_workflow_id
from support.ledger_auth import auth_for
from support.ledger_harness import ledger_in_thread
from support.stack import async_wait_until

pytestmark = pytest.mark.integration


def _events(c, alloc_id: str) -> list[str]:
    return [e["kind"] for e in c.get(f"/v1/allocations/{alloc_id}/events").json()["items"]]


async def test_a_queued_request_is_placed_when_capacity_frees_and_one_can_be_cancelled_or_expire(
    ready_fleet, temporal_env
):
    h = await ready_fleet(nodes=2, latency_scale=0.02, scheduler={"poll_s": 0.5, "queue_recheck_s": 5})
    _, first_key = await h.onboard()
    tenant_id, key = await h.onboard()
    running = h.allocate(first_key, node_count=2)
    await h.wait_allocation(first_key, running, "ready")

    with h.client(key) as c:
        refused = c.post("/v1/allocations", json={"gpu_type": "H100", "region": "us-east-1", "node_count": 2})
        assert refused.status_code == 409 and refused.json()["type"].endswith("insufficient-capacity")
        bad = c.post(
            "/v1/allocations",
            json={"gpu_type": "H100", "region": "us-east-1", "node_count": 2, "capacity": {"max_wait_s": 60}},
        )
        assert bad.status_code == 422 and "max_wait_s" in bad.text

        body = {"gpu_type": "H100", "region": "us-east-1", "node_count": 2, "expected_duration_s": 3600}
        created = c.post("/v1/allocations", json={**body, "capacity": {"wait": "queue"}})
        assert created.status_code == 202, created.text
        waiting = created.json()["allocation"]
        assert (waiting["status"], waiting["node_ids"], waiting["queue_position"]) == ("queued", [], 1)

        hasty = c.post("/v1/allocations", json={**body, "capacity": {"wait": "queue", "max_wait_s": 1}}).json()
        assert hasty["allocation"]["status"] == "queued"
        # The CLI queues one too, and lists the tenant's queue.
        cli = ["--api-url", h.api.url, "--api-key", key]
        made = CliRunner().invoke(
            app,
            [
                *("allocations", "create", "--gpu-type", "H100", "--region", "us-east-1", "--nodes", "2", "--queue"),
                *("--expected-duration", "1h", "--no-wait", "-o", "json", *cli),
            ],
        )
        assert made.exit_code == 0, made.output
        doomed = {"allocation": json.loads(made.stdout)}
        assert doomed["allocation"]["status"] == "queued" and "queued at position" in made.stderr
        listed = CliRunner().invoke(app, ["queue", "-o", "json", *cli])
        assert listed.exit_code == 0, listed.output
        mine = [(e["allocation_id"], e["position"]) for e in json.loads(listed.stdout)]
        assert mine[0] == (waiting["id"], 1) and doomed["allocation"]["id"] in dict(mine)

        expired = await h.wait_allocation(key, hasty["allocation"]["id"], "failed", timeout_s=30)
        assert "max_wait_s=1" in expired["failure_reason"]
        assert c.get(f"/v1/operations/{hasty['operation']['id']}").json()["status"] == "failed"

        doomed_id = doomed["allocation"]["id"]
        assert c.post(f"/v1/allocations/{doomed_id}/cancel").status_code == 202
        cancelled = await h.wait_allocation(key, doomed_id, "released", timeout_s=30)
        assert cancelled["node_ids"] == [] and cancelled["placed_at"] is None
        assert _events(c, doomed_id) == ["requested", "queued", "cancel_requested", "released"]

        # Still queued, still first in line: the pool's scheduler runs while it waits.
        assert c.get(f"/v1/allocations/{waiting['id']}").json()["status"] == "queued"
        scheduler = temporal_env.client.get_workflow_handle(pool_scheduler_workflow_id("H100", "us-east-1"))
        assert (await scheduler.describe()).status.name == "RUNNING"

    with h.client(h.settings.operator_token) as op:
        everyone = op.get("/v1/queue", params={"gpu_type": "H100"}).json()["items"]
        assert [(e["allocation_id"], e["tenant_id"] == tenant_id) for e in everyone] == [(waiting["id"], True)]
        share = op.put(f"/v1/tenants/{tenant_id}/shares", json={"gpu_type": "H100", "region": "us-east-1", "weight": 2})
        assert share.status_code == 200 and share.json()["weight"] == 2
        listed = op.get(f"/v1/tenants/{tenant_id}/shares").json()["items"]
        assert [(s["gpu_type"], s["weight"]) for s in listed] == [("H100", 2)]
        assert op.put("/v1/tenants/ten_nope/shares", json={**share.json(), "tenant_id": None}).status_code == 422
        missing = op.put("/v1/tenants/ten_nope/shares", json={"gpu_type": "H100", "region": "us-east-1", "weight": 1})
        assert missing.status_code == 404
        zero = op.put(f"/v1/tenants/{tenant_id}/shares", json={"gpu_type": "H100", "region": "us-east-1", "weight": 0})
        assert zero.status_code == 422 and "weight" in zero.text
    with h.client(key) as c:
        assert c.get(f"/v1/tenants/{tenant_id}/shares").status_code in (401, 403)
    with h.client(first_key) as c:
        assert c.post(f"/v1/allocations/{running}/cancel").status_code == 202
    placed = await h.wait_allocation(key, waiting["id"], "ready", timeout_s=90)
    assert len(placed["node_ids"]) == 2 and placed["placed_at"] is not None and placed["queue_position"] is None
    with h.client(key) as c:
        kinds = _events(c, waiting["id"])
        assert kinds[:3] == ["requested", "queued", "placed"] and "ready" in kinds
        nodes = c.get(f"/v1/allocations/{waiting['id']}/nodes").json()["items"]
        assert {n["state"] for n in nodes} == {"active"}
    # The queue is empty: the scheduler ended (the next queued request starts it again).
    assert await asyncio.wait_for(scheduler.result(), timeout=30) >= 1


@pytest.mark.one_database  # the preemption's database logic is the queue's, tested on both
async def test_an_on_demand_request_takes_back_a_preemptible_allocation_with_notice(ready_fleet):
    h = await ready_fleet(
        nodes=2, latency_scale=0.02, scheduler={"poll_s": 0.5, "queue_recheck_s": 5, "preemption_notice_s": 2}
    )
    _, spare_key = await h.onboard()
    _, key = await h.onboard()
    body = {"gpu_type": "H100", "region": "us-east-1", "node_count": 2}
    workload = {"command": ["python", "train.py"]}
    with h.client(spare_key) as c:
        made = c.post("/v1/allocations", json={**body, "tier": "preemptible", "workload": workload})
        assert made.status_code == 202, made.text
        spare = made.json()["allocation"]
        assert spare["tier"] == "preemptible"
    await h.wait_allocation(spare_key, spare["id"], "ready")
    assert all(h.sim.node(n)["workload_running"] for n in spare["node_ids"])

    with h.client(key) as c:
        # Another preemptible request finds no room: it never takes anything back.
        assert c.post("/v1/allocations", json={**body, "tier": "preemptible"}).status_code == 409
        made = c.post("/v1/allocations", json=body)  # on demand, `wait: fail`: accepted, it takes the nodes back
        assert made.status_code == 202, made.text
        urgent = made.json()["allocation"]
        assert urgent["status"] == "queued"
    with h.client(spare_key) as c:
        taken = c.get(f"/v1/allocations/{spare['id']}").json()
        assert taken["preempted_at"] is not None and taken["status"] == "ready"  # the notice runs
        assert "preemption_notice" in _events(c, spare["id"])
    ended = await h.wait_allocation(spare_key, spare["id"], "released", timeout_s=60)
    assert ended["preempted_at"] is not None
    with h.client(spare_key) as c:
        kinds = _events(c, spare["id"])
        assert kinds.index("preemption_notice") < kinds.index("preempted") < kinds.index("released")
    assert not any(h.sim.node(n)["workload_running"] for n in spare["node_ids"])
    placed = await h.wait_allocation(key, urgent["id"], "ready", timeout_s=90)
    assert sorted(placed["node_ids"]) == sorted(spare["node_ids"])


@pytest.fixture
def ledger_url(tmp_path: Path) -> Iterator[str]:
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url:
        yield url


@pytest.mark.one_database  # the reservations' database logic is tested on both (test_reservations_service.py)
async def test_a_capacity_reservation_is_ready_at_its_start_ends_on_time_and_is_billed(ready_fleet, ledger_url):
    scheduler = {
        "poll_s": 0.5,
        "queue_recheck_s": 5,
        "preemption_notice_s": 1,
        "reservation_min_notice_s": 5,
        "reservation_hold_s": 30,
        "reservation_prepare_s": 8,
    }
    h = await ready_fleet(nodes=2, latency_scale=0.02, scheduler=scheduler, ledger={"url": ledger_url})
    spare_tenant, spare_key = await h.onboard()
    tenant_id, key = await h.onboard()
    body = {"gpu_type": "H100", "region": "us-east-1", "node_count": 2}
    with h.client(spare_key) as c:
        spare = c.post("/v1/allocations", json={**body, "tier": "preemptible"}).json()["allocation"]
    await h.wait_allocation(spare_key, spare["id"], "ready")

    start = datetime.now(UTC) + timedelta(seconds=20)
    window = {**body, "start_at": start.isoformat(), "end_at": (start + timedelta(seconds=15)).isoformat()}
    with h.client(key) as c:
        made = c.post("/v1/reservations", json=window, headers={"Idempotency-Key": "book-1"})
        assert made.status_code == 201, made.text
        booked = made.json()
        assert booked["status"] == "accepted" and booked["tenant_id"] == tenant_id
        again = c.post("/v1/reservations", json=window, headers={"Idempotency-Key": "book-1"})
        assert again.json()["id"] == booked["id"]
        # The pool cannot honour a second one over the same window.
        assert c.post("/v1/reservations", json=window).status_code == 409
        soon = {**window, "start_at": datetime.now(UTC).isoformat()}
        refused = c.post("/v1/reservations", json=soon)
        assert refused.status_code == 422 and "start_at" in refused.text

    # Ahead of the window the preemptible work on its nodes is taken back.
    await h.wait_allocation(spare_key, spare["id"], "released", timeout_s=30)
    with h.client(key) as c:
        active = await async_wait_until(
            lambda: (r := c.get(f"/v1/reservations/{booked['id']}").json())["ready_at"] and r,
            timeout_s=40,
            interval_s=0.3,
            what="the reservation's allocation ready",
        )
        assert active["status"] == "active"
        assert datetime.fromisoformat(active["ready_at"]) <= start  # ready on time
        alloc = c.get(f"/v1/allocations/{active['allocation_id']}").json()
        assert alloc["tier"] == "reserved" and alloc["status"] == "ready" and len(alloc["node_ids"]) == 2
        assert [r["id"] for r in c.get("/v1/reservations").json()["items"]] == [booked["id"]]
    ended = await h.wait_allocation(key, active["allocation_id"], "released", timeout_s=60)
    with h.client(key) as c:
        kinds = _events(c, ended["id"])
        assert "reservation_ended" in kinds and kinds[-1] == "released"
        finished = await async_wait_until(
            lambda: (r := c.get(f"/v1/reservations/{booked['id']}").json())["status"] == "ended" and r,
            timeout_s=20,
            what="the reservation ended",
        )
        events = c.get(f"/v1/allocations/{ended['id']}/events").json()["items"]
    cancelled_at = next(e["at"] for e in events if e["kind"] == "reservation_ended")
    assert datetime.fromisoformat(cancelled_at) >= datetime.fromisoformat(finished["end_at"])  # not before its end

    # The ledger bills the window (from its start, used or not) and knows each allocation's class.
    auth = auth_for(ledger_url)
    billed = await async_wait_until(
        lambda: httpx.get(f"{ledger_url}/v1/reservations", params={"tenant_id": tenant_id}, auth=auth).json(),
        timeout_s=20,
        what="the reservation in the ledger",
    )
    assert [(r["reservation_id"], r["node_count"]) for r in billed] == [(booked["id"], 2)]
    assert billed[0]["start_ms"] == int(datetime.fromisoformat(booked["start_at"]).timestamp() * 1000)
    day = datetime.now(UTC).date().isoformat()
    for tenant, alloc_id, price_class in (
        (spare_tenant, spare["id"], "preemptible"),
        (tenant_id, ended["id"], "reserved"),
    ):
        report = httpx.get(f"{ledger_url}/v1/reconciliation", params={"tenant_id": tenant, "day": day}, auth=auth)
        assert report.status_code == 200, report.text
        classes = {a["allocation_id"]: a["price_class"] for a in report.json()["allocations"]}
        assert classes.get(alloc_id) == price_class, report.json()

    # The CLI books, lists and cancels one too.
    cli = ["--api-url", h.api.url, "--api-key", key]
    book = ["reservations", "create", "--gpu-type", "H100", "--region", "us-east-1", "--nodes", "1"]
    made = CliRunner().invoke(app, [*book, "--start", "+2h", "--duration", "1h", "-o", "json", *cli])
    assert made.exit_code == 0, made.output
    later = json.loads(made.stdout)
    assert later["status"] == "accepted" and later["node_count"] == 1
    bad = CliRunner().invoke(app, [*book, "--start", "tomorrow", "--duration", "1h", *cli])
    assert bad.exit_code == 2 and "--start" in bad.output
    cancelled = CliRunner().invoke(app, ["reservations", "cancel", later["id"], "-o", "json", *cli])
    assert cancelled.exit_code == 0 and json.loads(cancelled.stdout)["status"] == "cancelled"
    listed = CliRunner().invoke(app, ["reservations", "list", "-o", "json", *cli])
    assert {(r["id"], r["status"]) for r in json.loads(listed.stdout)} == {
        (booked["id"], "ended"),
        (later["id"], "cancelled"),
    }
