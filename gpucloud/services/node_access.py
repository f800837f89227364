"""How a tenant reaches a node of its allocation: the node's SSH endpoint, as the tenant is shown it.

The address is the network side's, not the node's word: enrollment records the node's address on
the tenants' network (what the IPAM assigned its tenant-facing port) and the port its sshd listens
on, as it records the node's InfiniBand ports and BMC; the tenant's VPC attach puts that port in
the tenant's network. The login user is the image's (`AgentSettings.ssh_user`), the one whose
authorized_keys the agent fills with the workload's keys at provision and empties at release
(`agent/ssh_keys.py`)."""

from __future__ import annotations

import shlex

from sqlmodel import Session, col, select

from gpucloud.models.api_schemas import SshEndpoint
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Allocation, Node
from gpucloud.services.errors import NotFound


def ssh_command(host: str, port: int, user: str) -> str:
    """The command line that logs in (`ssh -p 2222 ubuntu@10.0.0.7`)."""
    return shlex.join(["ssh", "-p", str(port), f"{user}@{host}"])


def ssh_endpoint(node: Node, *, allocation_id: str, user: str) -> SshEndpoint | None:
    """Where the allocation's tenant logs in to `node`: only while the node is active in that
    allocation (its keys are in from provision to release), and only for a node enrolled with an
    address on the tenants' network."""
    if node.ssh_host is None or node.allocation_id != allocation_id or node.state != NodeState.ACTIVE:
        return None
    return SshEndpoint(
        host=node.ssh_host, port=node.ssh_port, user=user, command=ssh_command(node.ssh_host, node.ssh_port, user)
    )


def node_in(session: Session, alloc: Allocation, node_id: str) -> Node:
    """The node `node_id` of the allocation (one the caller sees), or NotFound naming the
    allocation's node listing where it is not one of its nodes."""
    node = session.exec(select(Node).where(col(Node.id) == node_id)).first()
    if node is None or node_id not in alloc.node_ids or node.allocation_id != alloc.id:
        raise NotFound(
            "node",
            node_id,
            title="Node not in allocation",
            detail=f"node {node_id!r} is not a node of allocation {alloc.id} "
            f"(see GET /v1/allocations/{alloc.id}/nodes)",
        )
    return node


def nodes_of(session: Session, alloc: Allocation) -> dict[str, Node]:
    """The allocation's nodes that exist, by id."""
    nodes = session.exec(select(Node).where(col(Node.id).in_(list(alloc.node_ids)))).all()
    return {n.id: n for n in nodes}
