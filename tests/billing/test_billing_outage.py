"""The control plane (API, worker and Temporal server) goes down while a tenant's allocation runs:
the agents keep metering into the ledger, a period ends meanwhile, and once the control plane is
back the scheduled close catches up and every millisecond the agents metered is billed, once.

The whole stack as `gpucloud up` runs it (its own processes and databases), on free ports.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from gpucloud.agent.shipper import Shipper
from gpucloud.agent.spool import Spool, Usage
from gpucloud.config import Settings
from gpucloud.devstack.stack import Stack, free_port
from gpucloud.ledger.client import UsageLedger
from gpucloud.ledger.periods import period_bounds, period_of
from gpucloud.ledger.pricing import Rate
from gpucloud.models.catalog import LIST_PRICE_PER_GPU_HOUR_MICRO
from gpucloud.models.workflow_ids import close_workflow_id
from gpucloud.sim.client import SimFleetClient
from support.ledger_auth import auth_for, register
from support.stack import wait_until

pytestmark = pytest.mark.e2e

MINUTE = 60_000
CONTROL_PLANE = ("temporal", "worker", "api")


@pytest.fixture
def stack(tmp_path):
    settings = Settings(
        data_dir=tmp_path,
        temporal={"address": f"127.0.0.1:{free_port()}"},
        api={"port": free_port(), "operator_token": "test-operator-token"},
        agent={"sim_port": free_port(), "meter_interval_s": 0.2},
        reconciler={"sweep_interval_s": 2.0},
        ledger={"port": free_port(), "close_interval_s": 2.0},
        telemetry={"worker_port": free_port(), "metrics_token": "test-metrics-token"},
    )
    stack = Stack(
        settings, nodes=2, ui_port=free_port(), sim_latency_scale=0.1, sim_heartbeat_s=1.0, headless=True, billing=True
    )
    try:
        stack.start()
        register(stack.ledger_url, tmp_path)  # the stack's ledger trusts the data dir's issuer key
        yield stack
    finally:
        stack.stop()


def metered(settings, allocation_id: str) -> tuple[int, bool]:
    """What the agents metered for the allocation (GPU-ms) and whether all of it is closed and shipped."""
    with SimFleetClient(settings.sim_url, token=settings.operator_token) as sim:
        nodes = sim.metering()["nodes"].values()
    intervals = [(a, n["pending"]) for n in nodes for a in n["allocations"] if a["allocation_id"] == allocation_id]
    done = bool(intervals) and all(a["ended_ms"] is not None and pending == 0 for a, pending in intervals)
    return sum(((a["ended_ms"] or a["started_ms"]) - a["started_ms"]) * a["gpu_count"] for a, _ in intervals), done


async def workflow_status(settings: Settings, workflow_id: str) -> WorkflowExecutionStatus:
    temporal = await Client.connect(settings.temporal.address)
    return (await temporal.get_workflow_handle(workflow_id).describe()).status


def late_agent_ships(ledger_url: str, spool_path, *, tenant_id: str, period_id: str, minutes: int) -> str:
    """A node that was offline ships usage of an allocation that ran in an earlier period."""
    allocation_id = f"alloc-earlier-{period_id}"
    start_ms = period_bounds(period_id)[0] + 86_400_000
    for kind, node in (("start", None), ("node_added", "late-node"), ("node_removed", "late-node"), ("end", None)):
        at_ms = start_ms if kind in ("start", "node_added") else start_ms + minutes * MINUTE
        event = {
            "event_id": f"{allocation_id}/{kind}",
            "allocation_id": allocation_id,
            "tenant_id": tenant_id,
            "kind": kind,
            "at_ms": at_ms,
            "node_id": node,
        }
        assert (
            httpx.post(auth=auth_for(ledger_url), url=f"{ledger_url}/v1/allocation-events", json=event).status_code
            == 201
        )
    spool = Spool(spool_path, "late-node")
    spool.append_many(
        [
            Usage(allocation_id, tenant_id, "H100", 8, start_ms + i * MINUTE, start_ms + (i + 1) * MINUTE)
            for i in range(minutes)
        ]
    )
    token = auth_for(ledger_url).token("agent", "node:late-node")  # what the API gives the node's agent
    shipper = Shipper(spool, UsageLedger(ledger_url, token=lambda: token))
    try:
        assert shipper.ship_once().acked == minutes
    finally:
        shipper.close()
        spool.close()
    return allocation_id


def scrape(url: str, token: str | None = "test-metrics-token") -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    answer = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert answer.status_code == (200 if token else 401), answer.text[:300]
    return answer.text


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition text (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{wanted}}}" if labels else name):
            return float(value)
    return 0.0


def check_metrics(stack, *, alloc_path: str) -> None:
    """Every server's /metrics answers only the metrics token, with the families it records."""
    settings = stack.settings
    worker_url = f"http://127.0.0.1:{settings.telemetry.worker_port}"
    for url in (settings.api_url, worker_url, stack.ledger_url):
        scrape(url, token=None)  # 401 without the token
    api = scrape(settings.api_url)
    assert sample(api, "gpucloud_nodes", state="active", gpu_type="H100", region="us-east-1") == 2
    assert sample(api, "gpucloud_allocations", status="ready") == 1
    assert sample(api, "gpucloud_api_requests_total", method="GET", route=alloc_path, status="200") >= 1
    worker = scrape(worker_url)
    assert sample(worker, "gpucloud_allocation_ready_seconds_count") == 1
    # The reconciler sweeps every `reconciler.sweep_interval_s` (15 s): an allocation ready in
    # less than that is checked before the first sweep has been recorded.
    wait_until(
        lambda: sample(scrape(worker_url), "gpucloud_reconciler_sweep_seconds_count") >= 1,
        timeout_s=60,
        what="a reconciler sweep recorded in the worker's metrics",
    )
    assert "temporal_" in worker  # the SDK's own runtime metrics
    assert httpx.get(f"{worker_url}/readyz", timeout=10).json()["checks"] == {
        "database": "ok",
        "temporal": "ok",
        "object store": "ok",
    }
    wait_until(
        lambda: sample(scrape(stack.ledger_url), "gpucloud_ledger_usage_samples_total", outcome="accepted") > 0,
        timeout_s=30,
        what="usage ingested by the ledger",
    )


def test_usage_is_complete_and_the_close_catches_up_after_a_control_plane_outage(stack, tmp_path) -> None:
    settings = stack.settings
    op = httpx.Client(
        base_url=settings.api_url, timeout=30, headers={"Authorization": f"Bearer {settings.operator_token}"}
    )
    wait_until(
        lambda: [n["state"] for n in op.get("/v1/nodes").json()["items"]] == ["available"] * 2,
        timeout_s=120,
        what="fleet available",
    )
    quotas = [{"gpu_type": "H100", "region": "us-east-1", "max_gpus": 32}]
    tenant = op.post("/v1/tenants", json={"name": "outage", "quotas": quotas}).json()
    created = op.post(f"/v1/tenants/{tenant['id']}/api-keys")
    assert created.status_code == 201, created.text
    key = created.json()["key"]
    wait_until(
        lambda: op.get(f"/v1/tenants/{tenant['id']}").json()["status"] == "active",
        timeout_s=60,
        what="tenant onboarded",
    )
    acme = httpx.Client(base_url=settings.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    alloc_id = acme.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"}).json()[
        "allocation"
    ]["id"]
    wait_until(
        lambda: acme.get(f"/v1/allocations/{alloc_id}").json()["status"] == "ready",
        timeout_s=60,
        what="allocation ready",
    )
    check_metrics(stack, alloc_path="/v1/allocations/{allocation_id}")
    ledger_usage = {"tenant_id": tenant["id"], "allocation_id": alloc_id}
    wait_until(
        lambda: (
            httpx.get(auth=auth_for(stack.ledger_url), url=f"{stack.ledger_url}/v1/usage", params=ledger_usage).json()[
                "gpu_ms"
            ]
            > 0
        ),
        timeout_s=30,
        what="usage reaches the ledger",
    )

    stack.stop(only=CONTROL_PLANE)
    with pytest.raises(httpx.HTTPError):
        acme.get("/v1/usage")
    before = httpx.get(auth=auth_for(stack.ledger_url), url=f"{stack.ledger_url}/v1/usage", params=ledger_usage).json()[
        "gpu_ms"
    ]
    # An earlier period, never closed, is due: its usage arrives while the control plane is down.
    earlier = period_of(period_bounds(period_of(time.time_ns() // 1_000_000))[0] - 1)
    late_agent_ships(stack.ledger_url, tmp_path / "late-node.db", tenant_id=tenant["id"], period_id=earlier, minutes=30)
    wait_until(
        lambda: (
            httpx.get(auth=auth_for(stack.ledger_url), url=f"{stack.ledger_url}/v1/usage", params=ledger_usage).json()[
                "gpu_ms"
            ]
            >= before + 2 * 8 * 2_000
        ),
        timeout_s=30,
        what="the agents keep metering without the control plane",
    )
    assert all(
        not p["closed_ms"]
        for p in httpx.get(auth=auth_for(stack.ledger_url), url=f"{stack.ledger_url}/v1/periods").json()
    )

    stack.start(only=CONTROL_PLANE)
    invoices = wait_until(
        lambda: acme.get("/v1/invoices").json()["items"], timeout_s=90, what="the scheduled close caught up"
    )
    assert [(i["period_id"], i["tenant_id"]) for i in invoices] == [(earlier, tenant["id"])]
    document = json.loads(acme.get(f"/v1/invoices/{invoices[0]['id']}").content)
    assert document["total_micro"] == Rate(LIST_PRICE_PER_GPU_HOUR_MICRO["H100"]).amount_for(30 * 8 * MINUTE)
    # The invoice is stored by the close activity; the workflow completes a moment after it.
    wait_until(
        lambda: (
            asyncio.run(workflow_status(settings, close_workflow_id(settings.temporal.task_queue, earlier)))
            == WorkflowExecutionStatus.COMPLETED
        ),
        timeout_s=30,
        interval_s=0.5,
        what="the close workflow completed",
    )

    assert acme.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202
    wait_until(
        lambda: acme.get(f"/v1/allocations/{alloc_id}").json()["status"] == "released", timeout_s=60, what="released"
    )
    wait_until(lambda: metered(settings, alloc_id)[1], timeout_s=30, what="the agents shipped everything")
    truth, _ = metered(settings, alloc_id)
    usage = acme.get("/v1/usage", params={"allocation_id": alloc_id}).json()
    assert usage["gpu_ms"] == truth > 0  # every metered millisecond, once
    # The allocation workflow told the ledger when the allocation and its nodes started and ended.
    # The sends are not awaited before the status flips to released (a ledger that is down must
    # not hold up a cancel), so the end may land a moment later.
    expected = ["end", "node_added", "node_added", "node_removed", "node_removed", "start"]

    def all_events():
        found = httpx.get(
            auth=auth_for(stack.ledger_url), url=f"{stack.ledger_url}/v1/allocation-events", params=ledger_usage
        ).json()
        return found if len(found) >= len(expected) else None

    events = wait_until(all_events, timeout_s=30, what="the allocation's end reached the ledger")
    assert sorted(e["kind"] for e in events) == expected
    # The GPU type and count come from the control plane's records, not from the nodes.
    assert {(e["gpu_type"], e["gpu_count"]) for e in events if e["kind"] == "node_added"} == {("H100", 8)}
    # What is billed is what the allocation held, from ready to release; the meters ran from each
    # node's provision, a few seconds more.
    added = {e["node_id"]: e["at_ms"] for e in events if e["kind"] == "node_added"}
    held = sum((e["at_ms"] - added[e["node_id"]]) * 8 for e in events if e["kind"] == "node_removed")
    draft = json.loads(acme.get("/v1/invoices:draft").content)
    assert sum(line["quantity"] for line in draft["lines"] if line["allocation_id"] == alloc_id) == held > 0
    assert abs(held - truth) < 2 * 8 * 15_000
