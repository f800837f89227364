"""The simulated fleet enforces what real agents would, and 10,000 nodes fit in one process."""

from __future__ import annotations

import json
import tracemalloc
from collections import deque

import pytest

from gpucloud.protocol.actions import ActionRequest
from gpucloud.sim.nodes import Fleet, FleetSpec

pytestmark = pytest.mark.unit


@pytest.fixture
def fleet() -> Fleet:
    return Fleet(FleetSpec(nodes=4, latency_scale=0.0))


def req(rid: str, tenant: str | None = None) -> ActionRequest:
    return ActionRequest(request_id=rid, tenant_id=tenant)


async def test_tenant_isolation_invariants(fleet):
    node = fleet.nodes["sim-00000"]
    assert (await fleet.act(node, "provision", req("1", "ten_a")))[0] == 200
    status, body = await fleet.act(node, "provision", req("2", "ten_b"))
    assert status == 409 and "wipe it first" in body["detail"]
    assert (await fleet.act(node, "wipe", req("3")))[0] == 409  # the workload still runs
    assert (await fleet.act(node, "burn_in", req("4")))[0] == 409  # not wiped
    assert (await fleet.act(node, "release", req("5")))[0] == 200
    assert (await fleet.act(node, "wipe", req("6")))[0] == 200
    assert node.tenant_id is None
    assert (await fleet.act(node, "burn_in", req("7")))[0] == 200
    assert (await fleet.act(node, "provision", req("8", "ten_b")))[0] == 200


async def test_actions_are_deduplicated_by_request_id_but_transient_failures_are_not(fleet):
    node = fleet.nodes["sim-00001"]
    node.faults["inspect"] = deque(["transient"])
    assert (await fleet.act(node, "inspect", req("r1")))[0] == 503
    assert (await fleet.act(node, "inspect", req("r1")))[0] == 200  # the retry really runs
    done = node.actions_done
    assert (await fleet.act(node, "inspect", req("r1")))[0] == 200  # a replay is answered, not re-run
    assert node.actions_done == done


async def test_unreachable_and_drift(fleet):
    node = fleet.nodes["sim-00002"]
    await fleet.act(node, "provision", req("p", "ten_a"))
    fleet.drift(node, "reboot")
    assert node.tenant_id == "ten_a" and not node.workload_running and node.boot_id == 1
    fleet.drift(node, "wipe")
    assert node.tenant_id is None
    node.unreachable = True
    assert (await fleet.act(node, "inspect", req("x")))[0] == 503
    assert node.id not in {b.node_id for b in fleet.heartbeats()}


def test_ten_thousand_nodes_fit_in_bounded_memory():
    tracemalloc.start()
    big = Fleet(FleetSpec(nodes=10_000))
    beats = big.heartbeats()
    inventory = big.inventory("http://127.0.0.1:1")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(beats) == len(inventory) == 10_000
    assert len({n["pod"] for n in inventory}) == -(-10_000 // 32)  # 32 nodes per pod, last one partial
    assert peak < 80 * 2**20, f"{peak / 2**20:.0f} MiB for 10,000 simulated nodes"


async def test_hardware_fault_fails_burn_in_until_the_rung_that_fixes_it(fleet):
    node = fleet.nodes["sim-00001"]
    node.hardware_fault, node.fault_fixed_by = "uncorrectable ECC", "reboot"
    status, body = await fleet.act(node, "burn_in", req("1"))
    assert status == 422 and "uncorrectable ECC" in body["detail"]
    assert (await fleet.act(node, "reset", req("2")))[0] == 200
    assert (await fleet.act(node, "burn_in", req("3")))[0] == 422  # a reset is too mild
    assert (await fleet.act(node, "reboot", req("4")))[0] == 200
    assert (await fleet.act(node, "burn_in", req("5")))[0] == 200
    node.hardware_fault, node.fault_fixed_by = "GPU off the bus", None  # nothing fixes it
    assert (await fleet.act(node, "reflash", req("6")))[0] == 200
    assert (await fleet.act(node, "burn_in", req("7")))[0] == 422


async def test_a_wipe_resets_the_gpus_and_settles_what_a_reset_fixes(fleet):
    """The wipe between tenants resets every GPU: a row remap pending is applied by it, a fault
    only a reboot fixes is still there for burn-in to find."""
    node = fleet.nodes["sim-00002"]
    node.hardware_fault, node.fault_fixed_by = "hbm3: row remap pending", "reset"
    assert (await fleet.act(node, "wipe", req("1")))[0] == 200
    assert (await fleet.act(node, "burn_in", req("2")))[0] == 200
    node.hardware_fault, node.fault_fixed_by = "uncorrectable ECC", "reboot"
    assert (await fleet.act(node, "wipe", req("3")))[0] == 200
    assert (await fleet.act(node, "burn_in", req("4")))[0] == 422


async def test_simulated_agents_report_each_with_its_own_credential_unless_batched():
    """As real agents do: a node its last wipe handed a credential reports alone, under it;
    nodes not yet wiped (no credential) go in one batch under the operator token, and
    `batch_reports` batches everyone."""
    import httpx

    from gpucloud.sim.fleet import _report

    fleet = Fleet(FleetSpec(nodes=4, latency_scale=0.0))
    ids = sorted(fleet.nodes)
    for node_id in ids[:3]:
        fleet.nodes[node_id].credential = f"gpa_{node_id}.secret"
    seen: list[tuple[str, list[str]]] = []

    def control_plane(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.headers["authorization"], [b["node_id"] for b in body["heartbeats"]]))
        return httpx.Response(200, json={"accepted": len(body["heartbeats"]), "drifted": []})

    headers = {"Authorization": "Bearer operator"}
    async with httpx.AsyncClient(transport=httpx.MockTransport(control_plane), headers=headers) as client:
        await _report(client, fleet, "http://cp", batch_reports=False)
        per_node = sorted(seen)
        seen.clear()
        await _report(client, fleet, "http://cp", batch_reports=True)
    assert per_node == sorted([(f"Bearer gpa_{n}.secret", [n]) for n in ids[:3]] + [("Bearer operator", [ids[3]])])
    assert seen == [("Bearer operator", ids)]
