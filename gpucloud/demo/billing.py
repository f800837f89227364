"""The demo's last step: what the tenant's allocation cost, to the millisecond.

The simulated agents metered the allocation's GPU time into their spools and shipped it to the
ledger. Once every node's meter closed its last interval and its spool drained, the ledger's
total (read through the control plane's API) must equal what the agents metered, exactly; then
the current period's draft invoice is shown as a table.
"""

from __future__ import annotations

import time

from gpucloud.cli.billing import gpu_hours, invoice_table, money
from gpucloud.client.api import Gpucloud
from gpucloud.demo.common import Demo, DemoFailed
from gpucloud.sim.client import SimFleetClient


def _metered(sim: SimFleetClient, allocation_id: str) -> tuple[int, int, bool]:
    """GPU-ms the agents metered for the allocation, on how many nodes, and whether all of it shipped."""
    gpu_ms, nodes, settled = 0, 0, True
    for node in sim.metering()["nodes"].values():
        intervals = [a for a in node["allocations"] if a["allocation_id"] == allocation_id]
        if not intervals:
            continue
        nodes += 1
        settled &= node["pending"] == 0 and all(a["ended_ms"] is not None for a in intervals)
        gpu_ms += sum(((a["ended_ms"] or a["started_ms"]) - a["started_ms"]) * a["gpu_count"] for a in intervals)
    return gpu_ms, nodes, settled


def demo_invoice(demo: Demo, tenant: Gpucloud, allocation_id: str, *, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    with demo.console.status("agents ship the last usage samples to the ledger"):
        while True:
            metered, nodes, settled = _metered(demo.sim, allocation_id)
            usage = tenant.billing.usage(allocation_id=allocation_id)
            if settled and usage.gpu_ms == metered:
                break
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"after {timeout_s:.0f}s the ledger holds {usage.gpu_ms} GPU-ms of "
                    f"{allocation_id}, the agents metered {metered}"
                )
            time.sleep(0.5)
    demo.console.print(
        f"metered {gpu_hours(metered)} GPU-hours on {nodes} nodes; the ledger holds exactly "
        f"{metered:,} GPU-ms, {money(usage.amount_micro)}"
    )
    draft = tenant.billing.draft()
    demo.console.print(invoice_table(draft.body, status="draft until the period ends"))
