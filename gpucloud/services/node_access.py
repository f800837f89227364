"""How a tenant reaches a node of its allocation: the node's SSH endpoint, as the tenant is shown it.

The address is the network side's, not the node's word: enrollment records the node's address on
the tenants' network (what the IPAM assigned its tenant-facing port) and the port its sshd listens
on, as it records the node's InfiniBand ports and BMC; the tenant's VPC attach puts that port in
the tenant's network. The login user is the image's (`AgentSettings.ssh_user`), the one whose
authorized_keys the agent fills with the workload's keys at provision and empties at release
(`agent/ssh_keys.py`)."""

from __future__ import annotations

import shlex

from gpucloud.models.api_schemas import SshEndpoint
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node


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
