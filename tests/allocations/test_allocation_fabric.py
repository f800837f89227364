"""Fabric isolation through the real stack: the allocation workflow applies membership on the
simulated fabric managers (UFM pkeys, NMX-M NVLink partitions, SDN VPCs, over real HTTP) and
reads it back before any node is `active`; a cancel takes it away; a pulled node leaves and its
replacement joins; a manager that is down or answers reads that disagree holds the allocation
back until it recovers, and one that refuses fails it closed. Every check reads the managers."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import pytest

from gpucloud.fabric.interface import DEFAULT_PKEY, FabricNode, Membership
from gpucloud.fabric.isolation import find_violations
from gpucloud.models.workflow_ids import allocation_workflow_id
from support.histories import replayer
from support.stack import async_wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

FAST = {
    "latency_scale": 0.02,
    "health__drain_grace_s": 0.5,
    "health__replacement_recheck_s": 0.5,
    "health__breaker_max_pulled_share": 1.0,
}


async def _ready_fleet(ready_fleet, *, nodes: int, **options):
    return await ready_fleet(nodes=nodes, fabric=True, **{**FAST, **options})


def _create(h, key: str, body: dict):
    with h.client(key) as c:
        return c.post(
            "/v1/allocations", json={"region": "us-east-1", **body}, headers={"Idempotency-Key": str(uuid.uuid4())}
        )


def _topology(h) -> dict[str, FabricNode]:
    return {
        n["id"]: FabricNode(
            node_id=n["id"],
            port_guids=tuple(n["ib_port_guids"]),
            nvl_domain=n["nvlink_domain"],
            gpu_uids=tuple(n["gpu_uids"]),
        )
        for n in h.nodes()
    }


def _ports(h, node_ids) -> set[str]:
    nodes = {n["id"]: n for n in h.nodes()}
    return {g for n in node_ids for g in nodes[n]["ib_port_guids"]}


def _violations(h, allocations: dict[str, str]) -> list:
    """What the isolation checker finds on the managers; `allocations`: allocation id -> tenant's key."""
    tenant_of = {}
    for alloc_id, key in allocations.items():
        alloc = h.client(key).get(f"/v1/allocations/{alloc_id}").json()
        if alloc["status"] not in ("released", "failed"):
            tenant_of.update(dict.fromkeys(alloc["node_ids"], alloc["tenant_id"]))
    return find_violations(h.fabric.snapshot(), topology=_topology(h), tenant_of=tenant_of)


async def _holds(predicate, *, for_s: float, what: str) -> None:
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        assert await asyncio.to_thread(predicate), what
        await asyncio.sleep(0.2)


async def test_membership_is_read_back_before_nodes_are_active_and_a_cancel_takes_it_away(ready_fleet):
    h = await _ready_fleet(ready_fleet, nodes=2)
    tenant_id, key = await h.onboard()

    def held_back() -> bool:
        alloc = h.client(key).get(f"/v1/allocations/{alloc_id}").json()
        states = {h.node(n)["state"] for n in alloc["node_ids"]}
        return alloc["status"] == "provisioning" and states == {"reserved"}

    # The managers are down: nothing is applied, and no node goes further than reserved.
    h.fabric.set_fault("unavailable")
    alloc_id = h.allocate(key, gpu_type="H100", node_count=2)
    await _holds(held_back, for_s=2.0, what="allocation held back while the managers are down")
    # Back up, but their reads disagree with what they acknowledged: the writes land, the
    # read-back fails, and still no node is active.
    h.fabric.set_fault("stale_reads")
    node_ids = h.client(key).get(f"/v1/allocations/{alloc_id}").json()["node_ids"]
    ports = _ports(h, node_ids)
    await async_wait_until(lambda: h.fabric.full_members(alloc_id) == ports, timeout_s=30, what="membership written")
    await _holds(held_back, for_s=2.0, what="allocation held back while the read-back differs")

    recovered_at = datetime.now(UTC)
    h.fabric.set_fault(None)
    await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    assert all(h.node(n)["state"] == "active" for n in node_ids)
    assert h.fabric.full_members(alloc_id) == ports
    default = next(p for p in h.fabric.snapshot().pkeys if p.pkey == DEFAULT_PKEY)
    assert ports <= default.guids(Membership.LIMITED) and not default.guids(Membership.FULL)
    assert set(h.fabric.vpc_of(tenant_id).nodes) == set(node_ids)
    assert h.fabric.nvl_partitions_of(alloc_id) == []  # H100 nodes sit in no NVL72 domain
    # Provisioning (the tenant's workload on the node) began only once the read-back held.
    for node_id in node_ids:
        events = h.operator.get(f"/v1/nodes/{node_id}/events", params={"page_size": 500}).json()["items"]
        (provisioned,) = [e for e in events if e["to_state"] == "provisioning"]
        assert datetime.fromisoformat(provisioned["at"]) >= recovered_at
    assert _violations(h, {alloc_id: key}) == []

    with h.client(key) as c:
        assert c.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202
    await h.wait_allocation(key, alloc_id, "released", timeout_s=60)
    assert h.fabric.pkey_of(alloc_id) is None
    assert h.fabric.vpc_of(tenant_id).nodes == ()
    assert _violations(h, {alloc_id: key}) == []
    await h.wait_states({"available": 2}, timeout_s=60)


async def test_a_refusing_manager_fails_the_allocation_closed_and_nothing_is_kept(ready_fleet, temporal_env):
    h = await _ready_fleet(ready_fleet, nodes=2)
    tenant_id, key = await h.onboard()
    # Someone else's partition already holds one of the ports as a full member: the manager
    # refuses to make it a full member of a second one.
    port = sorted(_ports(h, [h.nodes()[0]["id"]]))[0]
    with h.fabric.controller() as c:
        c.infiniband.create_pkey(0x0123, name="foreign")
        c.infiniband.add_ports(0x0123, [port], membership=Membership.FULL)
    alloc_id = h.allocate(key, gpu_type="H100", node_count=2)
    failed = await h.wait_allocation(key, alloc_id, "failed", timeout_s=60)
    assert "fabric isolation could not be applied" in failed["failure_reason"]
    assert "refused" in failed["failure_reason"] and "0x0123" not in failed["failure_reason"]
    assert h.fabric.pkey_of(alloc_id) is None
    vpc = h.fabric.vpc_of(tenant_id)
    assert vpc is None or vpc.nodes == ()
    # Never provisioned: the reservation is undone, no wipe needed, the agents never saw the tenant.
    await h.wait_states({"available": 2}, timeout_s=30)
    assert all(h.sim.node(n["id"])["tenant_id"] is None for n in h.nodes())
    await _replays(temporal_env, alloc_id)

    with h.fabric.controller() as c:
        c.infiniband.delete_pkey(0x0123)
    again = h.allocate(key, gpu_type="H100", node_count=2)
    await h.wait_allocation(key, again, "ready", timeout_s=60)
    assert h.fabric.full_members(again) == _ports(h, [n["id"] for n in h.nodes()])


async def test_two_tenants_and_nvl72_slices_never_share_a_partition_or_vni(ready_fleet):
    h = await _ready_fleet(ready_fleet, nodes=4, nvl72_racks=1, nvl72_trays=6)
    acme_id, acme = await h.onboard()
    globex_id, globex = await h.onboard()

    # Bad slice requests: clear problem+json naming the field.
    for body, field in [
        ({"gpu_type": "H100", "nvl72_trays": 2}, "nvl72_trays"),
        ({"gpu_type": "GB200", "nvl72_trays": 19}, "nvl72_trays"),
        ({"gpu_type": "GB200", "nvl72_trays": 2, "node_count": 3}, "node_count"),
        ({"gpu_type": "H100"}, "node_count"),
    ]:
        resp = _create(h, acme, body)
        assert resp.status_code == 422 and resp.headers["content-type"] == "application/problem+json", resp.text
        assert [e["field"] for e in resp.json()["errors"]] == [field], resp.text
    too_big = _create(h, acme, {"gpu_type": "GB200", "nvl72_trays": 7})
    assert too_big.status_code == 409 and "NVL72 rack" in too_big.json()["detail"], too_big.text

    allocations = {
        h.allocate(acme, gpu_type="H100", node_count=2): acme,
        h.allocate(acme, gpu_type="GB200", nvl72_trays=4): acme,
        h.allocate(globex, gpu_type="H100", node_count=2): globex,
        h.allocate(globex, gpu_type="GB200", nvl72_trays=2): globex,
    }
    ready = {a: await h.wait_allocation(key, a, "ready", timeout_s=90) for a, key in allocations.items()}
    nodes = {n["id"]: n for n in h.nodes()}

    # A slice: its trays in one NVL72 rack, one NVLink partition holding exactly their GPUs.
    for alloc in ready.values():
        partitions = h.fabric.nvl_partitions_of(alloc["id"])
        if alloc["gpu_type"] != "GB200":
            assert alloc["nvl72_trays"] is None and partitions == []
            continue
        assert alloc["node_count"] == alloc["nvl72_trays"] == len(alloc["node_ids"])
        assert {nodes[n]["nvlink_domain"] for n in alloc["node_ids"]} == {alloc["nvlink_domain"]}
        (partition,) = partitions
        assert partition.domain_id == alloc["nvlink_domain"]
        assert set(partition.gpu_uids) == {g for n in alloc["node_ids"] for g in nodes[n]["gpu_uids"]}

    # One pkey per allocation, holding its own ports only; one VNI per tenant, holding its nodes.
    pkeys = {a: h.fabric.pkey_of(a) for a in allocations}
    assert len({p.pkey for p in pkeys.values()}) == 4
    for alloc_id, pkey in pkeys.items():
        assert pkey.guids(Membership.FULL) == _ports(h, ready[alloc_id]["node_ids"]) == pkey.guids()
    acme_vpc, globex_vpc = h.fabric.vpc_of(acme_id), h.fabric.vpc_of(globex_id)
    assert acme_vpc.vni != globex_vpc.vni
    for vpc, key in ((acme_vpc, acme), (globex_vpc, globex)):
        assert set(vpc.nodes) == {n for a, k in allocations.items() if k == key for n in ready[a]["node_ids"]}
    assert _violations(h, allocations) == []

    for alloc_id, key in allocations.items():
        with h.client(key) as c:
            assert c.post(f"/v1/allocations/{alloc_id}/cancel").status_code == 202
    for alloc_id, key in allocations.items():
        await h.wait_allocation(key, alloc_id, "released", timeout_s=60)
    snapshot = h.fabric.snapshot()
    assert [p.name for p in snapshot.pkeys] == ["default"] and snapshot.nvl_partitions == ()
    assert all(v.nodes == () for v in snapshot.vpcs)
    assert _violations(h, allocations) == []


async def test_drain_and_replace_moves_membership_from_the_pulled_tray_to_its_replacement(ready_fleet, temporal_env):
    h = await _ready_fleet(ready_fleet, nodes=1, nvl72_racks=1, nvl72_trays=3)
    tenant_id, key = await h.onboard()
    alloc_id = h.allocate(key, gpu_type="GB200", nvl72_trays=2)
    alloc = await h.wait_allocation(key, alloc_id, "ready", timeout_s=60)
    bad, kept = alloc["node_ids"]
    (spare,) = {n["id"] for n in h.nodes() if n["gpu_type"] == "GB200"} - {bad, kept}
    assert h.fabric.full_members(alloc_id) == _ports(h, [bad, kept])
    # The only spare tray's port is held by someone else's partition: the manager refuses it.
    with h.fabric.controller() as c:
        c.infiniband.create_pkey(0x0321, name="foreign")
        c.infiniband.add_ports(0x0321, sorted(_ports(h, [spare]))[:1], membership=Membership.FULL)

    resp = h.operator.post(f"/v1/nodes/{bad}/xid", json={"xid": 79, "gpu_index": 1})
    assert resp.status_code == 200 and resp.json()["decisions"][0]["pull"] == "replace", resp.text

    def events() -> list[str]:
        return [e["kind"] for e in h.client(key).get(f"/v1/allocations/{alloc_id}/events").json()["items"]]

    # The pulled tray leaves at once; the refused spare is given back (never provisioned) and tried again.
    await async_wait_until(lambda: "replacement_failed" in events(), timeout_s=60, what="replacement refused")
    assert h.fabric.full_members(alloc_id) == _ports(h, [kept])
    assert set(h.fabric.vpc_of(tenant_id).nodes) == {kept}
    await _holds(
        lambda: (
            h.node(spare)["state"] in ("reserved", "available")
            and h.client(key).get(f"/v1/allocations/{alloc_id}").json()["status"] == "degraded"
        ),
        for_s=2.0,
        what="no replacement while the fabric refuses it",
    )
    assert h.sim.node(spare)["tenant_id"] is None
    with h.fabric.controller() as c:
        c.infiniband.delete_pkey(0x0321)

    def replaced():
        a = h.client(key).get(f"/v1/allocations/{alloc_id}").json()
        return a["status"] == "ready" and bad not in a["node_ids"] and len(a["node_ids"]) == 2 and a

    alloc = await async_wait_until(replaced, timeout_s=60, what="replacement attached")
    (new,) = set(alloc["node_ids"]) - {kept}
    nodes = {n["id"]: n for n in h.nodes()}
    assert nodes[new]["nvlink_domain"] == nodes[bad]["nvlink_domain"] == alloc["nvlink_domain"]
    assert nodes[new]["state"] == "active"
    # The pulled tray is out of the pkey, the NVLink partition and the VPC; the replacement is in.
    assert h.fabric.full_members(alloc_id) == _ports(h, [kept, new]) == h.fabric.pkey_of(alloc_id).guids()
    (partition,) = h.fabric.nvl_partitions_of(alloc_id)
    assert set(partition.gpu_uids) == {*nodes[kept]["gpu_uids"], *nodes[new]["gpu_uids"]}
    assert set(h.fabric.vpc_of(tenant_id).nodes) == {kept, new}
    assert _violations(h, {alloc_id: key}) == []
    await _replays(temporal_env, alloc_id)


async def _replays(temporal_env, alloc_id: str) -> None:
    """The history so far (fabric steps and all) replays against the workflow code."""
    history = await temporal_env.client.get_workflow_handle(allocation_workflow_id(alloc_id)).fetch_history()
    await replayer(temporal_env.client).replay_workflow(history)
