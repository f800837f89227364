"""Determinism: recorded workflow histories replay against the current workflow code.

`tests/histories/*.json` are histories recorded from real runs and committed: a change to a
workflow's command order fails here. Before the first release such a change re-records them on
purpose (GPUCLOUD_RECORD_HISTORIES=1); after it, the change goes behind `workflow.patched(...)`
(see docs/architecture.md, "Workflow versioning").
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Worker

from gpucloud.models.workflow_ids import allocation_workflow_id
from support.histories import HISTORIES, record, replayer
from support.slow_replay import SlowToReplay

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


async def test_a_replay_whose_code_is_slow_between_yields_still_replays(temporal_env):
    client = temporal_env.client
    async with Worker(client, task_queue=f"slow-{uuid.uuid4().hex[:8]}", workflows=[SlowToReplay]) as worker:
        handle = await client.start_workflow(
            SlowToReplay.run, id=f"slow-{uuid.uuid4().hex[:8]}", task_queue=worker.task_queue
        )
        assert await handle.result() == "done"
    history = await handle.fetch_history()
    # Bounded: a replayer whose activation the detector failed has hung.
    result = await asyncio.wait_for(
        replayer(client, [SlowToReplay]).replay_workflow(history, raise_on_replay_failure=False), 60
    )
    assert result.replay_failure is None, result.replay_failure
