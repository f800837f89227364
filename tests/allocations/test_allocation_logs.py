"""Issue 40, "see what runs": a tenant reads what its workload printed on each node (the real
API, the in-process worker, the simulated fleet's agents), sees it exit with its status instead of
an eternal `running`, and reads the allocation's life in its events as it happens.

Before: no logs route, the simulated workload reported `running` forever, and the events held
only what the tenant asked (`requested`, `cancel_requested`), not provisioning, ready or the end."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

SCRIPT = "echo hello from $GPUCLOUD_ALLOCATION_ID; echo to-stderr >&2; exit 3"


def _kinds(c, alloc_id: str) -> list[str]:
    return [e["kind"] for e in c.get(f"/v1/allocations/{alloc_id}/events").json()["items"]]


async def test_a_tenant_reads_its_workload_s_output_and_exit_status_and_its_allocation_s_events(ready_fleet):
    h = await ready_fleet(nodes=3, latency_scale=0.02)
    _, key = await h.onboard()
    _, other = await h.onboard()
    short = h.allocate(key, node_count=2, workload={"command": ["sh", "-c", SCRIPT]})
    long = h.allocate(key, node_count=1, workload={"command": ["torchrun", "train.py"]})
    ready = await h.wait_allocation(key, short, "ready")
    await h.wait_allocation(key, long, "ready")
    node = ready["node_ids"][0]
    logs = f"/v1/allocations/{short}/nodes/{node}/logs"
    with h.client(key) as c:
        assert _kinds(c, short) == ["requested", "provisioning", "provisioning", "ready"]
        got = c.get(logs)
        assert got.status_code == 200, got.text
        assert got.headers["content-type"].startswith("text/plain")
        assert got.text == f"hello from {short}\nto-stderr\n"
        assert c.get(logs, params={"tail": 1}).text == "to-stderr\n"
        # The workload has exited: a follow hands over what it printed and ends at once.
        started = time.monotonic()
        assert c.get(logs, params={"follow": "true"}).text == f"hello from {short}\nto-stderr\n"
        assert time.monotonic() - started < 5
        # Its exit status reaches the allocation's nodes through the agents' heartbeats.
        h.push_heartbeats()
        nodes = c.get(f"/v1/allocations/{short}/nodes").json()["items"]
        assert [(n["workload"]["state"], n["workload"]["exit_code"]) for n in nodes] == [("exited", 3)] * 2, nodes

        # A job that runs on: a follow streams its lines as they come and ends at its bound.
        (long_node,) = c.get(f"/v1/allocations/{long}").json()["node_ids"]
        started = time.monotonic()
        followed = c.get(f"/v1/allocations/{long}/nodes/{long_node}/logs", params={"follow": "true", "follow_s": 3})
        assert 2.5 < time.monotonic() - started < 15
        assert followed.status_code == 200 and followed.text.startswith("step 1 loss "), followed.text
        h.push_heartbeats()
        (running,) = c.get(f"/v1/allocations/{long}/nodes").json()["items"]
        assert running["workload"]["state"] == "running"
        # A node of another allocation, or none, is not this allocation's.
        assert c.get(f"/v1/allocations/{short}/nodes/{long_node}/logs").status_code == 404
        assert c.get(f"/v1/allocations/{short}/nodes/sim-99999/logs").status_code == 404
        assert c.get(logs, params={"tail": -1}).status_code == 422

    with h.client(other) as stranger:  # another tenant sees nothing of it
        assert stranger.get(logs).status_code == 404

    with h.client(key) as c:
        assert c.post(f"/v1/allocations/{short}/cancel").status_code == 202
    await h.wait_allocation(key, short, "released")
    with h.client(key) as c:
        kinds = _kinds(c, short)
        assert kinds == ["requested", "provisioning", "provisioning", "ready", "cancel_requested", "released"], kinds
        # Released: the workload is gone from the node, and so is what it printed.
        assert c.get(logs).status_code == 404
