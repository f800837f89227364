"""`gpucloud nodes`: the fleet as a table (operator), optionally refreshed live; `gpucloud node`:
an operator's lifecycle actions on one node (the ways out of RMA); `gpucloud fleet spares`: spare
nodes per pool, needed beside held."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich import box
from rich.console import Group
from rich.live import Live
from rich.table import Column, Table

from gpucloud.cli.common import Output, api_client, console, id_column, print_table, reported_errors
from gpucloud.models.node_states import NodeState

if TYPE_CHECKING:
    from gpucloud.client.api import Gpucloud
    from gpucloud.models.api_schemas import FleetSpares
    from gpucloud.models.tables import NodePublic

STATE_STYLE = {
    NodeState.AVAILABLE: "green",
    NodeState.ACTIVE: "cyan",
    NodeState.QUARANTINED: "red",
    NodeState.RMA: "red",
    NodeState.RETIRED: "dim",
    NodeState.DRAINING: "yellow",
    NodeState.PROVISIONING: "blue",
    NodeState.WIPING: "magenta",
    NodeState.BURN_IN: "magenta",
}


def _fetch(api: Gpucloud, state: str | None, limit: int) -> tuple[list[NodePublic], dict]:
    nodes = list(itertools.islice(api.nodes.list(state=state, page_size=min(1000, limit)), limit))
    return nodes, api.nodes.summary()


def _render(nodes: list[NodePublic], summary: dict) -> Group:
    return Group(_nodes_table(nodes, summary), _counts(summary))


def _nodes_table(nodes: list[NodePublic], summary: dict) -> Table:
    table = Table(
        id_column("id"),
        "state",
        "health",
        "power",
        "gpu",
        "rack",
        id_column("allocation"),
        "flags",
        title=f"nodes ({len(nodes)} shown of {summary['total']})",
    )
    for node in nodes:
        n = node.model_dump(mode="json")
        flags = ",".join(
            f
            for f, on in (
                ("cordoned", n["cordoned"]),
                ("maintenance", n["maintenance"]),
                ("drain", n["drain_requested"]),
                ("unreachable", not n["agent_reachable"]),
            )
            if on
        )
        style = STATE_STYLE.get(n["state"], "")
        table.add_row(
            n["id"],
            f"[{style}]{n['state']}[/]" if style else n["state"],
            n["health"],
            _power(n),
            f"{n['gpu_count']}x {n['gpu_type']}",
            n["rack"],
            n["allocation_id"] or "",
            flags,
        )
    return table


def _counts(summary: dict) -> str:
    return "by state  " + "  ".join(f"{k}: {v}" for k, v in sorted(summary["by_state"].items()))


def _power(node: dict) -> str:
    """The BMC's last word on the node's power ('-' without a BMC; red when the BMC failed)."""
    if not node.get("bmc_url"):
        return "-"
    state = node.get("power_state") or "?"
    if (node.get("bmc_last") or {}).get("ok") is False:
        return f"[red]{state} (BMC {node['bmc_last'].get('kind', 'error')})[/]"
    return {"On": "[green]On[/]", "Off": "[dim]Off[/]"}.get(state, state)


def nodes(
    state: Annotated[str | None, typer.Option(help="only nodes in this state")] = None,
    watch: Annotated[bool, typer.Option(help="refresh every 2 s until Ctrl-C")] = False,
    limit: Annotated[int, typer.Option(help="at most this many rows")] = 200,
    output: Output = "table",
) -> None:
    """List nodes (an operator's token: GPUCLOUD_API__OPERATOR_TOKEN or the context's, `gpucloud config view`)."""
    try:
        with reported_errors(), api_client(operator=True) as api:
            if output == "json":
                listed, summary = _fetch(api, state, limit)
                body = {"nodes": [n.model_dump(mode="json") for n in listed], "summary": summary}
                print(json.dumps(body, indent=2))
                return
            if not watch:
                listed, summary = _fetch(api, state, limit)
                print_table(_nodes_table(listed, summary))
                console.print(_counts(summary))
                return
            with Live(_render(*_fetch(api, state, limit)), console=console, refresh_per_second=2) as live:
                while True:
                    time.sleep(2)
                    live.update(_render(*_fetch(api, state, limit)))
    except KeyboardInterrupt:
        pass


fleet_app = typer.Typer(no_args_is_help=True, help="The fleet as a whole (operator): spare capacity.")


@fleet_app.command("spares")
def spares(
    output: Output = "table",
    as_json: Annotated[bool, typer.Option("--json", help="the same as -o json")] = False,
) -> None:
    """Spare nodes per pool (GPU type/region): held now, needed so that a pulled node's
    replacement starts within the target at the probability shown, and the failure rate planned
    on (measured from the pool's node incidents, or the Llama 3 default until there are enough
    node-hours)."""
    with reported_errors(), api_client(operator=True) as api:
        fleet = api.nodes.spares()
    if as_json or output == "json":
        print(json.dumps(fleet.model_dump(mode="json"), indent=2))
        return
    print_table(_spares_table(fleet))


def _spares_table(fleet: FleetSpares) -> Table:
    """Eight columns: without the box's edges and rules they fit 80 characters."""
    days = fleet.window_s / 86_400
    table = Table(
        id_column("pool"),
        Column("nodes", justify="right"),
        Column("held", justify="right"),
        Column("needed", justify="right"),
        Column("shortfall", justify="right"),
        Column("rate", justify="right"),
        "rate source",
        Column("probability", justify="right"),
        title=f"spare nodes per pool (rate: failures per node-hour, over {days:g} days)",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for pool in fleet.pools:
        table.add_row(
            pool.pool,
            str(pool.nodes),
            str(pool.spares_held),
            str(pool.spares_needed),
            f"[red]{pool.shortfall}[/]" if pool.shortfall else "0",
            f"{pool.failures_per_node_hour:.3g}",
            pool.rate_source.replace("_", " "),
            f"{pool.probability:g}",
        )
    return table


node_app = typer.Typer(no_args_is_help=True, help="An operator's lifecycle actions on one node.")


def _lifecycle(node_id: str, action: str, reason: str, output: str) -> None:
    with reported_errors(), api_client(operator=True) as api:
        done = getattr(api.nodes, action)(node_id, reason)
    if output == "json":
        print(done.model_dump_json(indent=2))
        return
    style = STATE_STYLE.get(done.node.state, "")
    console.print(f"{done.node.id}: [{style}]{done.node.state}[/]  ({done.operation.kind} {done.operation.status})")


def _lifecycle_command(action: str, summary: str):
    def command(
        node_id: str,
        reason: Annotated[str, typer.Option(help="recorded in the node's events (a vendor's case, say)")] = "",
        output: Output = "table",
    ) -> None:
        _lifecycle(node_id, action, reason, output)

    command.__doc__ = summary
    return command


@node_app.command("power")
def power(
    node_id: str,
    action: Annotated[str, typer.Argument(help="on, off or cycle (off, then on)")],
    reason: Annotated[str, typer.Option(help="recorded in the node's events")] = "",
    wait: Annotated[bool, typer.Option(help="wait until the BMC's power state shows it")] = True,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 300.0,
    output: Output = "table",
) -> None:
    """Power a node on or off, or cycle it, through its BMC (Redfish)."""
    with reported_errors(), api_client(operator=True) as api:
        done = api.nodes.power(node_id, action, reason)
        operation = done.operation
        if wait:
            with console.status(f"{node_id}: power {action} through the BMC"):
                operation = api.operations.wait(operation.id, timeout_s=timeout)
        node = api.nodes.get(node_id)
    if output == "json":
        print(json.dumps({"node": node.model_dump(mode="json"), "operation": operation.model_dump(mode="json")}))
        return
    answer = (node.bmc_last or {}).get("answer", "")
    console.print(f"{node_id}: power {node.power_state}  ({operation.kind} {operation.status}) {answer}")
    if operation.status == "failed":
        raise typer.Exit(1)


@node_app.command("enroll")
def enroll(
    nodes_file: Annotated[
        Path,
        typer.Argument(
            help="YAML or JSON: one node or a list, each with id, hostname, region, pod, rack, gpu_type, "
            "gpu_count and agent_url (https://<node>:8200), optionally bmc_url, bmc_system_id, bmc_credential_ref, "
            "and ssh_host (its address on the tenants' network) with ssh_port (default 22)"
        ),
    ],
    output: Output = "table",
) -> None:
    """Enroll nodes: recorded, then each brought up (inspection, wipe, burn-in) once its agent answers."""
    try:
        loaded = yaml.safe_load(nodes_file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot read {nodes_file}: {exc}", param_hint="NODES_FILE") from None
    nodes = loaded if isinstance(loaded, list) else [loaded]
    if not nodes or not all(isinstance(n, dict) for n in nodes):
        raise typer.BadParameter(f"{nodes_file} holds no node mappings", param_hint="NODES_FILE")
    with reported_errors(), api_client(operator=True) as api:
        done = api.nodes.enroll(nodes)
    if output == "json":
        print(done.model_dump_json(indent=2))
        return
    console.print(
        f"enrolled {done.enrolled} (already known {done.already_known}); bring-up started for "
        f"{done.bringups_started}, {done.deferred} deferred to the reconciler's sweep. Next: "
        "`gpucloud node credential <id> --out FILE` for each node's agent"
    )


@node_app.command("credential")
def credential(
    node_id: str,
    out: Annotated[
        Path | None,
        typer.Option(help="write it here (0600) instead of printing it; copy it to the node's --token-file"),
    ] = None,
    output: Output = "table",
) -> None:
    """Issue the node's agent credential (the one before it stops working): the agent reports with it."""
    with reported_errors(), api_client(operator=True) as api:
        issued = api.nodes.agent_credential(node_id)
    if out is None:
        print(json.dumps({"node_id": node_id, "token": issued.token}) if output == "json" else issued.token)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(issued.token + "\n")
    os.chmod(out, 0o600)
    if output == "json":
        print(json.dumps({"node_id": node_id, "written_to": str(out)}))
        return
    console.print(f"{node_id}'s agent credential written to {out} (0600): install it as the agent's --token-file")


node_app.command("hardware-replaced")(
    _lifecycle_command(
        "hardware_replaced", "RMA done: the node is enrolled again and runs through inspection, wipe and burn-in."
    )
)
node_app.command("retire")(
    _lifecycle_command("retire", "Take the node out of the fleet for good (from RMA, quarantine, or enrolled).")
)


bmc_app = typer.Typer(no_args_is_help=True, help="Nodes' BMCs over Redfish.")


@bmc_app.command("systems")
def bmc_systems(
    url: Annotated[str, typer.Option(help="the BMC's (or a chassis manager's) Redfish service")],
    credential: Annotated[
        str, typer.Option(help="a credential reference in the secrets directory (GPUCLOUD_BMC__CREDENTIALS_DIR)")
    ],
    output: Output = "table",
) -> None:
    """Discover the systems a BMC lists: what to enroll (bmc_url, bmc_system_id, bmc_credential_ref)."""
    from gpucloud import bootstrap
    from gpucloud.adapters.bmc import BmcError
    from gpucloud.cli.common import err
    from gpucloud.config import get_settings

    try:
        systems = bootstrap.bmcs(get_settings()).discover(url, credential)
    except BmcError as error:
        advice = "check the URL and try again" if error.retryable else "fix the credential or the URL"
        err.print(f"[red]error ({error.kind}):[/] {error}; {advice}")
        raise typer.Exit(1) from None
    if output == "json":
        print(json.dumps([s.as_record() for s in systems], indent=2))
        return
    table = Table(id_column("system id"), title=f"systems on {url}")
    for col in ("name", "power", "manufacturer", "model", "serial", "cpus", "memory GiB", "BIOS"):
        table.add_column(col)
    for s in systems:
        table.add_row(
            s.system_id, s.name or "", s.power_state or "", s.manufacturer or "", s.model or "",
            s.serial_number or "", str(s.cpu_count or ""), str(s.memory_gib or ""), s.bios_version or "",
        )  # fmt: skip
    print_table(table)
