"""The health part of `gpucloud demo` against the real stack: a fault, its pull, its replacement in
the same fabric domain and the tenant's events; and a clear error when the breaker refuses."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Coroutine

import pytest
from rich.console import Console

from gpucloud.demo.common import Demo, DemoFailed
from gpucloud.demo.health import demo_health

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

FAST = {"latency_scale": 0.02, "health__drain_grace_s": 0.5, "health__replacement_recheck_s": 0.5}


async def _ready_allocation(ready_fleet, *, nodes: int, **settings):
    h = await ready_fleet(nodes=nodes, **{**FAST, **settings})
    _, key = await h.onboard()
    alloc = await h.wait_allocation(key, h.allocate(key, node_count=2), "ready")
    return h, key, alloc


def _run(h, key: str, alloc_id: str) -> tuple[Coroutine, io.StringIO]:
    """The demo blocks (plain HTTP, sleeps): off the event loop the worker runs on."""
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    demo = Demo.connect(console, h.api.url, h.settings.operator_token, h.sim.url)
    future = asyncio.to_thread(demo_health, demo, demo.tenant(key), alloc_id, timeout_s=60)
    return future, out


async def test_demo_replaces_a_failed_node_in_the_same_fabric_domain(ready_fleet):
    h, key, alloc = await _ready_allocation(ready_fleet, nodes=4, health__breaker_max_pulled_share=1.0)
    bad, kept = alloc["node_ids"]
    future, out = _run(h, key, alloc["id"])
    await future

    after = h.client(key).get(f"/v1/allocations/{alloc['id']}").json()
    assert after["status"] == "ready" and kept in after["node_ids"] and bad not in after["node_ids"]
    (new,) = set(after["node_ids"]) - {kept}
    assert h.node(new)["pod"] == alloc["fabric_domain"]
    text = out.getvalue()
    assert f"XID 79 on {bad}" in text and f"{new} replaced {bad}" in text
    assert "allocation events" in text and "replacement_started" in text


async def test_demo_says_why_when_the_breaker_refuses_the_pull(ready_fleet):
    h, key, alloc = await _ready_allocation(ready_fleet, nodes=4)  # 1 pull an hour for each owner
    # The tenant's own budget is spent on another of its allocations (another tenant's, or the
    # platform's idle nodes, would not touch it: docs/health.md).
    other = await h.wait_allocation(key, h.allocate(key, node_count=1), "ready")
    first = h.operator.post(f"/v1/nodes/{other['node_ids'][0]}/xid", json={"xid": 79}).json()["decisions"][0]
    assert first["pull"] == "replace"  # a node in an allocation is replaced, and the budget spent
    future, _ = _run(h, key, alloc["id"])
    with pytest.raises(DemoFailed, match=r"pull=None.*refused"):
        await future
    assert h.client(key).get(f"/v1/allocations/{alloc['id']}").json()["node_ids"] == alloc["node_ids"]


async def test_demo_needs_a_ready_allocation(ready_fleet):
    h, key, alloc = await _ready_allocation(ready_fleet, nodes=2)
    with h.client(key) as c:
        c.post(f"/v1/allocations/{alloc['id']}/cancel").raise_for_status()
    await h.wait_allocation(key, alloc["id"], "released")
    future, _ = _run(h, key, alloc["id"])
    with pytest.raises(DemoFailed, match="needs a ready one"):
        await future
