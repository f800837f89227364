"""`gpucloud nodes`: the fleet as a table (operator), optionally refreshed live."""

from __future__ import annotations

import time
from typing import Annotated

import httpx
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from gpucloud.config import get_settings

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


def _fetch(client: httpx.Client, state: str | None, limit: int) -> tuple[list[dict], dict]:
    items: list[dict] = []
    token = ""
    while len(items) < limit:
        params: dict[str, str | int] = {
            "page_size": min(1000, limit - len(items)),
            **({"state": state} if state else {}),
            **({"page_token": token} if token else {}),
        }
        page = client.get("/v1/nodes", params=params)
        page.raise_for_status()
        body = page.json()
        items += body["items"]
        token = body["next_page_token"]
        if not token:
            break
    summary = client.get("/v1/fleet/summary").json()
    return items, summary


def _render(nodes: list[dict], summary: dict) -> Group:
    table = Table(title=f"nodes ({len(nodes)} shown of {summary['total']})")
    for col in ("id", "state", "health", "gpu", "rack", "allocation", "flags"):
        table.add_column(col)
    for n in nodes:
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
    settings = get_settings()
    client = httpx.Client(
        base_url=settings.api_url, timeout=30, headers={"Authorization": f"Bearer {settings.operator_token}"}
    )
    console = Console()
    try:
        if not watch:
            console.print(_render(*_fetch(client, state, limit)))
            return
        with Live(_render(*_fetch(client, state, limit)), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(2)
                live.update(_render(*_fetch(client, state, limit)))
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot reach the API at {settings.api_url}:[/] {exc}; is `gpucloud up` running?")
        raise typer.Exit(1) from exc
    except KeyboardInterrupt:
        pass
