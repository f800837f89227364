"""`gpucloud allocations ssh`: log in to a node of an allocation, with a key its workload named.

The API says where each node takes SSH (`GET /v1/allocations/{id}/nodes`: the node's address on
the tenants' network, its port, the image's login user); this prints the `ssh` command that
connects, or runs it in this process's place (the terminal is the tenant's, as with `ssh`
itself). `allocations show` lists the same endpoints in its nodes table (`node_table`).
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

if TYPE_CHECKING:  # the API's schemas load with the command's client, not at the CLI's start
    from gpucloud.models.api_schemas import AllocationNode

from gpucloud.cli.common import ApiKey, ApiUrl, ExitCode, api_client, err, id_column, reported_errors


def ssh_argv(
    node: AllocationNode,
    *,
    identity: str | None = None,
    options: Sequence[str] = (),
    command: Sequence[str] = (),
) -> list[str]:
    """The `ssh` command line for the node: its port, the login user at its address, then the
    caller's identity file, options and remote command, if any."""
    assert node.ssh is not None
    argv = ["ssh", "-p", str(node.ssh.port)]
    if identity:
        argv += ["-i", identity]
    for option in options:
        argv += ["-o", option]
    return [*argv, f"{node.ssh.user}@{node.ssh.host}", *command]


def pick_node(allocation_id: str, nodes: list[AllocationNode], wanted: str | None) -> AllocationNode:
    """The node to log in to: `wanted`, else the allocation's first that takes SSH now. Exits 3
    for a node not in the allocation, 4 where none takes SSH yet (or any more)."""
    if wanted is not None:
        node = next((n for n in nodes if n.node_id == wanted), None)
        if node is None:
            err.print(f"[red]error:[/] node {wanted} is not in allocation {allocation_id}: its nodes are {_ids(nodes)}")
            raise typer.Exit(ExitCode.NOT_FOUND)
        if node.ssh is None:
            err.print(f"[red]error:[/] node {wanted} takes no SSH now ({node.state}): {_why_none(allocation_id)}")
            raise typer.Exit(ExitCode.CONFLICT)
        return node
    reachable = [n for n in nodes if n.ssh is not None]
    if not reachable:
        states = ", ".join(f"{n.node_id} {n.state}" for n in nodes) or "no nodes yet"
        why = _why_none(allocation_id)
        err.print(f"[red]error:[/] no node of allocation {allocation_id} takes SSH now ({states}): {why}")
        raise typer.Exit(ExitCode.CONFLICT)
    return reachable[0]


def _ids(nodes: list[AllocationNode]) -> str:
    return ", ".join(n.node_id for n in nodes) or "none yet"


def _why_none(allocation_id: str) -> str:
    return (
        "a node takes SSH while it is active in the allocation and was enrolled with its address on the tenants' "
        f"network; see `gpucloud allocations show {allocation_id}`"
    )


def allocations_ssh(
    allocation_id: str,
    command: Annotated[list[str] | None, typer.Argument(help="a command to run there (after --)")] = None,
    node: Annotated[str | None, typer.Option(help="this node of the allocation (default: its first)")] = None,
    print_only: Annotated[
        bool, typer.Option("--print", help="print the ssh command instead of running it (for scripts, other clients)")
    ] = False,
    identity: Annotated[
        str | None, typer.Option("--identity", "-i", help="the private key of a public key the workload named")
    ] = None,
    ssh_option: Annotated[
        list[str] | None, typer.Option(help="an ssh -o option, as ssh takes it (repeat for each)")
    ] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Log in to a node of the allocation over SSH (or --print the command): its address on your
    network and its port, as the image's login user, with a key the allocation's workload named."""
    with reported_errors(), api_client(api_url, api_key) as api:
        nodes = api.allocations.nodes(allocation_id).items
    chosen = pick_node(allocation_id, nodes, node)
    argv = ssh_argv(chosen, identity=identity, options=ssh_option or (), command=command or ())
    if print_only:
        print(shlex.join(argv))
        return
    if shutil.which("ssh") is None:
        err.print(f"[red]error:[/] no ssh client on PATH: install OpenSSH's, or run with another: {shlex.join(argv)}")
        raise typer.Exit(ExitCode.ERROR)
    os.execvp("ssh", argv)


def node_table(nodes: list[AllocationNode]) -> Table:
    """The allocation's nodes with where each takes SSH (`allocations show`; print it with
    `print_table`, which keeps the ids and the command whole)."""
    table = Table(id_column("node"), "state", "health", id_column("ssh"), title="nodes")
    for n in nodes:
        table.add_row(n.node_id, n.state, n.health, n.ssh.command if n.ssh is not None else "")
    return table
