"""kill -9 of the API and of the worker while 16 clients create and cancel allocations: every
create is answered within 10 s of retries with its Idempotency-Key, every answered allocation
exists and settles, and no key made two allocations (nothing is provisioned, or billed, twice).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections import Counter

import httpx
import pytest
from sqlmodel import select

from gpucloud.db import session_scope
from gpucloud.models.tables import Allocation
from support.api_process import ApiProcess, healthy, until_answered
from support.stack import async_wait_until, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

CLIENTS = 16
ALLOC = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}
ANSWER_WITHIN_S = 10.0


def _client_loop(url: str, token: str, stop: threading.Event, answers: dict, slowest: list) -> None:
    """Create (under a fresh key, retried with that key until answered) then cancel, until told
    to stop. Records each key's allocation and how long its answer took."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=5) as http:
        while not stop.is_set():
            key = uuid.uuid4().hex
            first = time.monotonic()
            while True:
                try:
                    resp = http.post("/v1/allocations", json=ALLOC, headers={"Idempotency-Key": key})
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                in_progress = resp.status_code == 409 and resp.json().get("type", "").endswith("in-progress")
                if resp.status_code not in (429, 503) and not in_progress:
                    break  # an allocation, or a refusal for good (no capacity, quota)
                # Overloaded, or the key's claim still held by a request in flight: wait as told.
                time.sleep(min(float(resp.headers.get("Retry-After", "0.5")), 1.0))
            slowest.append(time.monotonic() - first)
            if resp.status_code not in (200, 201, 202):
                continue
            allocation_id = resp.json()["allocation"]["id"]
            answers.setdefault(key, set()).add(allocation_id)
            # The same key asked again answers the same allocation.
            again = until_answered(
                lambda k=key: http.post("/v1/allocations", json=ALLOC, headers={"Idempotency-Key": k})
            )
            answers[key].add(again.json()["allocation"]["id"])
            cancel = until_answered(lambda a=allocation_id: http.post(f"/v1/allocations/{a}/cancel"))
            assert cancel.status_code in (200, 202), cancel.text


@pytest.mark.long
async def test_kill_9_of_the_api_and_the_worker_under_16_clients_loses_and_doubles_nothing(
    db_url, make_harness, tmp_path
):
    h = make_harness(db_url, nodes=24, latency_scale=0.05)
    h.start_worker_process()
    h.enroll_fleet()
    await h.wait_states({"available": 24}, timeout_s=120)
    _, key = await h.onboard(quotas=[{"gpu_type": "H100", "region": "us-east-1", "max_gpus": 24 * 8}])
    api = ApiProcess(h.settings, tmp_path / "api-process.log")
    api.start()
    try:
        wait_until(lambda: healthy(api.url), timeout_s=60, what="the API process")
        stop, answers, slowest = threading.Event(), {}, []
        threads = [
            threading.Thread(target=_client_loop, args=(api.url, key, stop, answers, slowest), daemon=True)
            for _ in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        await asyncio.sleep(2)
        killed_at = time.monotonic()
        api.kill()  # creates in flight lose their process
        await asyncio.sleep(1)
        api.start()
        wait_until(lambda: healthy(api.url), timeout_s=60, what="the API process after kill -9")
        # While no API process runs, nothing can answer: the bound counts from its return.
        down_s = time.monotonic() - killed_at
        await asyncio.sleep(2)
        worker = h.worker_procs[-1]
        worker.send_signal(signal.SIGKILL)  # workflows and activities in flight lose their worker
        worker.wait()
        await asyncio.sleep(1)
        h.start_worker_process()
        await asyncio.sleep(4)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a client never got its answer"
    finally:
        api.stop()

    assert len(answers) >= CLIENTS  # every client was answered at least once
    assert max(slowest) < ANSWER_WITHIN_S + down_s, f"slowest answer {max(slowest):.1f} s, API down {down_s:.1f} s"
    # One key, one allocation.
    assert all(len(ids) == 1 for ids in answers.values()), {k: v for k, v in answers.items() if len(v) > 1}
    answered = {next(iter(ids)) for ids in answers.values()}
    with session_scope(h.settings.database_url) as session:
        rows = session.exec(select(Allocation)).all()
    by_key = Counter(r.idempotency_key for r in rows if r.idempotency_key)
    assert all(n == 1 for n in by_key.values())
    assert answered <= {r.id for r in rows}  # every answered allocation exists
    # Every allocation settles (cancelled ones release their nodes), and every node comes back.
    with h.client(key) as c:
        for allocation_id in answered:
            await async_wait_until(
                lambda a=allocation_id: c.get(f"/v1/allocations/{a}").json()["status"] in ("released", "failed"),
                timeout_s=120,
                interval_s=0.5,
                what=f"allocation {allocation_id} settled",
            )
    # Every client waited for its answer, so every allocation made was answered to someone.
    assert {r.id for r in rows} == answered
    await h.wait_states({"available": 24}, timeout_s=180)
    nodes = h.nodes()
    assert all(n["allocation_id"] is None for n in nodes)
