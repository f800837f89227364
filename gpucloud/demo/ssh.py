"""The demo's SSH step: the tenant reaches a node of its allocation with the key its workload
named, at the endpoint the API shows (`GET /v1/allocations/{id}/nodes`), and runs a command there;
after the release the same key is refused. The simulated nodes' shell answers from the node's
state and executes nothing (`sim/ssh.py`); the client is asyncssh, so the demo needs no OpenSSH."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gpucloud.client.api import Gpucloud
from gpucloud.demo.common import Demo, DemoFailed
from gpucloud.models.api_schemas import SshEndpoint
from gpucloud.sim.ssh import asyncssh

SSH_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class TenantKey:
    """A key pair the tenant made on its laptop: the public half goes into the workload."""

    private: asyncssh.SSHKey
    public: str

    @classmethod
    def generate(cls) -> TenantKey:
        key = asyncssh.generate_private_key("ssh-ed25519", comment="acme@laptop")
        return cls(key, key.export_public_key().decode().strip())


async def _run(endpoint: SshEndpoint, key: TenantKey, command: str) -> str:
    async with asyncssh.connect(
        endpoint.host,
        endpoint.port,
        username=endpoint.user,
        client_keys=[key.private],
        known_hosts=None,  # a simulated node's host key is made at its start
        agent_path=None,
        password=None,
        connect_timeout=SSH_TIMEOUT_S,
    ) as conn:
        done = await conn.run(command, timeout=SSH_TIMEOUT_S)
        if done.exit_status != 0:
            where = f"{endpoint.host}:{endpoint.port}"
            raise DemoFailed(f"`{command}` on {where} exited {done.exit_status}: {done.stdout!s}")
        return str(done.stdout)


def demo_ssh(demo: Demo, tenant: Gpucloud, alloc_id: str, key: TenantKey) -> SshEndpoint:
    """Log in to the allocation's first node with the workload's key; its endpoint (for the
    refusal after the release)."""
    node = next((n for n in tenant.allocations.nodes(alloc_id).items if n.ssh is not None), None)
    if node is None or node.ssh is None:
        raise DemoFailed(f"no node of allocation {alloc_id} shows where it takes SSH")
    hostname = demo.operator.nodes.get(node.node_id).hostname
    out = asyncio.run(_run(node.ssh, key, "hostname; nvidia-smi -L")).splitlines()
    if not out or out[0] != hostname:
        raise DemoFailed(f"ssh to {node.node_id} answered {out[:1]}, expected its hostname {hostname}")
    demo.console.print(
        f"[green]ssh[/] {node.ssh.command} (the workload's key): `hostname` answers {out[0]}, "
        f"`nvidia-smi -L` lists {len(out) - 1} GPUs"
    )
    return node.ssh


def demo_ssh_refused(demo: Demo, endpoint: SshEndpoint, key: TenantKey) -> None:
    """After the release the key opens the node no more."""
    try:
        asyncio.run(_run(endpoint, key, "hostname"))
    except asyncssh.PermissionDenied:
        demo.console.print(f"ssh to {endpoint.host}:{endpoint.port} [green]refused[/] after the release: key removed")
        return
    raise DemoFailed(f"the released allocation's key still opens {endpoint.host}:{endpoint.port}")
