"""Apply an allocation's fabric membership, read it back, take nodes out of it, and release it.

An allocation gets one InfiniBand pkey (its nodes' ports as full members; every port also a
limited member of the default partition), one NVLink partition per NVL72 domain it touches, and
its nodes attached to the tenant's VPC. Resources are found again by name (`alloc-<id>`), so
every step is idempotent and a retried activity, or a release after a crash, needs no state
beyond the allocation id. `apply_and_verify` converges the pkey and the NVLink partitions to
exactly the nodes given (a replacement joins, a member no longer listed leaves) and raises
`FabricVerificationError` unless what the managers answer on a fresh read is exactly that: a
node becomes `active` only after. `remove_nodes` takes pulled nodes out, VPC included.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from gpucloud.fabric.interface import (
    DEFAULT_PKEY,
    MAX_PKEY,
    MIN_PKEY,
    FabricController,
    FabricError,
    FabricNode,
    FabricSnapshot,
    FabricVerificationError,
    Membership,
    Vpc,
)


class AppliedFabric(BaseModel):
    model_config = ConfigDict(frozen=True)

    allocation_id: str
    tenant_id: str
    pkey: int | None
    nvl_partition_ids: tuple[int, ...]
    vni: int


def resource_name(allocation_id: str) -> str:
    return f"alloc-{allocation_id}"


def ensure_tenant_vpc(controller: FabricController, tenant_id: str) -> Vpc:
    """The tenant's VPC, created with a free VNI the first time (onboarding)."""
    existing = controller.ethernet.list_vpcs(tenant_id=tenant_id)
    if existing:
        return existing[0]
    try:
        return controller.ethernet.create_vpc(tenant_id=tenant_id)
    except FabricError as exc:
        if exc.constraint != "one_vni_per_tenant":
            raise
        return controller.ethernet.list_vpcs(tenant_id=tenant_id)[0]


def delete_tenant_vpc(controller: FabricController, tenant_id: str) -> None:
    """Offboarding: the VPC goes once every allocation is released (the manager refuses before)."""
    for vpc in controller.ethernet.list_vpcs(tenant_id=tenant_id):
        controller.ethernet.delete_vpc(vpc.vni)


def _ensure_pkey(controller: FabricController, name: str, allocation_id: str) -> int:
    ib = controller.infiniband
    pkeys = ib.list_pkeys()
    for pkey in pkeys:
        if pkey.name == name:
            return pkey.pkey
    taken = {p.pkey for p in pkeys}
    span = MAX_PKEY - MIN_PKEY + 1
    # Start where the allocation id hashes to, so concurrent allocations rarely race for one key.
    start = zlib.crc32(allocation_id.encode()) % span
    for offset in range(span):
        candidate = MIN_PKEY + (start + offset) % span
        if candidate in taken:
            continue
        try:
            return ib.create_pkey(candidate, name=name).pkey
        except FabricError as exc:
            if exc.constraint != "pkey_unique":
                raise
    raise FabricError(409, "pkey_range", "no free pkey left in 0x0001-0x7ffe")


def _gpus_by_domain(nodes: Sequence[FabricNode]) -> dict[str, list[str]]:
    domains: dict[str, list[str]] = defaultdict(list)
    for node in nodes:
        if node.nvl_domain is not None and node.gpu_uids:
            domains[node.nvl_domain].extend(node.gpu_uids)
    return dict(domains)


def _converge_pkey(controller: FabricController, name: str, allocation_id: str, guids: list[str]) -> int:
    """The allocation's pkey, holding exactly `guids` as full members."""
    ib = controller.infiniband
    pkey = _ensure_pkey(controller, name, allocation_id)
    current = ib.get_pkey(pkey)
    if leaving := sorted((current.guids() if current else set()) - set(guids)):
        ib.remove_ports(pkey, leaving)
    ib.add_ports(pkey, guids, membership=Membership.FULL)
    return pkey


def _ensure_nvl_partitions(controller: FabricController, name: str, nodes: Sequence[FabricNode]) -> list[int]:
    """One partition per domain the nodes' GPUs are in, holding exactly those GPUs; the
    allocation's partitions in other domains (every tray there left) go."""
    nvlink = controller.nvlink
    wanted = _gpus_by_domain(nodes)
    ids = []
    for partition in nvlink.list_partitions():
        if partition.name == name and partition.domain_id not in wanted:
            nvlink.delete_partition(partition.partition_id)
    for domain, gpus in sorted(wanted.items()):
        existing = [p for p in nvlink.list_partitions(domain_id=domain) if p.name == name]
        if not existing:
            partition = nvlink.create_partition(name=name, domain_id=domain, gpu_uids=gpus)
        elif set(existing[0].gpu_uids) != set(gpus):
            partition = nvlink.update_partition(existing[0].partition_id, gpu_uids=gpus)
        else:
            partition = existing[0]
        ids.append(partition.partition_id)
    return ids


def apply_and_verify(
    controller: FabricController,
    allocation_id: str,
    tenant_id: str,
    nodes: Sequence[FabricNode],
) -> AppliedFabric:
    """Make `nodes` the allocation's members on every fabric, then read back and compare."""
    name = resource_name(allocation_id)
    guids = sorted({g for node in nodes for g in node.port_guids})
    pkey = None
    if guids:
        controller.infiniband.add_ports(DEFAULT_PKEY, guids, membership=Membership.LIMITED)
        pkey = _converge_pkey(controller, name, allocation_id, guids)
    partition_ids = _ensure_nvl_partitions(controller, name, nodes)
    vpc = ensure_tenant_vpc(controller, tenant_id)
    for node in nodes:
        controller.ethernet.attach(vpc.vni, node.node_id)
    applied = AppliedFabric(
        allocation_id=allocation_id,
        tenant_id=tenant_id,
        pkey=pkey,
        nvl_partition_ids=tuple(partition_ids),
        vni=vpc.vni,
    )
    differences = _differences(controller, applied, nodes)
    if differences:
        raise FabricVerificationError(allocation_id, differences)
    return applied


def _differences(controller: FabricController, applied: AppliedFabric, nodes: Sequence[FabricNode]) -> list[str]:
    found: list[str] = []
    guids = {g for node in nodes for g in node.port_guids}
    if applied.pkey is not None:
        pkey = controller.infiniband.get_pkey(applied.pkey)
        members = set() if pkey is None else {(m.guid, m.membership) for m in pkey.members}
        if members != {(g, Membership.FULL) for g in guids}:
            found.append(f"pkey 0x{applied.pkey:04x} holds {sorted(members)}, expected {sorted(guids)} as full")
        default = controller.infiniband.get_pkey(DEFAULT_PKEY)
        limited = set() if default is None else default.guids(Membership.LIMITED)
        if missing := guids - limited:
            found.append(f"default partition lacks limited members {sorted(missing)}")
    expected = _gpus_by_domain(nodes)
    for partition_id in applied.nvl_partition_ids:
        partition = controller.nvlink.get_partition(partition_id)
        wanted = set(expected.pop(partition.domain_id, ())) if partition else set()
        if partition is None or set(partition.gpu_uids) != wanted:
            found.append(f"NVLink partition {partition_id} holds {partition and sorted(partition.gpu_uids)}")
    if expected:
        found.append(f"no NVLink partition in domains {sorted(expected)}")
    vpc = controller.ethernet.get_vpc(applied.vni)
    if vpc is None or vpc.tenant_id != applied.tenant_id:
        found.append(f"VNI {applied.vni} is not tenant {applied.tenant_id}'s VPC")
    elif missing_nodes := {n.node_id for n in nodes} - set(vpc.nodes):
        found.append(f"VNI {applied.vni} lacks nodes {sorted(missing_nodes)}")
    return found


def remove_nodes(
    controller: FabricController,
    allocation_id: str,
    tenant_id: str,
    nodes: Sequence[FabricNode],
) -> None:
    """Take `nodes` out of the allocation's membership (idempotent; a partition left without GPUs
    goes), then check nothing of theirs is left in it."""
    name = resource_name(allocation_id)
    guids = {g for node in nodes for g in node.port_guids}
    gpus = {g for node in nodes for g in node.gpu_uids}
    node_ids = {n.node_id for n in nodes}
    ib = controller.infiniband
    pkeys = [p for p in (ib.get_pkey(n.pkey) for n in ib.list_pkeys() if n.name == name) if p is not None]
    for pkey in pkeys:
        if held := guids & pkey.guids():
            ib.remove_ports(pkey.pkey, sorted(held))
    for partition in controller.nvlink.list_partitions():
        if partition.name != name or not gpus & set(partition.gpu_uids):
            continue
        if keep := [g for g in partition.gpu_uids if g not in gpus]:
            controller.nvlink.update_partition(partition.partition_id, gpu_uids=keep)
        else:
            controller.nvlink.delete_partition(partition.partition_id)
    for vpc in controller.ethernet.list_vpcs(tenant_id=tenant_id):
        for node_id in sorted(node_ids & set(vpc.nodes)):
            controller.ethernet.detach(vpc.vni, node_id)
    left = [
        f"{sorted(guids & p.guids())} in pkey 0x{p.pkey:04x}"
        for p in (ib.get_pkey(n.pkey) for n in pkeys)
        if p is not None and guids & p.guids()
    ]
    left += [
        f"{sorted(gpus & set(p.gpu_uids))} in NVLink partition {p.partition_id}"
        for p in controller.nvlink.list_partitions()
        if p.name == name and gpus & set(p.gpu_uids)
    ]
    left += [
        f"nodes {sorted(node_ids & set(v.nodes))} on VNI {v.vni}"
        for v in controller.ethernet.list_vpcs(tenant_id=tenant_id)
        if node_ids & set(v.nodes)
    ]
    if left:
        raise FabricVerificationError(allocation_id, [f"still present after removal: {', '.join(left)}"])


def release(controller: FabricController, allocation_id: str, tenant_id: str, nodes: Sequence[FabricNode]) -> None:
    """Remove the allocation's membership (idempotent), then check nothing of it is left.

    Ports stay limited members of the default partition, which reaches no one.
    """
    name = resource_name(allocation_id)
    for pkey in controller.infiniband.list_pkeys():
        if pkey.name == name:
            controller.infiniband.delete_pkey(pkey.pkey)
    for partition in controller.nvlink.list_partitions():
        if partition.name == name:
            controller.nvlink.delete_partition(partition.partition_id)
    node_ids = {n.node_id for n in nodes}
    for vpc in controller.ethernet.list_vpcs(tenant_id=tenant_id):
        for node_id in node_ids & set(vpc.nodes):
            controller.ethernet.detach(vpc.vni, node_id)
    left = [f"pkey 0x{p.pkey:04x}" for p in controller.infiniband.list_pkeys() if p.name == name]
    left += [f"NVLink partition {p.partition_id}" for p in controller.nvlink.list_partitions() if p.name == name]
    left += [
        f"node {n} on VNI {v.vni}"
        for v in controller.ethernet.list_vpcs(tenant_id=tenant_id)
        for n in node_ids & set(v.nodes)
    ]
    if left:
        raise FabricVerificationError(allocation_id, [f"still present after release: {', '.join(left)}"])


def read_snapshot(controller: FabricController) -> FabricSnapshot:
    """What the three managers hold now, for `isolation.find_violations`."""
    return FabricSnapshot(
        pkeys=tuple(controller.infiniband.list_pkeys(members=True)),
        nvl_partitions=tuple(controller.nvlink.list_partitions()),
        vpcs=tuple(controller.ethernet.list_vpcs()),
    )
