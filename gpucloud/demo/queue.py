"""The demo's full pool (docs/scheduling.md): a request for more nodes than are free waits in the
pool's queue (its position, the queue as `gpucloud queue` shows it), and is placed and
provisioned as a whole gang as soon as the nodes held by another tenant come back to the pool."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from rich.table import Table

from gpucloud.client.api import Gpucloud
from gpucloud.demo.common import Demo, DemoFailed


def demo_queue(demo: Demo, waiter: Gpucloud, holder: Gpucloud, held_alloc: str, *, want: int) -> None:
    """`waiter` asks for `want` nodes while `holder` holds `held_alloc`; `holder` cancels it."""
    accepted = waiter.allocations.create(
        "H100",
        "us-east-1",
        want,
        queue=True,
        max_wait_s=600,
        expected_duration_s=3600,
        idempotency_key=f"demo-queue-{time.time_ns()}",
    )
    alloc = accepted.allocation
    if alloc.status != "queued":
        raise DemoFailed(f"expected the request for {want} nodes to queue, it is {alloc.status}")
    demo.console.print(
        f"pool full: allocation {alloc.id} for {want} nodes [yellow]queued[/] at position {alloc.queue_position}"
        " (`gpucloud allocations create --queue --max-wait 10m`)"
    )
    table = Table(title="gpucloud queue")
    for column in ("pool", "position", "allocation", "nodes", "max wait"):
        table.add_column(column)
    for e in waiter.allocations.queue().items:
        pool = f"{e.gpu_type} {e.region}"
        table.add_row(pool, str(e.position), e.allocation_id, str(e.node_count), f"{e.max_wait_s} s")
    demo.console.print(table)
    holder.allocations.cancel(held_alloc)
    demo.console.print(f"the other tenant cancels {held_alloc}: its nodes go back through wipe and burn-in")
    demo.wait(
        f"queued allocation {alloc.id} placed and provisioned",
        1,
        lambda: int(waiter.allocations.get(alloc.id).status in ("ready", "failed")),
        timeout_s=300,
    )
    placed = waiter.allocations.get(alloc.id)
    if placed.status != "ready":
        raise DemoFailed(f"the queued allocation ended {placed.status}: {placed.failure_reason}")
    for event in waiter.allocations.events(alloc.id):
        if event.kind in ("queued", "placed"):
            demo.console.print(f"  {event.kind}: {event.reason}")
    where = f"{len(placed.node_ids)} nodes of {placed.fabric_domain}"
    demo.console.print(f"allocation {alloc.id} [green]ready[/] on {where}")
    waiter.allocations.cancel(alloc.id)
    demo.wait("released", 1, lambda: int(waiter.allocations.get(alloc.id).status == "released"))


def demo_preemption(demo: Demo, acme: Gpucloud, initech: Gpucloud, *, free: int, spare: int) -> None:
    """acme holds most of the pool; initech runs preemptible work on the rest; acme's next on-demand
    request takes those nodes back: initech gets its notice, its workload is stopped, acme is placed."""
    region = "us-east-1"
    held = _ready(demo, acme, acme.allocations.create("H100", region, free - spare).allocation.id)
    cheap = initech.allocations.create("H100", region, spare, tier="preemptible").allocation
    _ready(demo, initech, cheap.id)
    demo.console.print(f"initech runs {spare} nodes [cyan]preemptible[/] ({cheap.id}); the pool is full")
    urgent = acme.allocations.create("H100", region, spare).allocation
    demo.console.print(f"acme asks for {spare} more on-demand nodes: {urgent.id} is {urgent.status}, taking them back")
    demo.wait(
        f"{cheap.id} preempted after its notice, {urgent.id} placed on its nodes",
        1,
        lambda: int(acme.allocations.get(urgent.id).status in ("ready", "failed")),
        timeout_s=300,
    )
    for event in initech.allocations.events(cheap.id):
        if event.kind in ("preemption_notice", "preempted", "released"):
            demo.console.print(f"  initech's {event.kind}: {event.reason}")
    if acme.allocations.get(urgent.id).status != "ready":
        raise DemoFailed(f"the on-demand request ended {acme.allocations.get(urgent.id).status}")
    for alloc_id in (held, urgent.id):
        acme.allocations.cancel(alloc_id)
    demo.wait("both released", 2, lambda: sum(acme.allocations.get(a).status == "released" for a in (held, urgent.id)))


def demo_reservation(demo: Demo, acme: Gpucloud, *, nodes: int, lead_s: float, window_s: float) -> None:
    """acme books nodes for a window starting shortly: its allocation is ready by the start, and the
    window ends on time (the workload stopped with its grace period)."""
    start = datetime.now(UTC) + timedelta(seconds=lead_s)
    booked = acme.reservations.create("H100", "us-east-1", nodes, start, start + timedelta(seconds=window_s))
    demo.console.print(
        f"reservation {booked.id}: {nodes} H100 nodes from {start:%H:%M:%S} for {window_s:g} s [green]accepted[/]"
        " (`gpucloud reservations create --start +2h --duration 8h`)"
    )
    demo.wait(
        f"reservation {booked.id}: its allocation ready by the window's start",
        1,
        lambda: int(acme.reservations.get(booked.id).ready_at is not None),
        timeout_s=lead_s + 120,
    )
    ready = acme.reservations.get(booked.id)
    assert ready.ready_at is not None
    early = (start - ready.ready_at).total_seconds()
    verdict = f"[green]{early:.0f} s before its start[/]" if early >= 0 else f"[red]{-early:.0f} s late[/]"
    demo.console.print(f"allocation {ready.allocation_id} (tier reserved) ready {verdict}")
    demo.wait(
        f"reservation {booked.id}: the window ends, its allocation released",
        1,
        lambda: int(acme.reservations.get(booked.id).status == "ended"),
        timeout_s=window_s + 120,
    )
    demo.console.print(f"reservation {booked.id} [bold]ended[/] on time; billed for its window, used or not")


def _ready(demo: Demo, client: Gpucloud, alloc_id: str) -> str:
    demo.wait(f"{alloc_id} ready", 1, lambda: int(client.allocations.get(alloc_id).status in ("ready", "failed")))
    if (status := client.allocations.get(alloc_id).status) != "ready":
        raise DemoFailed(f"allocation {alloc_id} is {status}")
    return alloc_id
