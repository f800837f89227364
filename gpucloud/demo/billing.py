"""The demo's last step: what the tenant's allocation cost, to the millisecond.

The simulated agents metered the allocation's GPU time into their spools and shipped it to the
ledger. Once every node's meter closed its last interval and its spool drained, the ledger's
total (read through the control plane's API) must equal what the agents metered, exactly; then
the current period's draft invoice is shown as a table.
"""

from __future__ import annotations

import json
import time

import httpx
from rich.console import Console

from gpucloud.cli.billing import gpu_hours, invoice_table, money


class BillingDemoError(RuntimeError):
    pass


def _metered(sim_url: str, allocation_id: str) -> tuple[int, int, bool]:
    """GPU-ms the agents metered for the allocation, on how many nodes, and whether all of it shipped."""
    report = httpx.get(f"{sim_url}/v1/metering", timeout=10).json()
    gpu_ms, nodes, settled = 0, 0, True
    for node in report["nodes"].values():
        intervals = [a for a in node["allocations"] if a["allocation_id"] == allocation_id]
        if not intervals:
            continue
        nodes += 1
        settled &= node["pending"] == 0 and all(a["ended_ms"] is not None for a in intervals)
        gpu_ms += sum(((a["ended_ms"] or a["started_ms"]) - a["started_ms"]) * a["gpu_count"] for a in intervals)
    return gpu_ms, nodes, settled


def demo_invoice(
    console: Console, api_url: str, api_key: str, sim_url: str, allocation_id: str, *, timeout_s: float = 60
) -> None:
    tenant = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    deadline = time.monotonic() + timeout_s
    with console.status("agents ship the last usage samples to the ledger"):
        while True:
            metered, nodes, settled = _metered(sim_url, allocation_id)
            usage = tenant.get("/v1/usage", params={"allocation_id": allocation_id})
            if usage.status_code != 200:
                raise BillingDemoError(f"GET /v1/usage -> HTTP {usage.status_code}: {usage.text[:300]}")
            if settled and usage.json()["gpu_ms"] == metered:
                break
            if time.monotonic() > deadline:
                raise BillingDemoError(
                    f"after {timeout_s:.0f}s the ledger holds {usage.json()['gpu_ms']} GPU-ms of "
                    f"{allocation_id}, the agents metered {metered}"
                )
            time.sleep(0.5)
    console.print(
        f"metered {gpu_hours(metered)} GPU-hours on {nodes} nodes; the ledger holds exactly "
        f"{metered:,} GPU-ms, {money(usage.json()['amount_micro'])}"
    )
    draft = tenant.get("/v1/invoices:draft")
    if draft.status_code != 200:
        raise BillingDemoError(f"GET /v1/invoices:draft -> HTTP {draft.status_code}: {draft.text[:300]}")
    console.print(invoice_table(json.loads(draft.content), status="draft until the period ends"))
