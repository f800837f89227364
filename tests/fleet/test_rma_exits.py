"""Issue 14: RMA has its two exits, operator actions through the API and the CLI, recorded in the
node's events: `hardware-replaced` (the node is enrolled again and must pass inspection, wipe
and burn-in before it serves) and `retire` (out of the fleet for good)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import sqlalchemy as sa
from sqlmodel import col

from gpucloud.db import session_scope
from gpucloud.models.tables import Node
from support.forked import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def _to_rma(db_url: str, node_id: str) -> None:
    """As the repair ladder leaves a lemon: its state set straight in the DB (test setup)."""
    with session_scope(db_url) as session:
        session.execute(sa.update(Node).where(col(Node.id) == node_id).values(state="rma"))


def _cli(h, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "GPUCLOUD_API__PORT": str(h.settings.api.port),
        "GPUCLOUD_API__OPERATOR_TOKEN": h.settings.operator_token,
        "COLUMNS": "200",
    }
    return run_cli(list(args), env=env, cwd=h.log_dir)


async def test_a_replaced_node_is_burnt_in_again_and_a_retired_one_leaves_the_fleet(ready_fleet, db_url):
    h = await ready_fleet(nodes=3, latency_scale=0.02)
    repaired, retired, serving = h.node_ids()
    _to_rma(db_url, repaired)
    _to_rma(db_url, retired)

    with h.operator as op:
        # Neither exit applies to a node in service; nor does a replacement to a node not in RMA.
        refused = op.post(f"/v1/nodes/{serving}/retire", json={"reason": "typo"})
        assert refused.status_code == 409 and "available" in refused.json()["detail"], refused.text
        assert op.post(f"/v1/nodes/{serving}/hardware-replaced").status_code == 409
        assert op.post("/v1/nodes/no-such-node/retire").status_code == 404

        done = op.post(f"/v1/nodes/{repaired}/hardware-replaced", json={"reason": "vendor case 4711: GPU 3 swapped"})
        assert done.status_code == 200, done.text
        assert done.json()["node"]["state"] == "enrolled"
        assert done.json()["operation"]["kind"] == "node_hardware_replaced"

    await h.wait_states({"available": 2, "rma": 1}, timeout_s=60)  # the replaced node is back
    with h.operator as op:
        events = op.get(f"/v1/nodes/{repaired}/events", params={"page_size": 100}).json()["items"]
    path = [(e["from_state"], e["to_state"]) for e in events if e["from_state"] != e["to_state"]]
    after = path[path.index(("rma", "enrolled")) :]
    assert [to for _, to in after] == ["enrolled", "inspecting", "wiping", "burn_in", "available"], after
    replaced = next(e for e in events if e["event"] == "hardware_replaced")
    assert replaced["actor"] == "operator:bootstrap" and "vendor case 4711" in replaced["cause"]

    out = _cli(h, "node", "retire", retired, "--reason", "third lemon this year", "--output", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["node"]["state"] == "retired"
    again = _cli(h, "node", "retire", retired)
    assert again.returncode != 0 and "retired" in again.stderr, again.stderr
    with h.operator as op:
        assert op.get(f"/v1/nodes/{retired}").json()["state"] == "retired"
        last = op.get(f"/v1/nodes/{retired}/events", params={"page_size": 100}).json()["items"][-1]
        assert (last["event"], last["cause"]) == ("retire", "third lemon this year")
