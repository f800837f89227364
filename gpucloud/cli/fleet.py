"""`gpucloud nodes`: the fleet as a table (operator), optionally refreshed live."""

from __future__ import annotations

import itertools
import time
from typing import Annotated

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from gpucloud.cli.common import api_client, console, reported_errors
from gpucloud.client.api import Gpucloud
from gpucloud.models.tables import NodePublic

STATE_STYLE = {
    "available": "green",
    "active": "cyan",
    "quarantined": "red",
    "rma": "red",
    "retired": "dim",
    "draining": "yellow",
    "provisioning": "blue",
    "wiping": "magenta",
    "burn_in": "magenta",
}


def _fetch(api: Gpucloud, state: str | None, limit: int) -> tuple[list[NodePublic], dict]:
    nodes = list(itertools.islice(api.nodes.list(state=state, page_size=min(1000, limit)), limit))
    return nodes, api.nodes.summary()


def _render(nodes: list[NodePublic], summary: dict) -> Group:
    table = Table(title=f"nodes ({len(nodes)} shown of {summary['total']})")
    for col in ("id", "state", "health", "gpu", "rack", "allocation", "flags"):
        table.add_column(col)
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
            f"{n['gpu_count']}x {n['gpu_type']}",
            n["rack"],
            n["allocation_id"] or "",
            flags,
        )
    counts = "  ".join(f"{k}: {v}" for k, v in sorted(summary["by_state"].items()))
    return Group(table, f"by state  {counts}")


def nodes(
    state: Annotated[str | None, typer.Option(help="only nodes in this state")] = None,
    watch: Annotated[bool, typer.Option(help="refresh every 2 s until Ctrl-C")] = False,
    limit: Annotated[int, typer.Option(help="at most this many rows")] = 200,
) -> None:
    """List nodes (operator token from GPUCLOUD_API__OPERATOR_TOKEN or the data dir)."""
    try:
        with reported_errors(), api_client(operator=True) as api:
            if not watch:
                console.print(_render(*_fetch(api, state, limit)))
                return
            with Live(_render(*_fetch(api, state, limit)), console=console, refresh_per_second=2) as live:
                while True:
                    time.sleep(2)
                    live.update(_render(*_fetch(api, state, limit)))
    except KeyboardInterrupt:
        pass
