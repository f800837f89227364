"""`gpucloud rollout`: start a staged rollout of a model version, watch it, pause, resume or abort it.

Talks to the API (`/v1/rollouts`) with the tenant's API key (`--api-key` / `GPUCLOUD_API_KEY`;
`--api-url` / `GPUCLOUD_API_URL`, else the configured API address). `start` and `status --watch`
show live progress: a bar of activated nodes over the target, the wave and its phase, until the
rollout succeeds or rolls back (exit 0 on success, 1 otherwise).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gpucloud.config import get_settings

rollout_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Staged rollouts of a model version: canary, then waves, with rollback.",
)
console, err = Console(), Console(stderr=True)
FINISHED = {"succeeded", "rolled_back", "failed"}

ApiUrl = Annotated[str | None, typer.Option("--api-url", envvar="GPUCLOUD_API_URL", help="default: the configured API")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar="GPUCLOUD_API_KEY", help="the tenant's API key")]


def _client(api_url: str | None, api_key: str | None) -> httpx.Client:
    if not api_key:
        err.print("[red]error:[/] no API key: set GPUCLOUD_API_KEY or pass --api-key")
        raise typer.Exit(1)
    return httpx.Client(
        base_url=api_url or get_settings().api_url, timeout=30, headers={"Authorization": f"Bearer {api_key}"}
    )


def _call(client: httpx.Client, method: str, path: str, **kwargs) -> dict:
    try:
        response = client.request(method, path, **kwargs)
    except httpx.TransportError as exc:
        err.print(f"[red]error:[/] cannot reach the API: {exc}")
        raise typer.Exit(1) from None
    if response.status_code >= 400:
        try:
            body = response.json()
            detail = f"{body.get('title')}: {body.get('detail')}"
        except ValueError:
            detail = response.text[:500]
        err.print(f"[red]error ({response.status_code}):[/] {detail}")
        raise typer.Exit(1)
    return response.json()


def parse_wave(text: str) -> dict:
    """`1` (nodes) or `10%` (of the target)."""
    try:
        if text.endswith("%"):
            return {"fraction": float(text[:-1]) / 100}
        return {"nodes": int(text)}
    except ValueError:
        raise typer.BadParameter(f"{text!r} is neither a node count nor a percentage", param_hint="--wave") from None


def _describe(progress: dict) -> str:
    waves = len(progress.get("waves") or []) or "?"
    state = "paused" if progress.get("paused") and progress["phase"] not in FINISHED else progress["phase"]
    return f"wave {progress.get('wave', 0)}/{waves} {state}"


def watch(client: httpx.Client, rollout_id: str, *, poll_s: float = 1.0) -> dict:
    """Follow the rollout with a live bar until it ends; its final progress."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("nodes active"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(rollout_id, total=None)
        while True:
            progress = _call(client, "GET", f"/v1/rollouts/{rollout_id}")
            total = sum(len(w) for w in progress.get("waves") or []) or None
            bar.update(
                task,
                total=total,
                completed=len(progress.get("activated") or []),
                description=f"{rollout_id} {_describe(progress)}",
            )
            if progress["phase"] in FINISHED:
                break
            time.sleep(poll_s)
    _summary(progress)
    return progress


def _summary(progress: dict) -> None:
    phase = progress["phase"]
    colour = "green" if phase == "succeeded" else "yellow" if phase in ("rolled_back", "failed") else "cyan"
    console.print(
        f"[{colour}]{progress['rollout_id']}: {_describe(progress)}[/]"
        + (f" — {progress['reason']}" if progress.get("reason") else "")
    )
    if progress.get("rolled_back"):
        console.print(f"rolled back: {', '.join(progress['rolled_back'])}")


@rollout_app.command()
def start(
    model_version: Annotated[str, typer.Argument(help="the version's manifest digest")],
    node: Annotated[list[str] | None, typer.Option("--node", help="a target node (repeat)")] = None,
    allocation: Annotated[str | None, typer.Option(help="every node of this allocation")] = None,
    fleet: Annotated[bool, typer.Option("--fleet", help="the tenant's whole serving fleet")] = False,
    wave: Annotated[
        list[str] | None, typer.Option("--wave", help="a wave: N nodes or P% (repeat); default 1, 10%, 50%, 100%")
    ] = None,
    bake_s: Annotated[float, typer.Option("--bake", help="seconds each wave bakes before its check")] = 300.0,
    min_eval: Annotated[float, typer.Option("--min-eval", help="lowest evaluation probe score that passes")] = 0.0,
    wait: Annotated[bool, typer.Option("--watch/--no-watch", help="follow the rollout until it ends")] = True,
    idempotency_key: Annotated[str | None, typer.Option(help="default: a fresh one")] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Start a staged rollout; with --watch (default) follow it until it succeeds or rolls back."""
    body: dict = {"model_version": model_version, "bake_s": bake_s, "thresholds": {"min_eval_score": min_eval}}
    if node:
        body["node_ids"] = node
    if allocation:
        body["allocation_id"] = allocation
    if fleet:
        body["serving_fleet"] = True
    if wave:
        body["waves"] = [parse_wave(w) for w in wave]
    with _client(api_url, api_key) as client:
        accepted = _call(
            client, "POST", "/v1/rollouts", json=body, headers={"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        )
        rollout_id = accepted["rollout_id"]
        console.print(f"rollout [bold]{rollout_id}[/] started")
        if wait and watch(client, rollout_id)["phase"] != "succeeded":
            raise typer.Exit(1)


@rollout_app.command()
def status(
    rollout_id: str,
    follow: Annotated[bool, typer.Option("--watch", help="follow until it ends")] = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Show a rollout's progress (per node, where a step reported on it)."""
    with _client(api_url, api_key) as client:
        if follow:
            watch(client, rollout_id)
            return
        progress = _call(client, "GET", f"/v1/rollouts/{rollout_id}")
    _summary(progress)
    for index, nodes in enumerate(progress.get("waves") or [], start=1):
        console.print(f"  wave {index}: {', '.join(nodes)}")
    for node_id, outcome in sorted((progress.get("outcomes") or {}).items()):
        if not outcome["ok"]:
            console.print(f"  [red]{node_id}[/]: {outcome['detail']}")


def _command(name: str, rollout_id: str, reason: str, api_url: str | None, api_key: str | None) -> None:
    with _client(api_url, api_key) as client:
        progress = _call(client, "POST", f"/v1/rollouts/{rollout_id}:{name}", json={"reason": reason})
    _summary(progress)


Reason = Annotated[str, typer.Option(help="why, kept with the rollout")]


@rollout_app.command()
def pause(rollout_id: str, reason: Reason = "", api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """Hold the rollout at the next wave boundary."""
    _command("pause", rollout_id, reason, api_url, api_key)


@rollout_app.command()
def resume(rollout_id: str, reason: Reason = "", api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """Let a paused rollout go on."""
    _command("resume", rollout_id, reason, api_url, api_key)


@rollout_app.command()
def abort(rollout_id: str, reason: Reason = "", api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """Stop the rollout now and roll back every node it activated."""
    _command("abort", rollout_id, reason, api_url, api_key)
