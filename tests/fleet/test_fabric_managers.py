"""The simulated fabric managers over real HTTP: every constraint refused with a clear 4xx, the
apply/verify/release round trip, and random allocate/release sequences across tenants after
which the isolation checker finds no path between tenants."""

from __future__ import annotations

import random
import sys

import httpx
import pytest

from gpucloud.fabric.http_clients import HttpFabricController
from gpucloud.fabric.interface import (
    DEFAULT_PKEY,
    FabricError,
    FabricNode,
    FabricTokens,
    FabricVerificationError,
    Membership,
)
from gpucloud.fabric.isolation import find_violations
from gpucloud.fabric.membership import (
    apply_and_verify,
    delete_tenant_vpc,
    ensure_tenant_vpc,
    read_snapshot,
    release,
    remove_nodes,
    resource_name,
)
from gpucloud.sim.fabric_managers import FabricManagersServer, create_app

pytestmark = pytest.mark.integration

RACKS = 3
TRAYS_PER_RACK = 6


def make_topology(tag: str) -> dict[str, FabricNode]:
    """Nodes with two IB ports and four GPUs each, in NVL72 racks; `tag` keeps tests apart."""
    nodes = {}
    for rack in range(RACKS):
        for tray in range(TRAYS_PER_RACK):
            node_id = f"{tag}-r{rack}t{tray}"
            index = int.from_bytes(node_id.encode()[-6:], "big")
            nodes[node_id] = FabricNode(
                node_id=node_id,
                port_guids=(f"0x{index:012x}{0:04x}"[:18], f"0x{index:012x}{1:04x}"[:18]),
                nvl_domain=f"{tag}-rack{rack}",
                gpu_uids=tuple(f"GPU-{node_id}-{g}" for g in range(4)),
            )
    return nodes


@pytest.fixture
def managers_url():
    """A fresh set of managers per test, so a test's leftovers never look like another's leak.

    The server thread shares this process's GIL; a short switch interval keeps each request from
    waiting out the default 5 ms hand-over (7 ms a call instead of well under 1 ms).
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    try:
        with FabricManagersServer(create_app()) as server:
            yield server.url
    finally:
        sys.setswitchinterval(interval)


@pytest.fixture
def controller(managers_url):
    with HttpFabricController.for_simulator(managers_url) as controller:
        yield controller


def register(controller: HttpFabricController, topology: dict[str, FabricNode]) -> None:
    domains: dict[str, list[str]] = {}
    for node in topology.values():
        domains.setdefault(node.nvl_domain, []).extend(node.gpu_uids)
    for domain, gpus in domains.items():
        controller.nvlink.register_domain(domain, gpus)


def refused(call, status: int, constraint: str) -> FabricError:
    with pytest.raises(FabricError) as caught:
        call()
    assert (caught.value.status_code, caught.value.constraint) == (status, constraint), caught.value
    assert caught.value.message
    return caught.value


def test_infiniband_constraints(controller):
    ib = controller.infiniband
    a, b = "0x00000000000a0001", "0x00000000000a0002"
    refused(lambda: ib.create_pkey(0x0000, name="zero"), 422, "pkey_range")
    refused(lambda: ib.create_pkey(0x7FFF, name="default"), 422, "pkey_range")
    refused(lambda: ib.create_pkey(0x8001, name="high"), 422, "pkey_range")
    ib.create_pkey(0x0A01, name="one")
    refused(lambda: ib.create_pkey(0x0A01, name="again"), 409, "pkey_unique")
    error = refused(
        lambda: ib.add_ports(DEFAULT_PKEY, [a], membership=Membership.FULL), 409, "default_partition_limited"
    )
    assert "limited" in error.message
    ib.add_ports(DEFAULT_PKEY, [a, b], membership=Membership.LIMITED)
    ib.add_ports(0x0A01, [a], membership=Membership.FULL)
    ib.create_pkey(0x0A02, name="two")
    error = refused(lambda: ib.add_ports(0x0A02, [a], membership=Membership.FULL), 409, "full_member_single_pkey")
    assert a in error.message and "0x0a01" in error.message
    ib.add_ports(0x0A02, [a], membership=Membership.LIMITED)
    refused(lambda: ib.add_ports(0x0A03, [b], membership=Membership.FULL), 404, "pkey_exists")
    refused(lambda: ib.add_ports(0x0A02, ["not-a-guid"], membership=Membership.FULL), 422, "guid_format")
    refused(lambda: ib.delete_pkey(DEFAULT_PKEY), 409, "default_partition_permanent")
    assert ib.get_pkey(0x0A01).guids(Membership.FULL) == {a}
    # Lists name the pkeys; their ports come with `members` (UFM's `guids_data=true`) only.
    listed = {p.pkey: p for p in ib.list_pkeys()}
    assert {p: (r.name, r.members) for p, r in listed.items() if p in (0x0A01, 0x0A02)} == {
        0x0A01: ("one", ()),
        0x0A02: ("two", ()),
    }
    assert {p.pkey: p.guids() for p in ib.list_pkeys(members=True)}[0x0A01] == {a}
    # Adding ports that are already members as asked changes nothing; removing one that is not a
    # member neither.
    ib.add_ports(DEFAULT_PKEY, [a, b], membership=Membership.LIMITED)
    ib.remove_ports(0x0A02, [b])
    assert ib.get_pkey(DEFAULT_PKEY).guids(Membership.LIMITED) >= {a, b}
    assert ib.get_pkey(0x0A02).guids() == {a}
    ib.remove_ports(0x0A01, [a])
    assert ib.get_pkey(0x0A01).members == ()
    ib.add_ports(0x0A02, [a], membership=Membership.FULL)
    ib.delete_pkey(0x0A01)
    ib.delete_pkey(0x0A02)
    assert ib.get_pkey(0x0A01) is None


def test_nvlink_constraints(controller):
    nvl = controller.nvlink
    nvl.register_domain("c-rack0", ["GPU-c0", "GPU-c1", "GPU-c2"])
    nvl.register_domain("c-rack1", ["GPU-c9"])
    refused(lambda: nvl.register_domain("c-rack1", ["GPU-c0"]), 409, "gpu_single_domain")
    first = nvl.create_partition(name="c-a", domain_id="c-rack0", gpu_uids=["GPU-c0", "GPU-c1"])
    error = refused(
        lambda: nvl.create_partition(name="c-b", domain_id="c-rack0", gpu_uids=["GPU-c1", "GPU-c2"]),
        409,
        "gpu_single_partition",
    )
    assert "GPU-c1" in error.message
    refused(lambda: nvl.create_partition(name="c-c", domain_id="c-rack0", gpu_uids=["GPU-c9"]), 409, "gpu_in_domain")
    refused(
        lambda: nvl.create_partition(name="c-a", domain_id="c-rack0", gpu_uids=["GPU-c2"]), 409, "partition_name_unique"
    )
    refused(lambda: nvl.create_partition(name="c-d", domain_id="c-nowhere", gpu_uids=["GPU-c2"]), 404, "domain_exists")
    refused(
        lambda: nvl.create_partition(name="c-e", domain_id="c-rack0", gpu_uids=["GPU-c2", "GPU-c2"]),
        422,
        "gpu_listed_once",
    )
    assert nvl.get_partition(first.partition_id) == first
    # An update (a tray joins or leaves) keeps to the same rules; a GPU may stay where it is.
    other = nvl.create_partition(name="c-g", domain_id="c-rack0", gpu_uids=["GPU-c2"])
    refused(
        lambda: nvl.update_partition(first.partition_id, gpu_uids=["GPU-c0", "GPU-c2"]), 409, "gpu_single_partition"
    )
    refused(lambda: nvl.update_partition(first.partition_id, gpu_uids=["GPU-c9"]), 409, "gpu_in_domain")
    refused(lambda: nvl.update_partition(999, gpu_uids=["GPU-c0"]), 404, "partition_exists")
    assert nvl.update_partition(first.partition_id, gpu_uids=["GPU-c0"]).gpu_uids == ("GPU-c0",)
    nvl.delete_partition(other.partition_id)
    first = nvl.update_partition(first.partition_id, gpu_uids=["GPU-c0", "GPU-c1"])
    nvl.delete_partition(first.partition_id)
    assert nvl.get_partition(first.partition_id) is None
    nvl.create_partition(name="c-f", domain_id="c-rack0", gpu_uids=["GPU-c1", "GPU-c2"])


def test_ethernet_constraints(controller):
    sdn = controller.ethernet
    refused(lambda: sdn.create_vpc(tenant_id="e-acme", vni=0), 422, "vni_range")
    refused(lambda: sdn.create_vpc(tenant_id="e-acme", vni=1 << 24), 422, "vni_range")
    acme = sdn.create_vpc(tenant_id="e-acme", vni=900_001)
    refused(lambda: sdn.create_vpc(tenant_id="e-acme"), 409, "one_vni_per_tenant")
    refused(lambda: sdn.create_vpc(tenant_id="e-globex", vni=900_001), 409, "vni_unique")
    globex = sdn.create_vpc(tenant_id="e-globex")
    assert globex.vni != acme.vni
    sdn.attach(acme.vni, "e-n1")
    assert sdn.attach(acme.vni, "e-n1").nodes == ("e-n1",)
    refused(lambda: sdn.attach(globex.vni, "e-n1"), 409, "node_single_vpc")
    refused(lambda: sdn.delete_vpc(acme.vni), 409, "vpc_not_empty")
    refused(lambda: sdn.attach(12_345_678, "e-n2"), 404, "vpc_exists")
    sdn.detach(acme.vni, "e-n1")
    sdn.delete_vpc(acme.vni)
    assert sdn.get_vpc(acme.vni) is None


def test_apply_verify_release_round_trip(controller):
    topology = make_topology("rt")
    register(controller, topology)
    nodes = [topology["rt-r0t0"], topology["rt-r0t1"], topology["rt-r1t0"]]
    applied = apply_and_verify(controller, "rt-alloc-1", "rt-acme", nodes)
    assert applied == apply_and_verify(controller, "rt-alloc-1", "rt-acme", nodes), "apply is idempotent"
    assert len(applied.nvl_partition_ids) == 2
    pkey = controller.infiniband.get_pkey(applied.pkey)
    assert pkey.guids(Membership.FULL) == {g for n in nodes for g in n.port_guids}
    assert set(controller.ethernet.get_vpc(applied.vni).nodes) == {n.node_id for n in nodes}
    tenant_of = {n.node_id: "rt-acme" for n in nodes}
    assert find_violations(read_snapshot(controller), topology=topology, tenant_of=tenant_of) == []

    with pytest.raises(FabricError) as caught:
        apply_and_verify(controller, "rt-alloc-2", "rt-globex", [topology["rt-r0t1"]])
    assert caught.value.constraint == "full_member_single_pkey"

    release(controller, "rt-alloc-2", "rt-globex", [topology["rt-r0t1"]])
    release(controller, "rt-alloc-1", "rt-acme", nodes)
    release(controller, "rt-alloc-1", "rt-acme", nodes)
    assert controller.infiniband.get_pkey(applied.pkey) is None
    assert all(controller.nvlink.get_partition(p) is None for p in applied.nvl_partition_ids)
    assert controller.ethernet.get_vpc(applied.vni).nodes == ()
    assert find_violations(read_snapshot(controller), topology=topology, tenant_of={}) == []
    delete_tenant_vpc(controller, "rt-acme")
    delete_tenant_vpc(controller, "rt-globex")


class DroppingUfm:
    """A UFM that answers success but silently drops the last port of every full-member add."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def add_ports(self, pkey, guids, *, membership):
        kept = guids[:-1] if membership == Membership.FULL else guids
        return self._inner.add_ports(pkey, kept, membership=membership) if kept else self._inner.get_pkey(pkey)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class LossyController:
    def __init__(self, inner: HttpFabricController) -> None:
        self.infiniband = DroppingUfm(inner.infiniband)
        self.nvlink = inner.nvlink
        self.ethernet = inner.ethernet


def test_verification_catches_a_manager_that_drops_membership(controller):
    topology = make_topology("vf")
    register(controller, topology)
    nodes = [topology["vf-r0t0"]]
    with pytest.raises(FabricVerificationError) as caught:
        apply_and_verify(LossyController(controller), "vf-alloc", "vf-acme", nodes)
    assert "pkey" in caught.value.differences[0]
    release(controller, "vf-alloc", "vf-acme", nodes)
    assert find_violations(read_snapshot(controller), topology=topology, tenant_of={}) == []


def test_apply_converges_to_the_nodes_given_and_remove_takes_nodes_out(controller):
    topology = make_topology("vp")
    register(controller, topology)
    one, two, far = topology["vp-r0t0"], topology["vp-r0t1"], topology["vp-r1t0"]
    apply_and_verify(controller, "vp-alloc", "vp-acme", [one])
    # A replacement joins (in the same rack and in another): the partitions follow.
    apply_and_verify(controller, "vp-alloc", "vp-acme", [one, two, far])
    name = resource_name("vp-alloc")

    def partitions() -> dict[str, set[str]]:
        return {p.domain_id: set(p.gpu_uids) for p in controller.nvlink.list_partitions() if p.name == name}

    assert partitions() == {"vp-rack0": {*one.gpu_uids, *two.gpu_uids}, "vp-rack1": set(far.gpu_uids)}
    # Pulled nodes leave: ports, GPUs (an emptied partition goes) and the VPC.
    remove_nodes(controller, "vp-alloc", "vp-acme", [one, far])
    remove_nodes(controller, "vp-alloc", "vp-acme", [one, far])  # idempotent
    pkey = next(p for p in controller.infiniband.list_pkeys(members=True) if p.name == name)
    assert pkey.guids() == set(two.port_guids)
    assert partitions() == {"vp-rack0": set(two.gpu_uids)}
    assert controller.ethernet.list_vpcs(tenant_id="vp-acme")[0].nodes == (two.node_id,)
    # Applying a smaller set than the managers hold converges too.
    apply_and_verify(controller, "vp-alloc", "vp-acme", [one, two])
    apply_and_verify(controller, "vp-alloc", "vp-acme", [two])
    assert next(p for p in controller.infiniband.list_pkeys(members=True) if p.name == name).guids() == set(
        two.port_guids
    )
    assert partitions() == {"vp-rack0": set(two.gpu_uids)}
    release(controller, "vp-alloc", "vp-acme", [one, two])
    assert find_violations(read_snapshot(controller), topology=topology, tenant_of={}) == []


def test_injected_faults_a_manager_down_and_reads_that_disagree(controller, managers_url):
    topology = make_topology("fi")
    register(controller, topology)
    nodes = [topology["fi-r0t0"], topology["fi-r0t1"]]
    httpx.put(f"{managers_url}/sim/v1/fault", json={"mode": "unavailable"}).raise_for_status()
    with pytest.raises(httpx.HTTPStatusError) as down:
        apply_and_verify(controller, "fi-alloc", "fi-acme", nodes)
    assert down.value.response.status_code == 503
    httpx.put(f"{managers_url}/sim/v1/fault", json={"mode": "stale_reads"}).raise_for_status()
    with pytest.raises(FabricVerificationError) as caught:
        apply_and_verify(controller, "fi-alloc", "fi-acme", nodes)
    found = " ".join(caught.value.differences)
    assert "pkey" in found and "NVLink partition" in found and "VNI" in found
    httpx.put(f"{managers_url}/sim/v1/fault", json={"mode": None}).raise_for_status()
    applied = apply_and_verify(controller, "fi-alloc", "fi-acme", nodes)
    assert controller.infiniband.get_pkey(applied.pkey).guids(Membership.FULL) == {
        g for n in nodes for g in n.port_guids
    }
    release(controller, "fi-alloc", "fi-acme", nodes)


def test_state_survives_a_restart_with_a_state_file(tmp_path):
    state = tmp_path / "fabric.json"
    with (
        FabricManagersServer(create_app(state_path=state)) as server,
        HttpFabricController.for_simulator(server.url) as c,
    ):
        c.nvlink.register_domain("sf-rack0", ["GPU-sf0", "GPU-sf1"])
        c.infiniband.create_pkey(0x0B01, name="alloc-sf")
        c.infiniband.add_ports(0x0B01, ["0x00000000000b0001", "0x00000000000b0002"], membership=Membership.FULL)
        c.infiniband.remove_ports(0x0B01, ["0x00000000000b0002"])  # the file follows every change
        partition = c.nvlink.create_partition(name="alloc-sf", domain_id="sf-rack0", gpu_uids=["GPU-sf0"])
        vpc = c.ethernet.create_vpc(tenant_id="sf-acme")
        c.ethernet.attach(vpc.vni, "sf-node")
        before = read_snapshot(c)
        assert {p.pkey: p.guids() for p in before.pkeys}[0x0B01] == {"0x00000000000b0001"}
    with (
        FabricManagersServer(create_app(state_path=state)) as server,
        HttpFabricController.for_simulator(server.url) as c,
    ):
        assert read_snapshot(c) == before
        # The partition counter and the domains came back too.
        refused(
            lambda: c.nvlink.create_partition(name="alloc-sf", domain_id="sf-rack0", gpu_uids=["GPU-sf1"]),
            409,
            "partition_name_unique",
        )
        assert (
            c.nvlink.create_partition(name="other", domain_id="sf-rack0", gpu_uids=["GPU-sf1"]).partition_id
            > partition.partition_id
        )


@pytest.mark.parametrize("seed", range(4))
def test_random_allocate_release_sequences_keep_tenants_apart(controller, seed):
    rng = random.Random(seed)
    tag = f"rs{seed}"
    topology = make_topology(tag)
    register(controller, topology)
    tenants = [f"{tag}-tenant{i}" for i in range(4)]
    for tenant in tenants:
        ensure_tenant_vpc(controller, tenant)
    free = sorted(topology)
    live: dict[str, tuple[str, list[FabricNode]]] = {}
    tenant_of: dict[str, str] = {}
    for step in range(40):
        if free and (not live or rng.random() < 0.6):
            size = rng.randint(1, min(4, len(free)))
            picked = rng.sample(free, size)
            tenant = rng.choice(tenants)
            allocation = f"{tag}-a{step}"
            apply_and_verify(controller, allocation, tenant, [topology[n] for n in picked])
            live[allocation] = (tenant, [topology[n] for n in picked])
            for node in picked:
                free.remove(node)
                tenant_of[node] = tenant
        else:
            allocation = rng.choice(sorted(live))
            tenant, nodes = live.pop(allocation)
            release(controller, allocation, tenant, nodes)
            for node in nodes:
                free.append(node.node_id)
                del tenant_of[node.node_id]
        snapshot = read_snapshot(controller)
        assert find_violations(snapshot, topology=topology, tenant_of=tenant_of) == [], f"step {step}"
    for allocation, (tenant, nodes) in live.items():
        release(controller, allocation, tenant, nodes)
    for tenant in tenants:
        delete_tenant_vpc(controller, tenant)


def test_a_request_that_changes_nothing_writes_nothing(tmp_path):
    """An apply adds the allocation's ports to the default partition every time; once they are
    members, the managers must not rewrite their state (the default partition holds every port)."""
    state = tmp_path / "fabric.json"
    ports = ["0x00000000000c0001", "0x00000000000c0002"]
    app = create_app(state_path=state)
    fabric = app.state.fabric
    writes: list[int] = []
    save = fabric.saved

    def counted(**kwargs) -> None:
        writes.append(1)
        save(**kwargs)

    fabric.saved = counted
    with FabricManagersServer(app) as server, HttpFabricController.for_simulator(server.url) as c:
        c.infiniband.add_ports(DEFAULT_PKEY, ports, membership=Membership.LIMITED)
        c.infiniband.create_pkey(0x0C01, name="alloc-cn")
        vni = c.ethernet.create_vpc(tenant_id="cn-acme").vni
        assert len(writes) == 3
        c.infiniband.add_ports(DEFAULT_PKEY, ports, membership=Membership.LIMITED)
        c.infiniband.remove_ports(0x0C01, ports[:1])  # not a member: nothing to remove
        c.ethernet.detach(vni, "cn-node")  # not attached
        assert len(writes) == 3
        assert c.infiniband.get_pkey(DEFAULT_PKEY).guids(Membership.LIMITED) == set(ports)
        # A real change is written, and read back afresh.
        c.infiniband.add_ports(0x0C01, ports[1:], membership=Membership.FULL)
        assert len(writes) == 4
        assert c.infiniband.get_pkey(0x0C01).guids(Membership.FULL) == set(ports[1:])
    assert '"0x00000000000c0002", "membership": "full"' in state.read_text()


def test_each_manager_answers_only_its_own_token():
    tokens = FabricTokens("ufm-token", "nmx-token", "sdn-token")
    with FabricManagersServer(create_app(tokens=tokens)) as server:
        with HttpFabricController.for_simulator(server.url, tokens=tokens) as own:
            assert own.infiniband.list_pkeys() is not None
            assert own.nvlink.list_partitions() == [] and own.ethernet.list_vpcs() == []
        paths = {"ufm": "/ufmRest/resources/pkeys", "nmx": "/nmx/v1/partitions", "sdn": "/sdn/v1/vpcs"}
        for manager, path in paths.items():
            for other in tokens._fields:
                answer = httpx.get(server.url + path, headers={"Authorization": f"Bearer {getattr(tokens, other)}"})
                assert answer.status_code == (200 if other == manager else 401), (manager, other, answer.text)
        # A controller given one manager's token for all three reaches that manager only.
        shared = FabricTokens(tokens.ufm, tokens.ufm, tokens.ufm)
        with HttpFabricController.for_simulator(server.url, tokens=shared) as leaked:
            leaked.infiniband.list_pkeys()
            with pytest.raises(FabricError) as refused:
                leaked.nvlink.list_partitions()
            assert refused.value.status_code == 401
