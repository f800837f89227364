"""Seeded chaos: agent failures (transient and permanent), slow agents, worker restarts and
short deadlines while tenants allocate and cancel. Throughout, no node serves two live
allocations; after the faults stop, every node reaches a stable state within a bounded number
of sweeps and every allocation ends."""

from __future__ import annotations

import asyncio
import random

import pytest

from gpucloud.models.node_states import STABLE

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

SEED = 20261202
ACTIONS = ("inspect", "burn_in", "provision", "release", "wipe")


def _assert_no_node_in_two_allocations(h, clients) -> None:
    nodes = {n["id"]: n for n in h.nodes()}
    owned: dict[str, str] = {}
    for client in clients:
        for alloc in client.get("/v1/allocations", params={"page_size": 1000}).json()["items"]:
            if alloc["status"] != "ready":
                continue
            for node_id in alloc["node_ids"]:
                assert node_id not in owned, f"{node_id} in {owned.get(node_id)} and {alloc['id']}"
                owned[node_id] = alloc["id"]
                assert nodes[node_id]["allocation_id"] == alloc["id"]
                assert nodes[node_id]["state"] == "active"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.long
async def test_chaos_converges(db_url, make_harness, in_process_worker, temporal_env):
    rng = random.Random(SEED)
    h = make_harness(
        db_url,
        nodes=10,
        latency_scale=0.2,
        reconciler={"deadline_scale": 0.002, "backoff_base_s": 0.2, "backoff_cap_s": 2.0},
    )
    worker = await in_process_worker(h.settings)
    node_ids = h.enroll_fleet()
    await h.wait_states({"available": 10}, timeout_s=90)
    clients = [h.client((await h.onboard())[1]) for _ in range(2)]
    live: list[tuple[int, str]] = []

    for _step in range(60):
        roll = rng.random()
        if roll < 0.35:
            who = rng.randrange(len(clients))
            resp = clients[who].post(
                "/v1/allocations", json={"gpu_type": "H100", "node_count": rng.randint(1, 3), "region": "us-east-1"}
            )
            assert resp.status_code in (202, 409), resp.text
            if resp.status_code == 202:
                live.append((who, resp.json()["allocation"]["id"]))
        elif roll < 0.55 and live:
            who, alloc_id = live.pop(rng.randrange(len(live)))
            assert clients[who].post(f"/v1/allocations/{alloc_id}/cancel").status_code in (200, 202)
        elif roll < 0.8:
            mode = "permanent" if rng.random() < 0.15 else "transient"
            h.sim.inject(rng.choice(node_ids), rng.choice(ACTIONS), mode, count=rng.randint(1, 2))
        elif roll < 0.88:
            await worker.__aexit__(None, None, None)
            await asyncio.sleep(rng.uniform(0.2, 1.5))  # the worker is down; deadlines keep running
            worker = await in_process_worker(h.settings)
        else:
            await h.sweep(temporal_env.client)
        _assert_no_node_in_two_allocations(h, clients)
        await asyncio.sleep(0.15)

    # Faults stop (injected counts run out): tenants cancel what is left; the reconciler converges.
    for who, alloc_id in live:
        clients[who].post(f"/v1/allocations/{alloc_id}/cancel")
    for _sweep in range(180):
        await h.sweep(temporal_env.client)
        _assert_no_node_in_two_allocations(h, clients)
        states = {n["state"] for n in h.nodes()}
        statuses = {
            a["status"] for c in clients for a in c.get("/v1/allocations", params={"page_size": 1000}).json()["items"]
        }
        if states <= {s.value for s in STABLE} and statuses <= {"released", "failed"}:
            break
        await asyncio.sleep(0.5)
    else:
        pytest.fail(f"not converged after 180 sweeps: {[(n['id'], n['state']) for n in h.nodes()]}, {statuses}")
    assert states <= {"available", "quarantined"}
    assert all(n["allocation_id"] is None for n in h.nodes())
    for n in h.nodes():  # nobody's data is left on a node back in the pool
        if n["state"] == "available":
            assert h.sim.node(n["id"])["tenant_id"] is None
