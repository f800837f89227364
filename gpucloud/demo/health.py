"""The health part of `gpucloud demo`: a GPU falls off the bus on a node of a ready allocation,
the control plane pulls the node, provisions a replacement in the same fabric domain, and the
allocation is ready again; the tenant reads what happened in the allocation's event log.

The fault is injected through the operator API (`POST /v1/nodes/{id}/xid`, as if the node's
agent had reported XID 79); everything the demo then checks it reads through the public API,
the tenant's view with the tenant's key. The simulated fleet is asked only whether the tenant's
workload now runs on the replacement.

`demo_health` raises `HealthDemoError` the moment anything is not as expected.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

FATAL_XID = 79  # fell off the bus: drain now, no grace period for the tenant
FAULTY_GPU = 3


class HealthDemoError(RuntimeError):
    pass


class _Caller:
    def __init__(self, base: str, token: str, who: str) -> None:
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        self.who = who

    def call(self, method: str, path: str, **kw) -> dict:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise HealthDemoError(f"{self.who}: {method} {path} failed: {exc}") from exc
        if resp.status_code != 200:
            raise HealthDemoError(f"{self.who}: {method} {path} -> HTTP {resp.status_code}: {resp.text[:400]}")
        return resp.json()


def _events(tenant: _Caller, allocation_id: str) -> list[dict]:
    return tenant.call("GET", f"/v1/allocations/{allocation_id}/events", params={"page_size": 500})["items"]


def _wait_stages(console: Console, stages: list[tuple[str, Callable[[], object]]], timeout_s: float) -> list:
    """One progress bar over the stages, each waited on in turn; the value each returned."""
    results = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(stages[0][0], total=len(stages))
        deadline = time.monotonic() + timeout_s
        for what, check in stages:
            progress.update(task, description=what)
            while not (value := check()):
                if time.monotonic() > deadline:
                    raise HealthDemoError(f"timed out after {timeout_s:.0f}s waiting: {what}")
                time.sleep(0.2)
            results.append(value)
            progress.advance(task)
    return results


def _events_table(events: list[dict]) -> Table:
    table = Table(title="allocation events (the tenant's view)")
    for col in ("at", "kind", "node", "replacement", "reason"):
        table.add_column(col)
    for e in events:
        table.add_row(e["at"][11:19], e["kind"], e["node_id"] or "", e["replacement_node_id"] or "", e["reason"])
    return table


def demo_health(
    console: Console,
    api_url: str,
    operator_token: str,
    tenant_key: str,
    allocation_id: str,
    sim_url: str,
    *,
    timeout_s: float = 180,
) -> None:
    """Fail one node of the ready allocation and show it replaced; `timeout_s` bounds the waits."""
    op = _Caller(api_url, operator_token, "operator")
    tenant = _Caller(api_url, tenant_key, "tenant")
    alloc = tenant.call("GET", f"/v1/allocations/{allocation_id}")
    if alloc["status"] != "ready" or not alloc["node_ids"]:
        raise HealthDemoError(
            f"allocation {allocation_id} is {alloc['status']} with {len(alloc['node_ids'])} "
            "nodes; the health demo needs a ready one"
        )
    members, pod = list(alloc["node_ids"]), alloc["fabric_domain"]
    bad = members[0]
    seen_events = len(_events(tenant, allocation_id))

    decision = op.call(
        "POST",
        f"/v1/nodes/{bad}/xid",
        json={"xid": FATAL_XID, "gpu_index": FAULTY_GPU, "message": "demo: GPU has fallen off the bus"},
    )["decisions"][0]
    console.print(
        f"[red]XID {FATAL_XID}[/] on {bad} GPU {FAULTY_GPU} (fell off the bus): health "
        f"[bold]{decision['health']}[/], action [bold]{decision['action']}[/]"
    )
    if decision["pull"] != "replace":
        raise HealthDemoError(
            f"expected the control plane to replace {bad} in {allocation_id}, it decided "
            f"pull={decision['pull']!r}" + (f" ({decision['alert']})" if decision["alert"] else "")
        )

    def pulled() -> dict | None:
        a = tenant.call("GET", f"/v1/allocations/{allocation_id}")
        return a if bad not in a["node_ids"] else None

    def replacement_started() -> dict | None:
        return next(
            (e for e in _events(tenant, allocation_id)[seen_events:] if e["kind"] == "replacement_started"), None
        )

    def ready_again() -> dict | None:
        a = tenant.call("GET", f"/v1/allocations/{allocation_id}")
        if a["status"] == "failed":
            raise HealthDemoError(f"allocation {allocation_id} failed: {a['failure_reason']}")
        return a if a["status"] == "ready" and bad not in a["node_ids"] and len(a["node_ids"]) == len(members) else None

    degraded, started, alloc = _wait_stages(
        console,
        [
            (f"pull {bad} out of {allocation_id}", pulled),
            ("reserve and provision a replacement", replacement_started),
            (f"{allocation_id} ready again", ready_again),
        ],
        timeout_s,
    )
    console.print(
        f"{bad} pulled: allocation was [yellow]{degraded['status']}[/] "
        f"({degraded['failure_reason'] or 'replacement pending'})"
    )
    replacement = started["node_id"]
    console.print(f"replacement started: {replacement}")
    _check_replacement(op, sim_url, alloc, bad=bad, replacement=replacement, pod=pod, kept=members[1:])
    console.print(f"allocation [green]ready[/] again: {replacement} replaced {bad}, same fabric domain {pod}")

    health = op.call("GET", f"/v1/nodes/{bad}/health")
    reasons = "; ".join(c["reason"] for c in health["conditions"]) or "none"
    console.print(f"{bad} is [bold]{health['state']}[/], health [red]{health['health']}[/]: {reasons}")
    events = _events(tenant, allocation_id)[seen_events:]
    kinds = [e["kind"] for e in events]
    if kinds[:1] != ["degraded"] or kinds[-2:] != ["replaced", "ready"]:
        raise HealthDemoError(f"the tenant's events do not tell degraded ... replaced, ready: {kinds}")
    console.print(_events_table(events))


def _check_replacement(
    op: _Caller, sim_url: str, alloc: dict, *, bad: str, replacement: str, pod: str, kept: list[str]
) -> None:
    if set(alloc["node_ids"]) != {*kept, replacement}:
        raise HealthDemoError(f"expected nodes {sorted({*kept, replacement})}, allocation has {alloc['node_ids']}")
    node = op.call("GET", f"/v1/nodes/{replacement}")
    if node["pod"] != pod or node["state"] != "active" or node["allocation_id"] != alloc["id"]:
        raise HealthDemoError(
            f"replacement {replacement} is {node['state']} in {node['pod']} for "
            f"{node['allocation_id']}; expected active in {pod} for {alloc['id']}"
        )
    pulled = op.call("GET", f"/v1/nodes/{bad}")
    if pulled["allocation_id"] == alloc["id"]:
        raise HealthDemoError(f"{bad} is still {pulled['state']} in {alloc['id']}")
    try:
        sim_node = httpx.get(f"{sim_url}/v1/nodes/{replacement}", timeout=10).json()
    except httpx.HTTPError as exc:
        raise HealthDemoError(f"simulated fleet: reading {replacement} failed: {exc}") from exc
    if sim_node.get("tenant_id") != alloc["tenant_id"]:
        raise HealthDemoError(
            f"the tenant's workload is not on {replacement} (agent reports tenant {sim_node.get('tenant_id')})"
        )
