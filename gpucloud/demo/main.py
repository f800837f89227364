"""`gpucloud demo`: a private stack, then a tenant's day through the public API only.

Create a tenant and a key, allocate GPU nodes (idempotently), watch them provision, list them,
watch the reconciler restore a node wiped behind its back, fail a GPU and watch its node pulled
and replaced in the same fabric domain, push and pull model weights, roll the production version
out to the allocation in waves and watch a failing candidate roll back, cancel, and watch the nodes
(the pulled one through repair) go back to the pool through wipe and burn-in; last, the
allocation's GPU time as the ledger billed it, to the millisecond, and the period's draft invoice.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpucloud.config import Settings
from gpucloud.demo.billing import BillingDemoError, demo_invoice
from gpucloud.demo.health import HealthDemoError, demo_health
from gpucloud.demo.rollout import RolloutDemoError, demo_rollout
from gpucloud.demo.tenants import TenantsDemoError, demo_tenants, onboard
from gpucloud.demo.weights import WeightsDemoError, demo_weights
from gpucloud.devstack.stack import Stack, StackError, free_port


class DemoFailed(RuntimeError):
    pass


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def call(self, method: str, path: str, *, expect: tuple[int, ...] = (200,), **kw) -> dict:
        resp = self.http.request(method, path, **kw)
        if resp.status_code not in expect:
            raise DemoFailed(f"{method} {path} -> HTTP {resp.status_code}: {resp.text[:400]}")
        return resp.json()

    def all_nodes(self) -> list[dict]:
        items, token = [], ""
        while True:
            page = self.call("GET", "/v1/nodes", params={"page_size": 200, **({"page_token": token} if token else {})})
            items += page["items"]
            token = page["next_page_token"]
            if not token:
                return items


def _wait(console: Console, what: str, total: int, done_count, timeout_s: float = 180) -> None:
    with _progress(console) as progress:
        task = progress.add_task(what, total=total)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = done_count()
            progress.update(task, completed=done)
            if done >= total:
                return
            time.sleep(0.3)
    raise DemoFailed(f"timed out after {timeout_s:.0f}s waiting: {what}")


def _node_table(nodes: list[dict]) -> Table:
    table = Table(title="nodes")
    for col in ("id", "state", "rack", "allocation", "tenant"):
        table.add_column(col)
    for n in nodes:
        table.add_row(n["id"], n["state"], n["rack"], n["allocation_id"] or "", n["tenant_id"] or "")
    return table


def show_reconciler(console: Console, op: Api, sim_url: str, alloc_id: str, tenant_id: str) -> None:
    """A node is re-imaged behind the control plane's back: its agent's next heartbeat shows an
    active node without the tenant's workload, and the reconciler restores it."""
    victim = next(n for n in op.all_nodes() if n["allocation_id"] == alloc_id)["id"]
    httpx.post(f"{sim_url}/v1/nodes/{victim}/drift", json={"kind": "wipe"}, timeout=10).raise_for_status()
    console.print(f"[yellow]{victim} was wiped behind the control plane's back[/] (simulated re-image)")
    _wait(
        console,
        f"reconciler restores {victim}",
        1,
        lambda: int(httpx.get(f"{sim_url}/v1/nodes/{victim}", timeout=10).json()["tenant_id"] == tenant_id),
    )
    events = op.call("GET", f"/v1/nodes/{victim}/events")["items"]
    console.print(
        f"{victim} restored; {len(events)} events recorded, last: "
        f"{events[-1]['from_state']} -> {events[-1]['to_state']} ({events[-1]['event']})"
    )
    summary = op.call("GET", "/v1/fleet/summary")
    console.print(f"fleet summary: {summary['by_state']}, health {summary['by_health']}")


def scenario(console: Console, api_url: str, operator_token: str, nodes: int, sim_url: str, data_dir: Path) -> None:
    op = Api(api_url, operator_token)
    _wait(
        console,
        f"fleet: {nodes} nodes enrolled -> inspected -> burned in -> available",
        nodes,
        lambda: sum(1 for n in op.all_nodes() if n["state"] == "available"),
    )

    tenant, acme_key = onboard(console, api_url, operator_token, "acme")
    console.print(
        f"tenant [bold]{tenant['name']}[/] ({tenant['id']}) onboarded: VNI {tenant['vni']}, "
        f"storage {tenant['storage_prefix']}, first API key {acme_key.split('.')[0]}"
    )
    acme = Api(api_url, acme_key)

    want = max(1, min(4, nodes // 2))
    body = {"gpu_type": "H100", "node_count": want, "region": "us-east-1"}
    idem = {"Idempotency-Key": str(uuid.uuid4())}
    first = acme.call("POST", "/v1/allocations", json=body, headers=idem, expect=(202,))
    replay = acme.call("POST", "/v1/allocations", json=body, headers=idem, expect=(202,))
    alloc_id = first["allocation"]["id"]
    if replay["allocation"]["id"] != alloc_id:
        raise DemoFailed("an idempotent replay created a second allocation")
    console.print(
        f"allocation {alloc_id}: {want} x H100 nodes in {first['allocation']['fabric_domain']}"
        f" (replay with the same Idempotency-Key returned the same allocation)"
    )

    def provisioned() -> int:
        if acme.call("GET", f"/v1/allocations/{alloc_id}")["status"] in ("ready", "failed"):
            return want
        return min(
            want - 1, sum(1 for n in op.all_nodes() if n["allocation_id"] == alloc_id and n["state"] == "active")
        )

    _wait(console, f"provisioning {alloc_id}", want, provisioned)
    alloc = acme.call("GET", f"/v1/allocations/{alloc_id}")
    if alloc["status"] != "ready":
        raise DemoFailed(f"allocation is {alloc['status']}, expected ready: {alloc.get('failure_reason')}")
    operation = acme.call("GET", f"/v1/operations/{first['operation']['id']}")
    console.print(f"allocation [green]ready[/]; operation {operation['id']} {operation['status']}")
    console.print(_node_table([n for n in op.all_nodes() if n["allocation_id"] == alloc_id]))

    demo_tenants(console, api_url, operator_token, tenant, acme_key, alloc_id)
    show_reconciler(console, op, sim_url, alloc_id, tenant["id"])
    demo_health(console, api_url, operator_token, acme_key, alloc_id, sim_url)
    pushed = demo_weights(console, api_url, acme_key, data_dir)
    demo_rollout(console, api_url, acme_key, sim_url, alloc_id, production=pushed.production, other=pushed.first)

    cancel = acme.call("POST", f"/v1/allocations/{alloc_id}/cancel", expect=(202,))
    console.print(f"cancel accepted: allocation is [yellow]{cancel['allocation']['status']}[/]")
    _wait(
        console,
        "agents confirm release",
        1,
        lambda: int(acme.call("GET", f"/v1/allocations/{alloc_id}")["status"] == "released"),
    )
    _wait(
        console,
        "nodes wiped, burned in, back in the pool",
        nodes,
        lambda: sum(1 for n in op.all_nodes() if n["state"] == "available"),
    )
    states = Counter(n["state"] for n in op.all_nodes())
    console.print(f"allocation [bold]released[/]; fleet: {dict(states)}")
    demo_invoice(console, api_url, acme_key, sim_url, alloc_id)


def run_demo(*, nodes: int, data_dir: Path | None, console: Console) -> int:
    data_dir = data_dir or Path(".data") / "demo"
    shutil.rmtree(data_dir, ignore_errors=True)
    settings = Settings(
        data_dir=data_dir,
        temporal={"address": f"127.0.0.1:{free_port()}"},
        api={"port": free_port()},
        agent={"sim_port": free_port(), "meter_interval_s": 1.0},
        reconciler={"sweep_interval_s": 2.0},
        ledger={"port": free_port()},
        tracker={"url": f"http://127.0.0.1:{free_port()}"},
    )
    stack = Stack(
        settings,
        nodes=nodes,
        ui_port=free_port(),
        sim_latency_scale=0.5,
        sim_heartbeat_s=1.0,
        billing=True,
        tracker=True,
    )
    started = time.monotonic()
    try:
        with console.status("starting the stack") as status:
            stack.start(on_step=lambda s: status.update(s))
        console.print(f"stack up: API {settings.api_url}, Web UI {stack.ui_url}, logs in {stack.log_dir}")
        scenario(console, settings.api_url, settings.operator_token, nodes, settings.sim_url, data_dir)
    except (
        StackError,
        DemoFailed,
        TenantsDemoError,
        HealthDemoError,
        WeightsDemoError,
        RolloutDemoError,
        BillingDemoError,
        httpx.HTTPError,
    ) as exc:
        console.print(f"[red]demo failed:[/] {exc}\nlogs: {stack.log_dir}")
        return 1
    finally:
        with console.status("stopping the stack"):
            stack.stop()
    console.print(f"[green]demo succeeded[/] in {time.monotonic() - started:.0f}s")
    return 0
