"""The isolation checker: given a snapshot of the fabric managers and who holds which node, list
every path the fabrics open between tenants. Pure: no I/O; `membership.read_snapshot` reads the
managers.

A violation is any of:
- `shared_pkey`, `shared_nvl_partition`: a partition whose members belong to two tenants;
- `foreign_node_in_vpc`: a node attached to a VPC of a tenant that does not hold it;
- `default_full_member`: a full member of the default partition (0x7fff), which would reach
  every port in it;
- `unassigned_member`: a node that no tenant holds, still in a tenant partition or VPC (a
  release that left membership behind; the next tenant would inherit the path);
- `unknown_member`: a port or GPU the inventory does not know, in a tenant partition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict

from gpucloud.fabric.interface import DEFAULT_PKEY, FabricNode, FabricSnapshot, Membership


class Violation(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: str
    resource: str
    detail: str


def _owners(
    endpoints: Iterable[str],
    node_of: Mapping[str, str],
    tenant_of: Mapping[str, str],
    resource: str,
) -> tuple[set[str], list[Violation]]:
    """The tenants holding `endpoints`, and the members no tenant holds."""
    tenants: set[str] = set()
    strays: list[Violation] = []
    for endpoint in sorted(endpoints):
        node = node_of.get(endpoint)
        if node is None:
            strays.append(Violation(kind="unknown_member", resource=resource, detail=f"{endpoint} is in no node"))
        elif node not in tenant_of:
            strays.append(
                Violation(
                    kind="unassigned_member",
                    resource=resource,
                    detail=f"{endpoint} of free node {node}",
                )
            )
        else:
            tenants.add(tenant_of[node])
    return tenants, strays


def _shared(kind: str, resource: str, tenants: set[str]) -> list[Violation]:
    if len(tenants) < 2:
        return []
    return [Violation(kind=kind, resource=resource, detail="tenants " + ", ".join(sorted(tenants)))]


def find_violations(
    snapshot: FabricSnapshot,
    *,
    topology: Mapping[str, FabricNode],
    tenant_of: Mapping[str, str],
) -> list[Violation]:
    """Every cross-tenant path in `snapshot`; `tenant_of` maps each held node to its tenant."""
    node_of_port = {guid: n.node_id for n in topology.values() for guid in n.port_guids}
    node_of_gpu = {gpu: n.node_id for n in topology.values() for gpu in n.gpu_uids}
    violations: list[Violation] = []
    for pkey in snapshot.pkeys:
        resource = f"pkey 0x{pkey.pkey:04x}"
        if pkey.pkey == DEFAULT_PKEY:
            violations += [
                Violation(kind="default_full_member", resource=resource, detail=f"{guid} is a full member")
                for guid in sorted(pkey.guids(Membership.FULL))
            ]
            continue
        tenants, strays = _owners(pkey.guids(), node_of_port, tenant_of, resource)
        violations += strays + _shared("shared_pkey", resource, tenants)
    for partition in snapshot.nvl_partitions:
        resource = f"NVLink partition {partition.partition_id} ({partition.domain_id})"
        tenants, strays = _owners(partition.gpu_uids, node_of_gpu, tenant_of, resource)
        violations += strays + _shared("shared_nvl_partition", resource, tenants)
    for vpc in snapshot.vpcs:
        resource = f"VNI {vpc.vni} ({vpc.tenant_id})"
        for node in vpc.nodes:
            holder = tenant_of.get(node)
            if holder is None:
                violations.append(Violation(kind="unassigned_member", resource=resource, detail=f"free node {node}"))
            elif holder != vpc.tenant_id:
                violations.append(
                    Violation(
                        kind="foreign_node_in_vpc",
                        resource=resource,
                        detail=f"node {node} of tenant {holder}",
                    )
                )
    return violations
