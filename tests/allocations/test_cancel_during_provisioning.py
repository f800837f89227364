"""Issue 14: a cancel during provisioning stops the provisions under way and bills nothing.

Provisioning on the simulated fleet takes 8 s a node (`gpucloud sim --provision-s`), long enough
to cancel in the middle: every node provision in flight stops, the nodes go back to the pool
through wipe and burn-in with nothing of the tenant left on them, the allocation ends
`released` with its create operation `failed`, and the ledger learns of an allocation that held
no node, so a sample an agent metered meanwhile is refused for good."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.ledger_auth import auth_for
from support.ledger_harness import ledger_in_thread
from support.stack import async_wait_until

pytestmark = pytest.mark.integration

ALLOC = {"gpu_type": "H100", "node_count": 2, "region": "us-east-1"}


@pytest.fixture
def ledger_url(tmp_path: Path) -> Iterator[str]:
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url:
        price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "H100", "price_per_hour_micro": 2_490_000}]}
        assert httpx.post(auth=auth_for(url), url=f"{url}/v1/price-book/versions", json=price_book).status_code == 201
        yield url


async def test_a_cancel_during_provisioning_stops_it_returns_every_node_and_bills_nothing(ready_fleet, ledger_url):
    h = await ready_fleet(nodes=3, latency_scale=0.02, sim_args=("--provision-s", "8"), ledger={"url": ledger_url})
    tenant_id, key = await h.onboard()
    with h.client(key) as tenant:
        created = tenant.post("/v1/allocations", json=ALLOC)
        assert created.status_code == 202, created.text
        alloc_id, create_op = created.json()["allocation"]["id"], created.json()["operation"]["id"]
        node_ids = await async_wait_until(
            lambda: (ids := [n["id"] for n in h.nodes() if n["state"] == "provisioning"]) and len(ids) == 2 and ids,
            timeout_s=30,
            interval_s=0.1,
            what="both nodes provisioning",
        )
        cancelled_at = time.monotonic()
        assert tenant.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202
        await h.wait_allocation(key, alloc_id, "released", timeout_s=60)
        # The provisions in flight were stopped, not waited out (each takes 8 s).
        assert time.monotonic() - cancelled_at < 8
        operation = tenant.get(f"/v1/operations/{create_op}").json()
        assert operation["status"] == "failed", operation
        assert "cancelled" in operation["error"]

    await h.wait_states({"available": 3}, timeout_s=90)  # wiped, burnt in, back in the pool
    for node_id in node_ids:
        agent = h.sim.node(node_id)
        assert agent["tenant_id"] is None and not agent["workload_running"], agent
        events = h.operator.get(f"/v1/nodes/{node_id}/events", params={"page_size": 100}).json()["items"]
        assert any("allocation cancelled during provisioning" in (e.get("cause") or "") for e in events), events

    # The ledger knows the allocation, with no node in it: nothing is billed, and usage an agent
    # metered before the cancel reached it is refused for good.
    usage = httpx.get(
        f"{ledger_url}/v1/usage", params={"tenant_id": tenant_id, "allocation_id": alloc_id}, auth=auth_for(ledger_url)
    ).json()
    assert usage["gpu_ms"] == 0
    now = time.time_ns() // 1_000_000
    sample = {
        "node_id": node_ids[0],
        "seq": 1,
        "tenant_id": tenant_id,
        "allocation_id": alloc_id,
        "gpu_type": "H100",
        "gpu_count": 8,
        "start_ms": now - 60_000,
        "end_ms": now,
    }
    agent_token = auth_for(ledger_url).token("agent", f"node:{node_ids[0]}")
    answer = httpx.post(
        f"{ledger_url}/v1/usage:batch", json={"samples": [sample]}, headers={"Authorization": f"Bearer {agent_token}"}
    ).json()
    assert answer["accepted"] == 0
    problem = answer["rejections"][0]["problem"]
    assert problem["type"].endswith("/node-not-in-allocation") and not problem.get("retryable"), problem
