"""The isolation checker on hand-built snapshots and on random membership operations, compared
with an oracle that tracks each resource's tenants directly from the operations."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.fabric.interface import (
    DEFAULT_PKEY,
    FabricNode,
    FabricSnapshot,
    Membership,
    NvlPartition,
    PKey,
    PortMember,
    Vpc,
)
from gpucloud.fabric.isolation import find_violations

pytestmark = pytest.mark.unit

NODES = 8
TOPOLOGY = {
    f"n{i}": FabricNode(
        node_id=f"n{i}",
        port_guids=(f"0x{i:016x}", f"0x{i + 100:016x}"),
        nvl_domain=f"rack{i % 2}",
        gpu_uids=(f"GPU-{i}-0", f"GPU-{i}-1"),
    )
    for i in range(NODES)
}
TENANTS = ("acme", "globex", "initech")


def snapshot(pkeys=(), partitions=(), vpcs=()) -> FabricSnapshot:
    return FabricSnapshot(pkeys=tuple(pkeys), nvl_partitions=tuple(partitions), vpcs=tuple(vpcs))


def full(*nodes: str) -> tuple[PortMember, ...]:
    return tuple(PortMember(guid=g, membership=Membership.FULL) for n in nodes for g in TOPOLOGY[n].port_guids)


def kinds(violations) -> list[str]:
    return sorted(v.kind for v in violations)


def test_clean_state_has_no_violation():
    state = snapshot(
        pkeys=[
            PKey(
                pkey=DEFAULT_PKEY,
                members=tuple(
                    PortMember(guid=g, membership=Membership.LIMITED) for n in TOPOLOGY.values() for g in n.port_guids
                ),
            ),
            PKey(pkey=0x10, members=full("n0", "n1")),
            PKey(pkey=0x11, members=full("n2")),
        ],
        partitions=[NvlPartition(partition_id=1, name="a", domain_id="rack0", gpu_uids=("GPU-0-0", "GPU-0-1"))],
        vpcs=[Vpc(vni=1, tenant_id="acme", nodes=("n0", "n1")), Vpc(vni=2, tenant_id="globex", nodes=("n2",))],
    )
    assert find_violations(state, topology=TOPOLOGY, tenant_of={"n0": "acme", "n1": "acme", "n2": "globex"}) == []


def test_each_kind_of_path_is_found():
    state = snapshot(
        pkeys=[
            PKey(pkey=DEFAULT_PKEY, members=(PortMember(guid="0x0000000000000000", membership=Membership.FULL),)),
            PKey(pkey=0x10, members=full("n0", "n2")),
            PKey(pkey=0x11, members=(*full("n3"), PortMember(guid="0x00000000deadbeef", membership=Membership.FULL))),
        ],
        partitions=[NvlPartition(partition_id=1, name="a", domain_id="rack0", gpu_uids=("GPU-0-0", "GPU-2-0"))],
        vpcs=[Vpc(vni=1, tenant_id="acme", nodes=("n0", "n2"))],
    )
    violations = find_violations(state, topology=TOPOLOGY, tenant_of={"n0": "acme", "n2": "globex"})
    assert kinds(violations) == [
        "default_full_member",
        "foreign_node_in_vpc",
        "shared_nvl_partition",
        "shared_pkey",
        "unassigned_member",
        "unassigned_member",
        "unknown_member",
    ]
    shared = next(v for v in violations if v.kind == "shared_pkey")
    assert shared.resource == "pkey 0x0010" and "acme" in shared.detail and "globex" in shared.detail


pkey_ids = st.integers(min_value=1, max_value=6)
node_names = st.sampled_from(sorted(TOPOLOGY))
membership_ops = st.lists(
    st.one_of(
        st.tuples(st.just("ib"), pkey_ids, node_names, st.sampled_from(list(Membership))),
        st.tuples(st.just("ib-remove"), pkey_ids, node_names, st.just(None)),
        st.tuples(st.just("nvl"), pkey_ids, node_names, st.just(None)),
        st.tuples(st.just("vpc"), st.sampled_from(TENANTS), node_names, st.just(None)),
    ),
    max_size=40,
)
assignments = st.dictionaries(node_names, st.sampled_from(TENANTS))


@settings(max_examples=150, deadline=None)
@given(ops=membership_ops, tenant_of=assignments)
def test_checker_agrees_with_an_oracle_over_random_membership_ops(ops, tenant_of):
    pkeys: dict[int, dict[str, Membership]] = defaultdict(dict)
    partitions: dict[int, set[str]] = defaultdict(set)
    vpcs: dict[str, list[str]] = defaultdict(list)
    for op, target, node, membership in ops:
        if op == "ib":
            for guid in TOPOLOGY[node].port_guids:
                pkeys[target][guid] = membership
        elif op == "ib-remove":
            for guid in TOPOLOGY[node].port_guids:
                pkeys[target].pop(guid, None)
        elif op == "nvl":
            partitions[target] |= set(TOPOLOGY[node].gpu_uids)
        elif node not in vpcs[target]:
            vpcs[target].append(node)
    expected: set[tuple[str, str]] = set()
    node_of = {g: n for n in TOPOLOGY.values() for g in (*n.port_guids, *n.gpu_uids)}
    for resource, endpoints, kind in [
        *((f"pkey 0x{p:04x}", m.keys(), "shared_pkey") for p, m in pkeys.items()),
        *((f"nvl {p}", gpus, "shared_nvl_partition") for p, gpus in partitions.items()),
    ]:
        owners = {node_of[e].node_id for e in endpoints}
        if owners - tenant_of.keys():
            expected.add(("unassigned_member", resource))
        if len({tenant_of[n] for n in owners if n in tenant_of}) > 1:
            expected.add((kind, resource))
    for tenant, nodes in vpcs.items():
        if set(nodes) - tenant_of.keys():
            expected.add(("unassigned_member", f"vpc {tenant}"))
        if any(tenant_of.get(n, tenant) != tenant for n in nodes):
            expected.add(("foreign_node_in_vpc", f"vpc {tenant}"))

    state = snapshot(
        pkeys=[
            PKey(pkey=p, members=tuple(PortMember(guid=g, membership=m) for g, m in members.items()))
            for p, members in pkeys.items()
        ],
        partitions=[
            NvlPartition(partition_id=p, name=str(p), domain_id="any", gpu_uids=tuple(sorted(g)))
            for p, g in partitions.items()
        ],
        vpcs=[Vpc(vni=i + 1, tenant_id=t, nodes=tuple(n)) for i, (t, n) in enumerate(sorted(vpcs.items()))],
    )
    vpc_names = {f"VNI {v.vni} ({v.tenant_id})": f"vpc {v.tenant_id}" for v in state.vpcs}
    nvl_names = {f"NVLink partition {p.partition_id} (any)": f"nvl {p.partition_id}" for p in state.nvl_partitions}
    found = {
        (v.kind, vpc_names.get(v.resource) or nvl_names.get(v.resource) or v.resource)
        for v in find_violations(state, topology=TOPOLOGY, tenant_of=tenant_of)
    }
    assert found == expected


@settings(max_examples=100, deadline=None)
@given(tenant_of=assignments)
def test_one_partition_per_tenant_is_always_clean(tenant_of):
    by_tenant: dict[str, list[str]] = defaultdict(list)
    for node, tenant in sorted(tenant_of.items()):
        by_tenant[tenant].append(node)
    state = snapshot(
        pkeys=[PKey(pkey=i + 1, members=full(*nodes)) for i, nodes in enumerate(by_tenant.values())],
        partitions=[
            NvlPartition(
                partition_id=i + 1,
                name=t,
                domain_id="any",
                gpu_uids=tuple(g for n in nodes for g in TOPOLOGY[n].gpu_uids),
            )
            for i, (t, nodes) in enumerate(by_tenant.items())
        ],
        vpcs=[Vpc(vni=i + 1, tenant_id=t, nodes=tuple(n)) for i, (t, n) in enumerate(by_tenant.items())],
    )
    assert find_violations(state, topology=TOPOLOGY, tenant_of=tenant_of) == []
