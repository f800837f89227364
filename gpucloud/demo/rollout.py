"""The staged-rollout part of `gpucloud demo`: the promoted version goes out to the allocation's
nodes in waves (a canary, then the rest) through `POST /v1/rollouts`, with live progress; then a
second version goes out under an evaluation threshold its probe cannot meet, fails its canary's
check, and is rolled back, leaving every node on the version before it.

The simulated agents score a version 1.0 when its files verify, so a threshold above 1.0 stands
in for a fine-tune that regressed on the held-out set. Progress comes from `GET /v1/rollouts/{id}`
(the API queries the rollout's workflow); what each node runs, from its agent's weights API.

`demo_rollout` raises `RolloutDemoError` the moment anything is not as expected.
"""

from __future__ import annotations

import time
import uuid

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

FINISHED = ("succeeded", "rolled_back", "failed")
WAVES = [{"nodes": 1}, {"fraction": 1.0}]  # a canary, then the rest
BAKE_S = 1.0
UNREACHABLE_SCORE = 1.01  # above what the evaluation probe ever scores (1.0: the files verify)


class RolloutDemoError(RuntimeError):
    """The rollout did not behave as the demo expects."""


def _call(client: httpx.Client, method: str, path: str, *, expect: int = 200, **kwargs) -> dict:
    response = client.request(method, path, **kwargs)
    if response.status_code != expect:
        raise RolloutDemoError(f"{method} {path} -> HTTP {response.status_code}: {response.text[:400]}")
    return response.json()


def _describe(progress: dict) -> str:
    return f"wave {progress['wave']}/{len(progress['waves']) or '?'} {progress['phase']}"


def _roll_out(console: Console, client: httpx.Client, body: dict, *, timeout_s: float = 60) -> dict:
    """Start a rollout, follow it with a live bar of activated nodes until it ends; its final progress."""
    started = _call(
        client, "POST", "/v1/rollouts", json=body, expect=202, headers={"Idempotency-Key": str(uuid.uuid4())}
    )
    rollout_id = started["rollout_id"]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("nodes active"),
        TimeElapsedColumn(),
    )
    deadline = time.monotonic() + timeout_s
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(rollout_id, total=None)
        while True:
            progress = _call(client, "GET", f"/v1/rollouts/{rollout_id}")
            bar.update(
                task,
                total=sum(map(len, progress["waves"])) or None,
                completed=len(progress["activated"]),
                description=f"{rollout_id} {_describe(progress)}",
            )
            if progress["phase"] in FINISHED:
                break
            if time.monotonic() > deadline:
                raise RolloutDemoError(f"{rollout_id} still {progress['phase']} after {timeout_s:.0f}s")
            time.sleep(0.3)
    console.print(f"{rollout_id}: {_describe(progress)}" + (f" — {progress['reason']}" if progress["reason"] else ""))
    return progress


def _node_versions(sim_url: str, node_ids: list[str], names: dict[str, str]) -> tuple[Table, dict[str, dict]]:
    table = Table(title="weights on the allocation's nodes")
    for column in ("node", "active", "previous"):
        table.add_column(column)
    states = {}
    for node_id in node_ids:
        state = httpx.get(f"{sim_url}/v1/nodes/{node_id}/weights/status", timeout=10).json()
        states[node_id] = state
        table.add_row(
            node_id,
            names.get(state["active"], str(state["active"])),
            names.get(state["previous"], str(state["previous"] or "")),
        )
    return table, states


def demo_rollout(
    console: Console, api_url: str, api_key: str, sim_url: str, allocation_id: str, *, production: str, other: str
) -> None:
    """Roll `production` out to the allocation's nodes, then roll `other` out and watch it roll back."""
    names = {production: f"{production[:12]} (production)", other: f"{other[:12]} (candidate)"}
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as client:
        node_ids = _call(client, "GET", f"/v1/allocations/{allocation_id}")["node_ids"]

        console.rule("rollout: production to the allocation, canary first")
        done = _roll_out(
            console,
            client,
            {"model_version": production, "allocation_id": allocation_id, "waves": WAVES, "bake_s": BAKE_S},
        )
        table, states = _node_versions(sim_url, node_ids, names)
        console.print(table)
        if done["phase"] != "succeeded" or any(s["active"] != production for s in states.values()):
            raise RolloutDemoError(
                f"the rollout ended {done['phase']} ({done['reason']}); nodes run "
                f"{sorted({str(s['active']) for s in states.values()})}"
            )
        for node_id in node_ids:
            verified = httpx.post(
                f"{sim_url}/v1/nodes/{node_id}/weights/verify", json={"digest": production}, timeout=60
            )
            if verified.status_code != 200:
                raise RolloutDemoError(f"{node_id}'s files do not verify: {verified.text[:300]}")
        console.print(
            f"rollout [green]succeeded[/]: {len(node_ids)} nodes run {production[:12]}, "
            "every file verified against the signed manifest"
        )

        console.rule("rollout: a candidate below the evaluation threshold")
        failed = _roll_out(
            console,
            client,
            {
                "model_version": other,
                "allocation_id": allocation_id,
                "waves": WAVES,
                "bake_s": BAKE_S,
                "thresholds": {"min_eval_score": UNREACHABLE_SCORE},
            },
        )
        table, states = _node_versions(sim_url, node_ids, names)
        console.print(table)
        if failed["phase"] != "rolled_back" or any(s["active"] != production for s in states.values()):
            raise RolloutDemoError(
                f"the failing rollout ended {failed['phase']}; nodes run "
                f"{sorted({str(s['active']) for s in states.values()})}"
            )
        console.print(
            f"rollout [yellow]rolled back[/] ({', '.join(failed['rolled_back'])}): "
            f"every node is back on {production[:12]}"
        )
