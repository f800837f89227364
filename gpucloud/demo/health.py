"""The health part of `gpucloud demo`: a GPU falls off the bus on a node of a ready allocation,
the control plane pulls the node, provisions a replacement in the same fabric domain, and the
allocation is ready again; the tenant reads what happened in the allocation's event log.

The fault is injected through the operator API (`POST /v1/nodes/{id}/xid`, as if the node's
agent had reported XID 79); everything the demo then checks it reads through the public API,
the tenant's view with the tenant's key. The simulated fleet is asked only whether the tenant's
workload now runs on the replacement.
"""

from __future__ import annotations

from rich.table import Table

from gpucloud.client.api import Gpucloud
from gpucloud.demo.common import Demo, DemoFailed
from gpucloud.models.health_tables import AllocationEventPublic
from gpucloud.models.tables import AllocationPublic

FATAL_XID = 79  # fell off the bus: drain now, no grace period for the tenant
FAULTY_GPU = 3


def _events_table(events: list[AllocationEventPublic]) -> Table:
    table = Table(title="allocation events (the tenant's view)")
    for column in ("at", "kind", "node", "replacement", "reason"):
        table.add_column(column)
    for e in events:
        table.add_row(f"{e.at:%H:%M:%S}", e.kind, e.node_id or "", e.replacement_node_id or "", e.reason)
    return table


def demo_health(demo: Demo, tenant: Gpucloud, allocation_id: str, *, timeout_s: float = 180) -> str:
    """Fail one node of the ready allocation and show it replaced; `timeout_s` bounds the waits.
    Returns the node pulled."""
    alloc = tenant.allocations.get(allocation_id)
    if alloc.status != "ready" or not alloc.node_ids:
        raise DemoFailed(
            f"allocation {allocation_id} is {alloc.status} with {len(alloc.node_ids)} nodes; "
            "the health demo needs a ready one"
        )
    members, pod = list(alloc.node_ids), alloc.fabric_domain
    bad = members[0]
    seen_events = len(list(tenant.allocations.events(allocation_id)))

    decision = demo.operator.nodes.report_xid(
        bad, FATAL_XID, gpu_index=FAULTY_GPU, message="demo: GPU has fallen off the bus"
    ).decisions[0]
    demo.console.print(
        f"[red]XID {FATAL_XID}[/] on {bad} GPU {FAULTY_GPU} (fell off the bus): health "
        f"[bold]{decision.health}[/], action [bold]{decision.action}[/]"
    )
    if decision.pull != "replace":
        raise DemoFailed(
            f"expected the control plane to replace {bad} in {allocation_id}, it decided "
            f"pull={decision.pull!r}" + (f" ({decision.alert})" if decision.alert else "")
        )

    def pulled() -> AllocationPublic | None:
        a = tenant.allocations.get(allocation_id)
        return a if bad not in a.node_ids else None

    def replacement_started() -> AllocationEventPublic | None:
        new = list(tenant.allocations.events(allocation_id))[seen_events:]
        return next((e for e in new if e.kind == "replacement_started"), None)

    def ready_again() -> AllocationPublic | None:
        a = tenant.allocations.get(allocation_id)
        if a.status == "failed":
            raise DemoFailed(f"allocation {allocation_id} failed: {a.failure_reason}")
        return a if a.status == "ready" and bad not in a.node_ids and len(a.node_ids) == len(members) else None

    degraded, started, alloc = demo.stages(
        [
            (f"pull {bad} out of {allocation_id}", pulled),
            ("reserve and provision a replacement", replacement_started),
            (f"{allocation_id} ready again", ready_again),
        ],
        timeout_s=timeout_s,
    )
    demo.console.print(
        f"{bad} pulled: allocation was [yellow]{degraded.status}[/] "
        f"({degraded.failure_reason or 'replacement pending'})"
    )
    replacement = str(started.node_id)
    demo.console.print(f"replacement started: {replacement}")
    _check_replacement(demo, alloc, bad=bad, replacement=replacement, pod=pod, kept=members[1:])
    demo.console.print(f"allocation [green]ready[/] again: {replacement} replaced {bad}, same fabric domain {pod}")

    health = demo.operator.nodes.health(bad)
    reasons = "; ".join(c["reason"] for c in health.conditions) or "none"
    demo.console.print(f"{bad} is [bold]{health.state}[/], health [red]{health.health}[/]: {reasons}")
    events = list(tenant.allocations.events(allocation_id))[seen_events:]
    kinds = [e.kind for e in events]
    if kinds[:1] != ["degraded"] or kinds[-2:] != ["replaced", "ready"]:
        raise DemoFailed(f"the tenant's events do not tell degraded ... replaced, ready: {kinds}")
    demo.console.print(_events_table(events))
    return bad


def _check_replacement(
    demo: Demo, alloc: AllocationPublic, *, bad: str, replacement: str, pod: str | None, kept: list[str]
) -> None:
    if set(alloc.node_ids) != {*kept, replacement}:
        raise DemoFailed(f"expected nodes {sorted({*kept, replacement})}, allocation has {alloc.node_ids}")
    node = demo.operator.nodes.get(replacement)
    if node.pod != pod or node.state != "active" or node.allocation_id != alloc.id:
        raise DemoFailed(
            f"replacement {replacement} is {node.state} in {node.pod} for "
            f"{node.allocation_id}; expected active in {pod} for {alloc.id}"
        )
    pulled = demo.operator.nodes.get(bad)
    if pulled.allocation_id == alloc.id:
        raise DemoFailed(f"{bad} is still {pulled.state} in {alloc.id}")
    workload = demo.sim.node(replacement).get("tenant_id")
    if workload != alloc.tenant_id:
        raise DemoFailed(f"the tenant's workload is not on {replacement} (agent reports tenant {workload})")
