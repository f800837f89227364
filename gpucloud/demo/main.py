"""`gpucloud demo`: a private stack, then a tenant's day through the public API only.

Create a tenant and a key, allocate GPU nodes (idempotently) with a workload that names the
tenant's SSH key, watch them provision, list them, log in to one over SSH, watch the reconciler
restore a node wiped behind its back, fail a GPU and watch its node pulled and replaced in the
same fabric domain, push and pull model weights, roll the production version out to the
allocation in waves and watch a failing candidate roll back, cancel (the SSH key is refused from
then on), and watch the nodes (the pulled one through repair) booted once from the clean image
through their BMCs, checked, wiped and burned in before a second tenant gets them; last, the
allocation's GPU time as the ledger billed it, to the millisecond, and the period's draft invoice;
then a request for more nodes than are free waits in the pool's queue and is placed once the
second tenant's nodes come back; the second tenant's preemptible nodes are taken back, with
notice, for the first's on-demand request; and a capacity reservation is ready by its window's
start and ends on time.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from gpucloud import bootstrap
from gpucloud.client.api import ApiError, ApiTimeout, Gpucloud
from gpucloud.config import Settings
from gpucloud.demo.billing import demo_invoice
from gpucloud.demo.cleaning import show_reimage
from gpucloud.demo.common import Demo, DemoFailed
from gpucloud.demo.health import demo_health
from gpucloud.demo.incidents import demo_incident
from gpucloud.demo.power import demo_power_cycle
from gpucloud.demo.queue import demo_preemption, demo_queue, demo_reservation
from gpucloud.demo.rollout import demo_rollout
from gpucloud.demo.ssh import TenantKey, demo_ssh, demo_ssh_refused
from gpucloud.demo.tenants import demo_tenants, fleet_quota, onboard
from gpucloud.demo.weights import demo_weights
from gpucloud.devstack.stack import Stack, StackError, free_port, with_local_tls
from gpucloud.models.tables import NodePublic
from gpucloud.protocol.actions import AgentAction, Workload


def _node_table(nodes: list[NodePublic]) -> Table:
    table = Table(title="nodes")
    for column in ("id", "state", "rack", "allocation", "tenant"):
        table.add_column(column)
    for n in nodes:
        table.add_row(n.id, n.state, n.rack, n.allocation_id or "", n.tenant_id or "")
    return table


def _in_state(demo: Demo, state: str) -> int:
    return sum(1 for _ in demo.operator.nodes.list(state=state))


def _members(demo: Demo, allocation_id: str) -> list[NodePublic]:
    return [n for n in demo.operator.nodes.list() if n.allocation_id == allocation_id]


def show_reconciler(demo: Demo, alloc_id: str, tenant_id: str) -> None:
    """A node is re-imaged behind the control plane's back: its agent's next heartbeat shows an
    active node without the tenant's workload, and the reconciler restores it."""
    victim = _members(demo, alloc_id)[0].id
    demo.sim.drift(victim, AgentAction.WIPE)
    demo.console.print(f"[yellow]{victim} was wiped behind the control plane's back[/] (simulated re-image)")
    demo.wait(f"reconciler restores {victim}", 1, lambda: int(demo.sim.node(victim)["tenant_id"] == tenant_id))
    events = list(demo.operator.nodes.events(victim))
    demo.console.print(
        f"{victim} restored; {len(events)} events recorded, last: "
        f"{events[-1].from_state} -> {events[-1].to_state} ({events[-1].event})"
    )
    summary = demo.operator.nodes.summary()
    demo.console.print(f"fleet summary: {summary['by_state']}, health {summary['by_health']}")


def show_workload_output(demo: Demo, acme: Gpucloud, alloc_id: str) -> None:
    """The tenant reads what its workload printed on a node (`allocations logs`): the last lines,
    as the agent kept them."""
    node_id = acme.allocations.get(alloc_id).node_ids[0]
    text = ""
    deadline = time.monotonic() + 30
    while not text.strip() and time.monotonic() < deadline:
        text = "".join(acme.allocations.logs(alloc_id, node_id, tail=3))
        if not text.strip():
            time.sleep(1)
    if not text.strip():
        raise DemoFailed(f"the workload on {node_id} printed nothing in 30 s")
    demo.console.print(f"[green]workload output[/] on {node_id} (`gpucloud allocations logs {alloc_id} --tail 3`):")
    for line in text.strip().splitlines():
        demo.console.print(f"  {line}", markup=False, highlight=False)


def _allocate(demo: Demo, acme: Gpucloud, want: int, *, workload: Workload | None = None) -> str:
    """An allocation created under an Idempotency-Key, replayed once; provisioned until ready."""
    key = f"demo-{time.time_ns()}"
    first = acme.allocations.create("H100", "us-east-1", want, workload=workload, idempotency_key=key)
    replay = acme.allocations.create("H100", "us-east-1", want, workload=workload, idempotency_key=key)
    alloc_id = first.allocation.id
    if replay.allocation.id != alloc_id:
        raise DemoFailed("an idempotent replay created a second allocation")
    demo.console.print(
        f"allocation {alloc_id}: {want} x H100 nodes in {first.allocation.fabric_domain}"
        f" (replay with the same Idempotency-Key returned the same allocation)"
    )

    def provisioned() -> int:
        if acme.allocations.get(alloc_id).status in ("ready", "failed"):
            return want
        return min(want - 1, sum(1 for n in _members(demo, alloc_id) if n.state == "active"))

    demo.wait(f"provisioning {alloc_id}", want, provisioned)
    alloc = acme.allocations.get(alloc_id)
    if alloc.status != "ready":
        raise DemoFailed(f"allocation is {alloc.status}, expected ready: {alloc.failure_reason}")
    if first.operation is not None:
        operation = acme.operations.get(first.operation.id)
        demo.console.print(f"allocation [green]ready[/]; operation {operation.id} {operation.status}")
    demo.console.print(_node_table(_members(demo, alloc_id)))
    return alloc_id


def scenario(demo: Demo, nodes: int, data_dir: Path) -> None:
    demo.wait(
        f"fleet: {nodes} nodes enrolled -> inspected -> burned in -> available",
        nodes,
        lambda: _in_state(demo, "available"),
    )
    tenant, acme_key = onboard(demo, "acme", quotas=fleet_quota(nodes))
    demo.console.print(
        f"tenant [bold]{tenant.name}[/] ({tenant.id}) onboarded: VNI {tenant.vni}, "
        f"storage {tenant.storage_prefix}, first API key {acme_key.split('.')[0]}"
    )
    acme = demo.tenant(acme_key)
    ssh_key = TenantKey.generate()
    workload = Workload(command=["python", "train.py"], ssh_keys=[ssh_key.public])
    alloc_id = _allocate(demo, acme, max(1, min(4, nodes // 2)), workload=workload)
    ssh_endpoint = demo_ssh(demo, acme, alloc_id, ssh_key)
    show_workload_output(demo, acme, alloc_id)

    demo_tenants(demo, tenant, alloc_id)
    show_reconciler(demo, alloc_id, tenant.id)
    pulled = demo_health(demo, acme, alloc_id)
    pushed = demo_weights(demo.console, demo.api_url, acme_key, data_dir)
    demo_rollout(demo, acme, alloc_id, production=pushed.production, bad=pushed.bad)

    held = [n.id for n in _members(demo, alloc_id)]
    seen = {n: len(list(demo.operator.nodes.events(n))) for n in held}
    cancel = acme.allocations.cancel(alloc_id)
    demo.console.print(f"cancel accepted: allocation is [yellow]{cancel.allocation.status}[/]")
    demo.wait("agents confirm release", 1, lambda: int(acme.allocations.get(alloc_id).status == "released"))
    demo_ssh_refused(demo, ssh_endpoint, ssh_key)
    demo.wait(
        "nodes re-imaged through their BMCs, wiped, burned in, back in the pool",
        nodes,
        lambda: _in_state(demo, "available"),
        timeout_s=300,
    )
    states = Counter(n.state.value for n in demo.operator.nodes.list())
    demo.console.print(f"allocation [bold]released[/]; fleet: {dict(states)}")
    show_reimage(demo, held[0], seen=seen[held[0]], tenant=tenant.name)
    demo_incident(demo, acme, pulled)
    initech, initech_alloc = _next_tenant(demo, held, want=len(held))
    demo_power_cycle(demo)
    demo_invoice(demo, acme, alloc_id)
    demo_queue(demo, acme, initech, initech_alloc, want=nodes - len(held) + 1)
    demo.wait("the pool back", nodes, lambda: _in_state(demo, "available"), timeout_s=300)
    demo_preemption(demo, acme, initech, free=nodes, spare=len(held))
    demo_reservation(demo, acme, nodes=len(held), lead_s=20, window_s=10)


def _next_tenant(demo: Demo, cleaned: list[str], *, want: int) -> tuple[Gpucloud, str]:
    """A second tenant's allocation after acme's: it gets nodes acme held, each re-imaged since."""
    tenant, key = onboard(demo, "initech", quotas=fleet_quota(want))
    client = demo.tenant(key)
    alloc_id = _allocate(demo, client, want)
    reused = sorted(set(cleaned) & {n.id for n in _members(demo, alloc_id)})
    demo.console.print(
        f"tenant {tenant.name} got {', '.join(reused) or 'other nodes'}"
        + (" [green]re-imaged out of band since acme held them[/]" if reused else "")
    )
    return client, alloc_id


def run_demo(*, nodes: int, data_dir: Path | None, console: Console, tls: bool = False) -> int:
    data_dir = data_dir or Path(".data") / "demo"
    shutil.rmtree(data_dir, ignore_errors=True)
    settings = Settings(
        data_dir=data_dir,
        temporal={"address": f"127.0.0.1:{free_port()}"},
        api={"port": free_port()},
        # Agents heartbeat every second; one silent for 6 s is unreachable, for 8 s more its
        # host is down and is power-cycled through its BMC.
        agent={"sim_port": free_port(), "meter_interval_s": 1.0, "heartbeat_timeout_s": 6.0},
        # The emulated BMCs apply a power change 1 to 2 s after it is asked for (hardware: up to 11).
        bmc={
            "emulator_port": free_port(),
            "emulator_power_delay_s": (1, 2),
            "power_cycle_after_s": 8.0,
            "poll_s": 0.5,
            "boot_wait_s": 120.0,
        },
        reconciler={"sweep_interval_s": 2.0},
        # An incident reads its node's history every 2 s (30 s in production).
        health={"incident_poll_s": 2.0},
        # The queue is planned every second; a preempted allocation gets 5 s of notice; a
        # reservation may start 15 s after it is booked, its allocation placed 12 s ahead.
        scheduler={
            "poll_s": 1.0,
            "queue_recheck_s": 10.0,
            "preemption_notice_s": 5.0,
            "reservation_min_notice_s": 15.0,
            "reservation_hold_s": 60.0,
            "reservation_prepare_s": 12.0,
        },
        ledger={"port": free_port()},
        tracker={"url": f"http://127.0.0.1:{free_port()}"},
    )
    if tls:
        settings = with_local_tls(settings)
    stack = Stack(
        settings,
        nodes=nodes,
        ui_port=free_port(),
        sim_latency_scale=0.5,
        sim_heartbeat_s=1.0,
        billing=True,
        tracker=True,
        bmc=True,
        clean_image=True,
    )
    started = time.monotonic()
    try:
        with console.status("starting the stack") as status:
            stack.start(on_step=lambda s: status.update(s))
        console.print(
            f"stack up: API {settings.api_url}, console {settings.api_url}/console, Web UI {stack.ui_url},"
            f" logs in {stack.log_dir}"
        )
        demo = Demo.connect(
            console,
            settings.api_url,
            settings.operator_token,
            settings.sim_url,
            issuer=bootstrap.token_issuer(settings),
        )
        try:
            scenario(demo, nodes, data_dir)
        finally:
            demo.close()
    except (StackError, DemoFailed, ApiError, ApiTimeout, httpx.HTTPError) as exc:
        console.print(f"[red]demo failed:[/] {exc}\nlogs: {stack.log_dir}")
        return 1
    finally:
        with console.status("stopping the stack"):
            stack.stop()
    console.print(f"[green]demo succeeded[/] in {time.monotonic() - started:.0f}s")
    return 0
