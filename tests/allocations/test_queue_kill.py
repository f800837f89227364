"""Issue 43: the queue survives kill -9 of the API and of the worker. Requests queued before the
kills are all still there after them, are placed in order as capacity frees, and no node is ever
in two allocations; the ones cancelled settle, and every node comes back."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from sqlmodel import select

from gpucloud.db import session_scope
from gpucloud.models.tables import Allocation, Node
from support.api_process import ApiProcess, healthy, until_answered
from support.stack import async_wait_until, wait_until

pytestmark = pytest.mark.integration

BODY = {"gpu_type": "H100", "region": "us-east-1", "node_count": 2, "capacity": {"wait": "queue"}}


def _no_node_twice(db_url: str) -> None:
    with session_scope(db_url) as session:
        live = session.exec(
            select(Allocation).where(Allocation.status.in_(["provisioning", "ready", "cancelling"]))
        ).all()
        nodes = {n.id: n for n in session.exec(select(Node)).all()}
    held = [n for a in live for n in a.node_ids]
    assert len(held) == len(set(held)), held
    for a in live:
        assert all(nodes[n].allocation_id in (a.id, None) for n in a.node_ids)


async def test_queued_requests_survive_kill_9_of_the_api_and_the_worker(db_url, make_harness, tmp_path):
    h = make_harness(db_url, nodes=4, latency_scale=0.05, scheduler={"poll_s": 1.0, "queue_recheck_s": 5})
    h.start_worker_process()
    h.enroll_fleet()
    await h.wait_states({"available": 4}, timeout_s=120)
    _, holder = await h.onboard()
    _, key = await h.onboard()
    api = ApiProcess(h.settings, tmp_path / "api-process.log")
    api.start()
    try:
        wait_until(lambda: healthy(api.url), timeout_s=60, what="the API process")
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {holder}"}, timeout=10) as c:
            full = until_answered(
                lambda: c.post("/v1/allocations", json={**BODY, "node_count": 4, "capacity": {"wait": "fail"}})
            )
            assert full.status_code == 202, full.text
            held_id = full.json()["allocation"]["id"]
        await h.wait_allocation(holder, held_id, "ready", timeout_s=90)
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as c:
            queued = [
                until_answered(lambda i=i: c.post("/v1/allocations", json=BODY, headers={"Idempotency-Key": f"q{i}"}))
                for i in range(3)
            ]
        ids = [r.json()["allocation"]["id"] for r in queued]
        assert [r.json()["allocation"]["status"] for r in queued] == ["queued"] * 3

        api.kill()
        await asyncio.sleep(1)
        worker = h.worker_procs[-1]
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        await asyncio.sleep(1)
        api.start()
        h.start_worker_process()
        wait_until(lambda: healthy(api.url), timeout_s=60, what="the API process after kill -9")

        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as c:
            after = [c.get(f"/v1/allocations/{i}").json() for i in ids]
            assert [a["status"] for a in after] == ["queued"] * 3  # nothing lost, nothing placed twice
            # A create re-sent under its key after the crash answers the same queued allocation.
            again = until_answered(lambda: c.post("/v1/allocations", json=BODY, headers={"Idempotency-Key": "q0"}))
            assert again.json()["allocation"]["id"] == ids[0]
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {holder}"}, timeout=10) as c:
            assert until_answered(lambda: c.post(f"/v1/allocations/{held_id}/cancel")).status_code == 202

        for alloc_id in ids[:2]:
            await h.wait_allocation(key, alloc_id, "ready", timeout_s=120)
        _no_node_twice(h.settings.database_url)
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as c:
            assert c.get(f"/v1/allocations/{ids[2]}").json()["status"] == "queued"
            for alloc_id in ids:
                assert until_answered(lambda a=alloc_id: c.post(f"/v1/allocations/{a}/cancel")).status_code == 202
            for alloc_id in ids:
                await async_wait_until(
                    lambda a=alloc_id: c.get(f"/v1/allocations/{a}").json()["status"] == "released",
                    timeout_s=120,
                    interval_s=0.5,
                    what=f"{alloc_id} released",
                )
    finally:
        api.stop()
    await h.wait_states({"available": 4}, timeout_s=180)
