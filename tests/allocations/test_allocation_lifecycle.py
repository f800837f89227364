"""Enrollment to available, allocate -> ready -> cancel -> nodes back, through the real stack."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowExecutionStatus

from gpucloud.models.workflow_ids import allocation_workflow_id

pytestmark = pytest.mark.integration


async def test_enrollment_brings_nodes_to_available(ready_fleet, temporal_env):
    h = await ready_fleet(nodes=6)
    node_ids = h.node_ids()
    # Each node went enrolled -> inspecting -> wiping -> burn_in -> available, every step recorded.
    node = h.operator.get(f"/v1/nodes/{node_ids[0]}").json()
    assert node["generation"] == 4 and node["tenant_id"] is None
    # Enrolling again changes nothing: known nodes keep their state.
    again = h.operator.post("/v1/nodes:enroll", json={"nodes": h.sim.inventory()}).json()
    assert again == {"enrolled": 0, "already_known": 6, "bringups_started": 0, "batches": 0, "deferred": 0}
    # The six came up in one batch workflow, whose result names them all.
    batches = [
        w
        async for w in temporal_env.client.list_workflows(
            f"WorkflowType = 'BringupBatchWorkflow' AND TaskQueue = '{h.settings.temporal.task_queue}'"
        )
    ]
    assert len(batches) == 1
    result = await temporal_env.client.get_workflow_handle(batches[0].id).result()
    assert sorted(result["available"]) == sorted(node_ids) and result["stopped"] == {}


async def test_allocate_ready_cancel_released_nodes_back(ready_fleet, temporal_env):
    h = await ready_fleet(nodes=8)
    tenant_id, key = await h.onboard()

    with h.client(key) as c:
        resp = c.post(
            "/v1/allocations",
            json={"gpu_type": "H100", "node_count": 4, "region": "us-east-1"},
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
        assert resp.status_code == 202, resp.text
        alloc = resp.json()["allocation"]
        op_id = resp.json()["operation"]["id"]
        assert resp.headers["location"] == f"/v1/allocations/{alloc['id']}"
        assert alloc["status"] == "provisioning" and len(alloc["node_ids"]) == 4

        ready = await h.wait_allocation(key, alloc["id"], "ready")
        assert c.get(f"/v1/operations/{op_id}").json()["status"] == "succeeded"
        nodes = {n["id"]: n for n in h.nodes()}
        for node_id in ready["node_ids"]:
            assert nodes[node_id]["state"] == "active"
            assert nodes[node_id]["tenant_id"] == tenant_id
            assert h.sim.node(node_id)["tenant_id"] == tenant_id  # the agent really holds the tenant
        # One fabric domain for the whole gang.
        assert len({nodes[n]["pod"] for n in ready["node_ids"]}) == 1
        # The per-node workflows carry search attributes an operator can filter on.
        some = ready["node_ids"][0]
        found = [w async for w in temporal_env.client.list_workflows(f"NodeId = '{some}'")]
        assert [w.id for w in found] == [f"node-{some}"]

        cancel = c.post(f"/v1/allocations/{alloc['id']}/cancel")
        assert cancel.status_code == 202
        assert cancel.json()["allocation"]["status"] == "cancelling"
        cancel_op = cancel.json()["operation"]["id"]
        await h.wait_allocation(key, alloc["id"], "released")
        assert c.get(f"/v1/operations/{cancel_op}").json()["status"] == "succeeded"
        await h.wait_states({"available": 8})
        for node_id in ready["node_ids"]:
            assert h.sim.node(node_id)["tenant_id"] is None  # wiped before returning to the pool
        # Each released node went through releasing -> wiping -> burn_in -> available.
        node = h.operator.get(f"/v1/nodes/{ready['node_ids'][0]}").json()
        assert node["allocation_id"] is None and node["tenant_id"] is None
        # These nodes have no BMC: no re-image, and their events say the wipe alone is weaker.
        events = h.operator.get(f"/v1/nodes/{ready['node_ids'][0]}/events", params={"page_size": 200}).json()
        fallback = [e for e in events["items"] if e["event"] == "inband_wipe_only"]
        assert len(fallback) == 1 and "the node has no BMC" in fallback[0]["cause"], events
        assert "weaker" in fallback[0]["cause"] and "image_inserted" not in {e["event"] for e in events["items"]}
        # The wipe after the tenant left, step by step with the agent's answers: every GPU reset and
        # the tenant's disk crypto-erased, in wiping, before the node went on to burn-in.
        items = events["items"]
        released = max(i for i, e in enumerate(items) if e["from_state"] == "active")
        cleaned = [
            (i, e) for i, e in enumerate(items) if i > released and e["event"] in ("gpu_reset", "disk_sanitized")
        ]
        assert [e["event"] for _, e in cleaned] == ["gpu_reset", "disk_sanitized"], items
        assert all(e["from_state"] == e["to_state"] == "wiping" for _, e in cleaned)
        assert cleaned[0][1]["cause"] == "every GPU: gpu_reset: 8 GPUs reset"
        assert cleaned[1][1]["cause"].startswith("/dev/nvme1n1: crypto_erase: nvme format /dev/nvme1n1 --ses=2 --force")
        burn_in = next(i for i, e in enumerate(items) if i > released and e["to_state"] == "burn_in")
        assert cleaned[-1][0] < burn_in

        # Cancel of a released allocation is a no-op success.
        again = c.post(f"/v1/allocations/{alloc['id']}/cancel")
        assert again.status_code == 200 and again.json()["operation"] is None

    # The workflow ends (its last steps may still run after the allocation shows released).
    handle = temporal_env.client.get_workflow_handle(allocation_workflow_id(alloc["id"]))
    await asyncio.wait_for(handle.result(), timeout=60)
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED


async def test_not_enough_capacity_is_a_clear_409_and_writes_nothing(ready_fleet):
    h = await ready_fleet(nodes=4)
    _, key = await h.onboard()
    with h.client(key) as c:
        resp = c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 5, "region": "us-east-1"})
        assert resp.status_code == 409
        problem = resp.json()
        assert problem["type"].endswith("/insufficient-capacity")
        assert "5" in problem["detail"] and problem["available_in_region"] == 4
        assert c.get("/v1/allocations").json()["items"] == []
    assert {n["state"] for n in h.nodes()} == {"available"}


@pytest.mark.parametrize("mode", ["transient", "permanent"])
async def test_agent_failures_transient_retried_permanent_to_failure_target(
    db_url, make_harness, in_process_worker, mode
):
    h = make_harness(db_url, nodes=2)
    await in_process_worker(h.settings)
    first, second = h.node_ids()
    h.sim.inject(first, "burn_in", mode, count=2)
    h.enroll_fleet()
    if mode == "transient":
        # Two 503s, then success: Temporal retried the activity with backoff.
        await h.wait_states({"available": 2}, timeout_s=60)
    else:
        # The agent refused burn-in for good: burn_in's failure target is quarantined.
        await h.wait_states({"available": 1, "quarantined": 1}, timeout_s=60)
        assert h.operator.get(f"/v1/nodes/{first}").json()["state"] == "quarantined"
        assert h.operator.get(f"/v1/nodes/{second}").json()["state"] == "available"


async def test_failed_provisioning_fails_allocation_and_recycles_nodes(ready_fleet):
    h = await ready_fleet(nodes=4)
    _, key = await h.onboard()
    nodes = h.node_ids()
    with h.client(key) as c:
        for node_id in nodes:
            h.sim.inject(node_id, "provision", "permanent")
        resp = c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"})
        alloc = resp.json()["allocation"]
        failed = await h.wait_allocation(key, alloc["id"], "failed", timeout_s=120)
        # Both first nodes failed, each of the two spare nodes was tried in turn as a replacement
        # (never a node that already failed for this allocation), then none was left.
        reason = failed["failure_reason"]
        assert (
            reason.startswith("provisioning failed (")
            and reason.count("provision failed") == 4
            and "no replacement" in reason
        ), reason
        assert all(n in reason for n in nodes)
        assert c.get(f"/v1/operations/{resp.json()['operation']['id']}").json()["status"] == "failed"
        events = c.get(f"/v1/allocations/{alloc['id']}/events").json()["items"]
        assert sum(e["kind"] == "replacement_failed" for e in events) == 2
    # provisioning's failure target is wiping; from there the nodes go back through burn-in.
    await h.wait_states({"available": 4})


async def test_a_node_failing_provisioning_is_replaced(ready_fleet):
    h = await ready_fleet(nodes=3)
    _, key = await h.onboard()
    bad, good, spare = h.node_ids()
    h.sim.inject(bad, "provision", "permanent")
    # The spare is cordoned while the allocation is admitted, so the two first nodes are bad and good.
    assert h.operator.post(f"/v1/nodes/{spare}/cordon", json={"reason": "held back"}).status_code == 200
    with h.client(key) as c:
        resp = c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": 2, "region": "us-east-1"})
        alloc = resp.json()["allocation"]
        assert sorted(alloc["node_ids"]) == sorted([bad, good])
        assert h.operator.post(f"/v1/nodes/{spare}/uncordon").status_code == 200
        ready = await h.wait_allocation(key, alloc["id"], "ready", timeout_s=90)
        assert sorted(ready["node_ids"]) == sorted([good, spare])
        assert c.get(f"/v1/operations/{resp.json()['operation']['id']}").json()["status"] == "succeeded"
        events = c.get(f"/v1/allocations/{alloc['id']}/events").json()["items"]
        kinds = [e["kind"] for e in events]
        assert "degraded" in kinds and kinds.index("degraded") < kinds.index("replacement_started")
        assert any(bad in (e["reason"] or "") and "provision" in e["reason"] for e in events if e["kind"] == "degraded")
    # The bad node went back through wipe and burn-in to the pool; it never joined the allocation.
    await h.wait_states({"active": 2, "available": 1})
    assert h.node(bad)["state"] == "available" and h.node(bad)["allocation_id"] is None
