"""The control plane's side of a wipe's cleaning: each step the agent answers (its GPUs reset, each
tenant disk sanitized, the tenant's files removed) becomes one event in the node's history with
the agent's words as its cause, once per wipe however often the activity is retried; a wipe
answered with a failed step, or with steps that cannot be read, fails closed. The answers come
from the simulated fleet, which answers as the real agent does (`tests/agent/test_agent_cleaning.py`)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlmodel import col, select
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from gpucloud.activities.host_agent import HostAgentActivities
from gpucloud.db import Database, session_scope
from gpucloud.models.messages import AgentActionInput, AgentBatchInput
from gpucloud.models.tables import NodeTransition
from gpucloud.protocol.actions import ActionRequest, AgentAction
from gpucloud.sim.nodes import Fleet, FleetSpec
from support.nodes import enroll

pytestmark = pytest.mark.integration


class FleetAgents:
    """The simulated fleet answering in-process, as `HttpHostAgents` hands answers over; `edit`
    changes an answer on its way (an agent that says something else)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.calls, self.edit = fleet, 0, None

    async def act(self, agent_url: str, action: AgentAction, req: ActionRequest, *, node_id: str) -> dict[str, Any]:
        self.calls += 1
        status, body = await self.fleet.act(self.fleet.node(node_id), action, req)
        assert status == 200, body
        return self.edit(body) if self.edit else body

    async def call(self, *args, **kwargs):
        raise AssertionError("a wipe calls no other agent route")

    async def aclose(self) -> None:
        return None


@pytest.fixture
def wiping(db_url):
    fleet = Fleet(FleetSpec(nodes=2, latency_scale=0, id_prefix="n"))
    enroll(db_url, list(fleet.nodes))
    agents = FleetAgents(fleet)
    return HostAgentActivities(agents, db=Database(db_url)), agents, db_url


def _events(db_url: str, node_id: str) -> list[NodeTransition]:
    with session_scope(db_url) as session:
        rows = session.exec(
            select(NodeTransition).where(col(NodeTransition.node_id) == node_id).order_by(col(NodeTransition.seq))
        ).all()
        return [row.model_copy() for row in rows]


def _wipe(node_id: str, request_id: str = "wipe-1") -> AgentActionInput:
    return AgentActionInput(node_id=node_id, agent_url="http://unused", request_id=request_id)


async def test_each_cleaning_step_is_one_node_event_with_its_answer_once_per_wipe(wiping):
    activities, agents, db_url = wiping
    env = ActivityEnvironment()
    await env.run(activities.wipe_node, _wipe("n-00000"))
    await env.run(activities.wipe_node, _wipe("n-00000"))  # a retry: the same answer, from memory
    events = [(e.event, e.cause, e.op_id) for e in _events(db_url, "n-00000")][-3:]
    assert events == [
        ("gpu_reset", "every GPU: gpu_reset: 8 GPUs reset", "clean:wipe-1"),
        (
            "disk_sanitized",
            "/dev/nvme1n1: crypto_erase: nvme format /dev/nvme1n1 --ses=2 --force: Success formatting namespace:1",
            "clean:wipe-1",
        ),
        (
            "scratch_removed",
            "/var/lib/gpucloud/scratch: remove: removed the tenant's files, weights and workload output",
            "clean:wipe-1",
        ),
    ]
    assert agents.calls == 2 and len(_events(db_url, "n-00000")) == 3  # recorded once
    await env.run(activities.wipe_node, _wipe("n-00000", "wipe-2"))  # the next wipe is its own
    assert [e.op_id for e in _events(db_url, "n-00000")].count("clean:wipe-2") == 3


async def test_a_bring_up_batch_records_every_nodes_cleaning(wiping):
    activities, _, db_url = wiping
    items = [_wipe(node_id, f"batch-{node_id}") for node_id in ("n-00000", "n-00001")]
    result = await ActivityEnvironment().run(
        activities.agent_batch, AgentBatchInput(action=AgentAction.WIPE, items=items)
    )
    assert result.failed == {} and result.unreachable == {}
    for node_id in ("n-00000", "n-00001"):
        assert [e.event for e in _events(db_url, node_id)] == ["gpu_reset", "disk_sanitized", "scratch_removed"]


async def test_a_wipe_answered_with_a_failed_step_fails_closed_and_the_step_is_recorded(wiping):
    activities, agents, db_url = wiping

    def disk_failed(body: dict) -> dict:
        body["cleaning"][1] |= {"ok": False, "answer": "NVMe status: Invalid Field in Command(0x4002)"}
        return body

    agents.edit = disk_failed
    with pytest.raises(ApplicationError) as failed:
        await ActivityEnvironment().run(activities.wipe_node, _wipe("n-00000"))
    assert failed.value.non_retryable and failed.value.type == "AgentActionFailed"
    assert "its disk_sanitize of /dev/nvme1n1 failed: NVMe status: Invalid Field" in failed.value.message
    assert [e.event for e in _events(db_url, "n-00000")] == ["gpu_reset", "disk_sanitize_failed", "scratch_removed"]


async def test_a_wipe_answer_whose_steps_cannot_be_read_fails_closed(wiping):
    activities, agents, db_url = wiping
    agents.edit = lambda body: body | {"cleaning": [{"step": "gpu_reset", "ok": "perhaps"}]}
    with pytest.raises(ApplicationError) as failed:
        await ActivityEnvironment().run(activities.wipe_node, _wipe("n-00000"))
    assert failed.value.non_retryable and "cleaning steps that cannot be read" in failed.value.message
    assert _events(db_url, "n-00000") == []
