"""Determinism: recorded workflow histories replay against the current workflow code.

`tests/histories/*.json` are histories recorded from real runs and committed: a change to a
workflow's command order fails here. Before the first release such a change re-records them on
purpose (GPUCLOUD_RECORD_HISTORIES=1); after it, the change goes behind `workflow.patched(...)`
(see docs/architecture.md, "Workflow versioning").
"""

from __future__ import annotations

import os

import pytest
from temporalio.client import WorkflowHistory

from gpucloud.models.workflow_ids import allocation_workflow_id
from support.histories import HISTORIES, record, replayer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("path", sorted(HISTORIES.glob("*.json")), ids=lambda p: p.stem)
async def test_recorded_histories_replay(path, temporal_env):
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    await replayer(temporal_env.client).replay_workflow(history)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_fresh_allocation_history_replays(ready_fleet, temporal_env):
    h = await ready_fleet(nodes=2, latency_scale=0.02)
    _, key = await h.onboard()
    with h.client(key) as c:
        alloc_id = h.allocate(key, node_count=2)
        await h.wait_allocation(key, alloc_id, "ready")
        c.post(f"/v1/allocations/{alloc_id}/cancel")
        await h.wait_allocation(key, alloc_id, "released")
    handle = temporal_env.client.get_workflow_handle(allocation_workflow_id(alloc_id))
    await handle.result()
    history = await handle.fetch_history()
    await replayer(temporal_env.client).replay_workflow(history)
    await h.wait_states({"available": 2})
    node_id = h.nodes()[0]["id"]
    node_history = await temporal_env.client.get_workflow_handle(f"node-{node_id}").fetch_history()
    await replayer(temporal_env.client).replay_workflow(node_history)
    if os.environ.get("GPUCLOUD_RECORD_HISTORIES"):
        record(temporal_env.client, history, "allocation_workflow")
        record(temporal_env.client, node_history, "node_operation_workflow")
