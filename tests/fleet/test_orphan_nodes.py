"""A node on its way back to the pool whose operation was lost (a worker killed between a
release and the recycle it starts, a workflow terminated by hand) is finished by the sweep's
adoption, not left wiping until its deadline an hour later; a node a bring-up batch holds, or one
that only just got there, is left to its owner."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import select

from gpucloud.db import session_scope
from gpucloud.models.tables import Node, utcnow

pytestmark = pytest.mark.integration


def _strand(h, node_id: str, state: str, *, entered_ago_s: float, held_for_s: float | None = None) -> None:
    """Put a node where a lost operation would leave it: `state`, no workflow driving it."""
    with session_scope(h.settings.database_url) as session:
        node = session.exec(select(Node).where(Node.id == node_id)).one()
        node.state = state
        node.state_entered_at = utcnow() - timedelta(seconds=entered_ago_s)
        node.deadline_at = utcnow() + timedelta(hours=1)  # the deadline is far off
        node.allocation_id = None
        node.next_reconcile_at = utcnow() + timedelta(seconds=held_for_s) if held_for_s else None
        session.add(node)


async def test_a_wiping_node_whose_operation_was_lost_is_recycled_by_the_sweep(ready_fleet, temporal_env):
    h = await ready_fleet(nodes=3)
    lost, young, held = (n["id"] for n in h.nodes())
    _strand(h, lost, "wiping", entered_ago_s=120)
    _strand(h, young, "burn_in", entered_ago_s=1)  # its operation may not be visible yet
    _strand(h, held, "burn_in", entered_ago_s=120, held_for_s=600)  # a bring-up batch holds it

    result = await h.sweep(temporal_env.client)

    assert result.adopted == 1
    await h.wait_states({"available": 1}, timeout_s=60)
    states = {n["id"]: n["state"] for n in h.nodes()}
    assert states == {lost: "available", young: "burn_in", held: "burn_in"}
    # Through the wipe and the burn-in gate, by the node's own operation.
    events = h.operator.get(f"/v1/nodes/{lost}/events").json()["items"]
    steps = [(e["from_state"], e["to_state"]) for e in events if e["actor"].startswith("workflow:node-")]
    assert ("wiping", "burn_in") in steps and ("burn_in", "available") in steps
