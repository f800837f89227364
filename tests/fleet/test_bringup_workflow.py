"""`BringupBatchWorkflow` with its activities stood in for: a batch takes every node through the
bring-up steps one round at a time (one CAS batch and one agent batch per step), and a node that
fails, falls silent or moves under the batch leaves it without holding up the others."""

from __future__ import annotations

import pytest

from gpucloud.models.messages import BringupInput, BringupResult
from gpucloud.models.node_states import NodeState
from gpucloud.models.workflow_ids import bringup_workflow_id
from gpucloud.workflows.bringup import BringupBatchWorkflow
from support.workflow_mocks import StandIns

pytestmark = pytest.mark.workflow

S = NodeState
BROUGHT_UP = [
    "transition_nodes:inspect",
    "agent_batch:inspect",
    "transition_nodes:ok",
    "agent_batch:wipe",
    "transition_nodes:ok",
    "agent_batch:burn_in",
    "transition_nodes:ok",
]


async def _bring_up(workflows, node_ids: list[str]) -> BringupResult:
    return await workflows.execute(
        BringupBatchWorkflow.run, BringupInput(node_ids=node_ids), id=bringup_workflow_id(node_ids, "hold-1")
    )


async def test_a_batch_brings_every_node_up_one_step_per_round(workflows, stand_ins: StandIns, uid) -> None:
    nodes = [f"n{i}-{uid}" for i in range(3)]
    for node in nodes:
        stand_ins.add_node(node, S.ENROLLED)
    stand_ins.waiting_started = 2
    result = await _bring_up(workflows, nodes)
    assert (result.available, result.stopped, result.handed_on) == (nodes, {}, 2)
    assert stand_ins.steps() == [f"get_nodes:{','.join(nodes)}", "start_waiting_bringups"]
    for node in nodes:
        assert stand_ins.steps(node) == BROUGHT_UP
        assert stand_ins.nodes[node].state == S.AVAILABLE
    # The agents deduplicate by request id: one per node and round.
    ids = [r.request_id for r in stand_ins.calls_of("agent_batch:") if r is not None]
    assert len(ids) == len(set(ids)) == 9


async def test_a_node_that_fails_or_falls_silent_leaves_the_batch_alone(workflows, stand_ins: StandIns, uid) -> None:
    ok, bmc_ok, bmc_down, bad_disk, silent, ghost = (
        f"{name}-{uid}" for name in ("ok", "bmcok", "bmcdown", "baddisk", "silent", "ghost")
    )
    stand_ins.add_node(ok, S.ENROLLED)
    stand_ins.add_node(bmc_ok, S.ENROLLED, has_bmc=True)
    stand_ins.add_node(bmc_down, S.ENROLLED, has_bmc=True)
    stand_ins.add_node(bad_disk, S.ENROLLED)
    stand_ins.add_node(silent, S.ENROLLED)
    stand_ins.fail("bmc_power", bmc_down, message="BMC unreachable")
    stand_ins.fail("agent_batch:wipe", bad_disk, message="secure erase failed")
    stand_ins.unreachable.add(silent)

    result = await _bring_up(workflows, [ok, bmc_ok, bmc_down, bad_disk, silent, ghost])
    assert sorted(result.available) == sorted([ok, bmc_ok])
    assert result.stopped == {
        ghost: "node does not exist",
        bmc_down: "power on through the BMC failed: BMC unreachable -> quarantined",
        bad_disk: "wipe failed: secure erase failed -> quarantined",
        silent: f"agent of {silent} did not answer",
    }
    # Out of band first; a node whose BMC failed fails its inspection without an agent call.
    assert stand_ins.steps(bmc_ok) == ["bmc_discover", "bmc_power:on", *BROUGHT_UP]
    assert stand_ins.steps(bmc_down) == [
        "bmc_discover",
        "bmc_power:on",
        "transition_nodes:inspect",
        "transition_nodes:fail",
    ]
    assert stand_ins.steps(bad_disk) == [*BROUGHT_UP[:3], "agent_batch:wipe", "transition_nodes:fail"]
    assert (stand_ins.nodes[bmc_down].state, stand_ins.nodes[bad_disk].state) == (S.QUARANTINED, S.QUARANTINED)
    # Only the silent node is handed back to the reconciler (with its backoff); mid-way, untouched.
    assert stand_ins.steps(silent) == ["transition_nodes:inspect", "agent_batch:inspect unreachable"]
    assert f"release_bringup_holds:{silent}" in stand_ins.steps()
    assert stand_ins.nodes[silent].state == S.INSPECTING


async def test_a_node_moved_under_the_batch_is_dropped_and_a_failed_hand_on_is_left_to_the_sweep(
    workflows, stand_ins: StandIns, uid
) -> None:
    mine, moved = f"mine-{uid}", f"moved-{uid}"
    stand_ins.add_node(mine, S.ENROLLED)
    stand_ins.add_node(moved, S.ENROLLED)
    stand_ins.fail("transition_nodes", moved, message="node is quarantined, not enrolled")
    stand_ins.fail("start_waiting_bringups", message="database locked")
    result = await _bring_up(workflows, [mine, moved])
    assert result.available == [mine]
    assert result.stopped == {moved: "node moved under us: node is quarantined, not enrolled"}
    assert result.handed_on == 0
    assert stand_ins.steps(moved) == ["transition_nodes:inspect"]
    assert "release_bringup_holds" not in " ".join(stand_ins.steps())
