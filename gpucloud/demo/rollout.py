"""The staged-rollout part of `gpucloud demo`: the promoted version goes out to the allocation's
nodes in waves (a canary, then the rest) through `POST /v1/rollouts`, with live progress; then a
second version goes out under an evaluation threshold its probe cannot meet, fails its canary's
check, and is rolled back, leaving every node on the version before it.

The simulated agents score a version 1.0 when its files verify, so a threshold above 1.0 stands
in for a fine-tune that regressed on the held-out set. Progress comes from `GET /v1/rollouts/{id}`
(the API queries the rollout's workflow); what each node runs, from its agent's weights API.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from gpucloud.cli.rollout import watch
from gpucloud.client.api import Gpucloud
from gpucloud.demo.common import Demo, DemoFailed
from gpucloud.models.rollout_messages import RolloutProgress

WAVES = [{"nodes": 1}, {"fraction": 1.0}]  # a canary, then the rest
BAKE_S = 1.0
UNREACHABLE_SCORE = 1.01  # above what the evaluation probe ever scores (1.0: the files verify)


def _roll_out(demo: Demo, tenant: Gpucloud, body: dict[str, Any], *, timeout_s: float = 60) -> RolloutProgress:
    """Start a rollout and follow it with a live bar of activated nodes until it ends."""
    rollout_id = tenant.rollouts.create(body).rollout_id
    return watch(tenant, rollout_id, out=demo.console, poll_s=0.3, timeout_s=timeout_s)


def _on_nodes(demo: Demo, node_ids: list[str], names: dict[str, str], version: str) -> None:
    """Show what each node runs; DemoFailed unless every one runs `version`."""
    table = Table(title="weights on the allocation's nodes")
    for column in ("node", "active", "previous"):
        table.add_column(column)
    active = set()
    for node_id in node_ids:
        state = demo.sim.weights_status(node_id)
        active.add(state["active"])
        previous = state["previous"] or ""
        table.add_row(node_id, names.get(state["active"], str(state["active"])), names.get(previous, previous))
    demo.console.print(table)
    if active != {version}:
        raise DemoFailed(f"nodes run {sorted(map(str, active))}, expected only {names[version]}")


def demo_rollout(demo: Demo, tenant: Gpucloud, allocation_id: str, *, production: str, other: str) -> None:
    """Roll `production` out to the allocation's nodes, then roll `other` out and watch it roll back."""
    names = {production: f"{production[:12]} (production)", other: f"{other[:12]} (candidate)"}
    node_ids = tenant.allocations.get(allocation_id).node_ids
    base = {"allocation_id": allocation_id, "waves": WAVES, "bake_s": BAKE_S}

    demo.console.rule("rollout: production to the allocation, canary first")
    done = _roll_out(demo, tenant, {"model_version": production, **base})
    if done.phase != "succeeded":
        raise DemoFailed(f"the rollout of {names[production]} ended {done.phase}: {done.reason}")
    _on_nodes(demo, node_ids, names, production)
    for node_id in node_ids:
        demo.sim.verify_weights(node_id, production)
    demo.console.print(
        f"rollout [green]succeeded[/]: {len(node_ids)} nodes run {production[:12]}, "
        "every file verified against the signed manifest"
    )

    demo.console.rule("rollout: a candidate below the evaluation threshold")
    thresholds = {"min_eval_score": UNREACHABLE_SCORE}
    failed = _roll_out(demo, tenant, {"model_version": other, **base, "thresholds": thresholds})
    if failed.phase != "rolled_back":
        raise DemoFailed(f"the failing rollout of {names[other]} ended {failed.phase}, not rolled_back")
    _on_nodes(demo, node_ids, names, production)
    demo.console.print(
        f"rollout [yellow]rolled back[/] ({', '.join(failed.rolled_back)}): every node is back on {production[:12]}"
    )
