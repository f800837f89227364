"""The staged-rollout part of `gpucloud demo`: the promoted version goes out to the allocation's
nodes in waves (a canary, then the rest) through `POST /v1/rollouts`, with live progress; then the
bad candidate (a fine-tune with one NaN weight) goes out, the canary's check runs the model's
sanity evaluator on the node against the version it ran before, its gate fails, and the rollout
is rolled back, leaving every node on the version before it.

Progress comes from `GET /v1/rollouts/{id}` (the API queries the rollout's workflow); what each
node runs, from its agent's weights API.
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


def demo_rollout(demo: Demo, tenant: Gpucloud, allocation_id: str, *, production: str, bad: str) -> None:
    """Roll `production` out to the allocation's nodes, then roll the `bad` candidate out and
    watch the canary's sanity gate roll it back."""
    names = {production: f"{production[:12]} (production)", bad: f"{bad[:12]} (NaN candidate)"}
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

    demo.console.rule("rollout: the NaN candidate, judged on the canary by the sanity gate")
    failed = _roll_out(demo, tenant, {"model_version": bad, **base})
    if failed.phase != "rolled_back" or "nan_inf_count (sanity)" not in failed.reason:
        raise DemoFailed(f"the rollout of {names[bad]} ended {failed.phase} ({failed.reason}), not rolled back by nan")
    _on_nodes(demo, node_ids, names, production)
    demo.console.print(f"canary check: {failed.reason}")
    demo.console.print(
        f"rollout [yellow]rolled back[/] ({', '.join(failed.rolled_back)}): every node is back on {production[:12]}"
    )
