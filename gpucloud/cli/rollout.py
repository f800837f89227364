"""`gpucloud rollout`: start a staged rollout of a model version, watch it, pause, resume or abort it.

Talks to the API (`/v1/rollouts`) with the tenant's API key (`--api-key` / `GPUCLOUD_API_KEY`;
`--api-url` / `GPUCLOUD_API_URL`, else the configured API address). `start` and `status --watch`
show live progress: a bar of activated nodes over the target, the wave and its phase, until the
rollout succeeds or rolls back (exit 0 on success, 1 otherwise).
"""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import TextColumn
from rich.table import Table

from gpucloud.cli.common import (
    ApiKey,
    ApiUrl,
    Output,
    api_client,
    console,
    err,
    id_column,
    print_table,
    progress_bar,
    reported_errors,
)

if TYPE_CHECKING:
    from gpucloud.client.api import Gpucloud
    from gpucloud.models.rollout_messages import RolloutProgress

rollout_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Staged rollouts of a model version: canary, then waves, with rollback.",
)


def parse_wave(text: str) -> dict:
    """`1` (nodes) or `10%` (of the target)."""
    try:
        if text.endswith("%"):
            return {"fraction": float(text[:-1]) / 100}
        return {"nodes": int(text)}
    except ValueError:
        raise typer.BadParameter(f"{text!r} is neither a node count nor a percentage", param_hint="--wave") from None


def describe(progress: RolloutProgress) -> str:
    state = "paused" if progress.paused and not progress.finished else progress.phase
    return f"wave {progress.wave}/{len(progress.waves) or '?'} {state}"


def watch(
    api: Gpucloud, rollout_id: str, *, out: Console = console, poll_s: float = 1.0, timeout_s: float = 7 * 86400
) -> RolloutProgress:
    """Follow the rollout with a live bar of activated nodes over its target until it ends; its
    final progress (a summary line printed)."""
    with progress_bar(out, TextColumn("nodes active")) as bar:
        task = bar.add_task(rollout_id, total=None)

        def show(progress: RolloutProgress) -> None:
            total = sum(len(w) for w in progress.waves) or None
            bar.update(
                task, total=total, completed=len(progress.activated), description=f"{rollout_id} {describe(progress)}"
            )

        final = api.rollouts.watch(rollout_id, poll_s=poll_s, timeout_s=timeout_s, on_poll=show)
    summary(final, out)
    return final


def summary(progress: RolloutProgress, out: Console = console) -> None:
    colour = {"succeeded": "green", "rolled_back": "yellow", "failed": "yellow"}.get(progress.phase, "cyan")
    out.print(
        f"[{colour}]{progress.rollout_id}: {describe(progress)}[/]"
        + (f" — {progress.reason}" if progress.reason else "")
    )
    if progress.rolled_back:
        out.print(f"rolled back: {', '.join(progress.rolled_back)}")


@rollout_app.command()
def start(
    model_version: Annotated[
        str,
        typer.Argument(
            help="the version: MODEL@ALIAS (e.g. minilm@production), MODEL@DIGEST (a unique prefix of 8+ hex "
            "digits will do) or a full digest; the rollout records the digest it names now"
        ),
    ],
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
    output: Output = "table",
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
    with reported_errors(), api_client(api_url, api_key) as api:
        created = api.rollouts.create(body, idempotency_key=idempotency_key)
        rollout_id = created.rollout_id
        for warning in created.warnings:  # on stderr: `-o json` keeps stdout one document
            err.print(f"[yellow]warning:[/] {warning}")
        if output == "json":  # no live bars: the final progress as one JSON document
            final = watch(api, rollout_id, out=err) if wait else api.rollouts.get(rollout_id)
            print(final.model_dump_json(indent=2))
            if wait and final.phase != "succeeded":
                raise typer.Exit(1)
            return
        console.print(f"rollout [bold]{rollout_id}[/] of {created.progress.model_version} started")
        if wait and watch(api, rollout_id).phase != "succeeded":
            raise typer.Exit(1)


@rollout_app.command()
def status(
    rollout_id: str,
    follow: Annotated[bool, typer.Option("--watch", help="follow until it ends")] = False,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Show a rollout's progress (per node, where a step reported on it)."""
    with reported_errors(), api_client(api_url, api_key) as api:
        if follow:
            watch(api, rollout_id)
            return
        progress = api.rollouts.get(rollout_id)
    if output == "json":
        print(progress.model_dump_json(indent=2))
        return
    summary(progress)
    for index, nodes in enumerate(progress.waves, start=1):
        console.print(f"  wave {index}: {', '.join(nodes)}")
    for node_id, outcome in sorted(progress.outcomes.items()):
        if not outcome.ok:
            console.print(f"  [red]{node_id}[/]: {outcome.detail}")


@rollout_app.command("list")
def list_command(
    limit: Annotated[int, typer.Option(min=1, help="show at most this many")] = 100,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The tenant's rollouts, newest first (running ones, then by when they ended), ids in full."""
    with reported_errors(), api_client(api_url, api_key) as api:
        rollouts = list(itertools.islice(api.rollouts.list(), limit))
    if output == "json":
        print(json.dumps([r.model_dump(mode="json") for r in rollouts], indent=2))
        return
    table = Table(
        id_column("rollout"),
        "status",
        id_column("model version"),
        id_column("allocation"),
        "started",
        "ended",
        title="rollouts",
    )
    for r in rollouts:
        table.add_row(
            r.rollout_id,
            r.status,
            r.model_version or "",
            r.allocation_id or "",
            f"{r.started_at:%Y-%m-%d %H:%M:%S}",
            f"{r.closed_at:%Y-%m-%d %H:%M:%S}" if r.closed_at else "",
        )
    print_table(table)


def _command(name: str, rollout_id: str, reason: str, output: str, api_url: str | None, api_key: str | None) -> None:
    with reported_errors(), api_client(api_url, api_key) as api:
        progress = api.rollouts.command(rollout_id, name, reason)
    if output == "json":
        print(progress.model_dump_json(indent=2))
        return
    summary(progress)


Reason = Annotated[str, typer.Option(help="why, kept with the rollout")]


@rollout_app.command()
def pause(
    rollout_id: str, reason: Reason = "", output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None
) -> None:
    """Hold the rollout at the next wave boundary."""
    _command("pause", rollout_id, reason, output, api_url, api_key)


@rollout_app.command()
def resume(
    rollout_id: str, reason: Reason = "", output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None
) -> None:
    """Let a paused rollout go on."""
    _command("resume", rollout_id, reason, output, api_url, api_key)


@rollout_app.command()
def abort(
    rollout_id: str, reason: Reason = "", output: Output = "table", api_url: ApiUrl = None, api_key: ApiKey = None
) -> None:
    """Stop the rollout now and roll back every node it activated."""
    _command("abort", rollout_id, reason, output, api_url, api_key)
