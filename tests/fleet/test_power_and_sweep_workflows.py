"""`NodePowerWorkflow` (an operator's power action) and `ReconcileSweepWorkflow` (the
reconciler's sweep) with their one activity stood in for: each hands its input to its activity
unchanged and returns the activity's answer; a failing BMC call is retried within the BMC's
attempts and a sweep that keeps failing fails the run, not the schedule's next one."""

from __future__ import annotations

import uuid

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from gpucloud.activities.bmc import BmcActivities
from gpucloud.activities.reconciler import ReconcilerActivities
from gpucloud.activities.scheduling import SchedulerActivities
from gpucloud.models.messages import BmcPowerInput, BmcPowerResult, SweepInput, SweepResult
from gpucloud.workflows.power import NodePowerWorkflow
from gpucloud.workflows.reconciler import ReconcileSweepWorkflow
from support.workflow_runs import StandIns, final, in_turn, queue_name, workers
from support.workflow_tier import RUN_TIMEOUT

pytestmark = pytest.mark.workflow


async def _run(client, workflow: type, stand_ins: StandIns, arg):
    queue = queue_name("fleet")
    async with workers(client, [workflow], {queue: stand_ins.for_worker()}):
        return await client.execute_workflow(
            workflow.run, arg, id=f"{queue}-{uuid.uuid4().hex[:6]}", task_queue=queue, execution_timeout=RUN_TIMEOUT
        )


async def test_a_power_action_is_one_bmc_call_whose_answer_is_the_result(temporal_env) -> None:
    req = BmcPowerInput(node_id="n1", action="cycle", cause="operator", actor="operator:alice", operation_id="op-1")
    answer = BmcPowerResult(node_id="n1", done=True, power_state="on", answer="cycled")
    stand_ins = StandIns({BmcActivities.bmc_power: answer})

    result = await _run(temporal_env.client, NodePowerWorkflow, stand_ins, req)

    assert result == answer
    assert stand_ins.args(BmcActivities.bmc_power) == [req]


async def test_a_bmc_that_fails_once_is_called_again(temporal_env) -> None:
    answer = BmcPowerResult(node_id="n2", done=True, power_state="off")
    stand_ins = StandIns(
        {BmcActivities.bmc_power: in_turn(ApplicationError("BMC busy", type="BmcUnreachable"), answer)}
    )

    result = await _run(temporal_env.client, NodePowerWorkflow, stand_ins, BmcPowerInput(node_id="n2", action="off"))

    assert result == answer
    assert stand_ins.names == ["bmc_power", "bmc_power"]


async def test_a_bmc_call_that_cannot_succeed_fails_the_action(temporal_env) -> None:
    stand_ins = StandIns({BmcActivities.bmc_power: final("node has no such power action")})

    with pytest.raises(WorkflowFailureError):
        await _run(temporal_env.client, NodePowerWorkflow, stand_ins, BmcPowerInput(node_id="n3", action="on"))
    assert stand_ins.names == ["bmc_power"]


@pytest.mark.parametrize("node_ids", [None, ["n1", "n2"]])
async def test_a_sweep_hands_its_nodes_to_the_sweep_and_returns_its_counts(temporal_env, node_ids) -> None:
    counts = SweepResult(candidates=5, started=2, marked_unreachable=1, bringup_batches=1)
    stand_ins = StandIns({ReconcilerActivities.sweep: counts, SchedulerActivities.ensure_pool_schedulers: 2})

    result = await _run(temporal_env.client, ReconcileSweepWorkflow, stand_ins, SweepInput(node_ids=node_ids))

    assert result == counts
    assert [arg.node_ids for arg in stand_ins.args(ReconcilerActivities.sweep)] == [node_ids]
    # The periodic sweep (no nodes named) also makes sure every pool with a queue is scheduled.
    expected = ["ensure_pool_schedulers", "sweep"] if node_ids is None else ["sweep"]
    assert stand_ins.names == expected


async def test_a_sweep_that_keeps_failing_fails_its_run_after_its_attempts(temporal_env) -> None:
    stand_ins = StandIns(
        {
            ReconcilerActivities.sweep: ApplicationError("database down", type="OperationalError"),
            SchedulerActivities.ensure_pool_schedulers: 0,
        }
    )

    with pytest.raises(WorkflowFailureError):
        await _run(temporal_env.client, ReconcileSweepWorkflow, stand_ins, SweepInput())
    # options.SWEEP: three attempts, then the next run
    assert stand_ins.names == ["ensure_pool_schedulers", "sweep", "sweep", "sweep"]
