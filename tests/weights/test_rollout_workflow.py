"""The staged weight rollout (`gpucloud/workflows/rollout.py`) with stand-in activities: waves
in order (prefetch, verify, activate, bake, check of every node so far), the next wave's prefetch
run ahead, the canary's evaluations, a failed check or activation rolling back every node the
rollout tried to activate, a node dropped from the allocation left out, a target resolved from
an allocation, a refused set-up, and the pause, resume and abort updates.

(Named apart from tests/weights/test_rollout.py: the test folders are not packages, so two
test modules may not share a name.)"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError, WorkflowUpdateStage

from gpucloud.activities.rollout import RolloutActivities as R
from gpucloud.models.registry_tables import GateSpec
from gpucloud.models.rollout_messages import (
    NodeOutcome,
    Prepared,
    ReasonInput,
    ResolvedTargets,
    RolloutEvaluation,
    RolloutInput,
    RolloutPhase,
    RolloutTarget,
    WaveInput,
    WaveResult,
    WaveSpec,
)
from gpucloud.workflows.rollout import RolloutWorkflow
from support.workflow_runs import StandIns, eventually, final, queue_name, refused, workers

pytestmark = pytest.mark.workflow

VERSION = "b" * 64
NODES = [RolloutTarget(node_id=f"n{i}", agent_url=f"http://n{i}:9000") for i in range(1, 5)]
# Canary, then half, then all: [n1], [n2], [n3, n4].
WAVES = [WaveSpec(nodes=1), WaveSpec(fraction=0.5), WaveSpec(fraction=1.0)]
STEPS = [R.prefetch_wave, R.verify_wave, R.activate_wave, R.check_wave]


def _ok(req: WaveInput) -> WaveResult:
    return WaveResult(outcomes=[NodeOutcome(node_id=n.node_id, ok=True, active=req.model_version) for n in req.nodes])


def _failing_on(node_id: str, *, call: int = 1, detail: str = "unhealthy after bake"):
    """Every node ok, except `node_id` on the step's `call`-th call."""
    calls = 0

    def answer(req: WaveInput) -> WaveResult:
        nonlocal calls
        calls += 1
        result = _ok(req)
        if calls == call:
            result.outcomes = [
                o if o.node_id != node_id else NodeOutcome(node_id=node_id, ok=False, detail=detail)
                for o in result.outcomes
            ]
        return result

    return answer


def _answers(**overrides) -> dict:
    answers = {
        R.resolve_rollout_targets: ResolvedTargets(nodes=NODES),
        R.prepare_rollout: Prepared(swarm="swarm-1", chunks=3, total_bytes=3 << 20),
        **dict.fromkeys(STEPS, _ok),
        R.rollback_wave: _ok,
        R.end_rollout: None,
    }
    return {**answers, **{getattr(R, name): answer for name, answer in overrides.items()}}


def _input(**fields) -> RolloutInput:
    given = {"nodes": NODES, "waves": WAVES, "bake_s": 0, **fields}
    return RolloutInput(rollout_id=f"ro_{uuid.uuid4().hex[:8]}", tenant_id="ten_a", model_version=VERSION, **given)


def _nodes(stand_ins: StandIns, step) -> list[list[str]]:
    return [[n.node_id for n in req.nodes] for req in stand_ins.args(step)]


def _without_prefetch(stand_ins: StandIns) -> list[str]:
    # A prefetch runs ahead, beside the wave before it: its place among the other calls is not fixed.
    return [name for name in stand_ins.names if name != "prefetch_wave"]


async def _start(client, queue: str, inp: RolloutInput) -> WorkflowHandle:
    return await client.start_workflow(
        RolloutWorkflow.run,
        inp,
        id=f"rollout-{inp.rollout_id}",
        task_queue=queue,
        execution_timeout=timedelta(seconds=60),
    )


async def _roll_out(temporal_env, stand_ins: StandIns, inp: RolloutInput):
    client, queue = temporal_env.client, queue_name("rollout")
    async with workers(client, [RolloutWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start(client, queue, inp)
        return await handle.result(), await handle.query(RolloutWorkflow.progress)


async def test_waves_go_in_order_and_each_check_covers_every_node_so_far(temporal_env) -> None:
    stand_ins = StandIns(_answers())
    result, progress = await _roll_out(temporal_env, stand_ins, _input())
    assert _without_prefetch(stand_ins) == [
        "prepare_rollout",
        *["verify_wave", "activate_wave", "check_wave"] * 3,
        "end_rollout",
    ]
    for step in (R.prefetch_wave, R.verify_wave, R.activate_wave):
        assert _nodes(stand_ins, step) == [["n1"], ["n2"], ["n3", "n4"]]
    assert _nodes(stand_ins, R.check_wave) == [["n1"], ["n1", "n2"], ["n1", "n2", "n3", "n4"]]
    assert {req.swarm for req in stand_ins.args(R.verify_wave)} == {"swarm-1"}
    assert stand_ins.args(R.end_rollout) == ["swarm-1"]
    assert result.status == RolloutPhase.SUCCEEDED
    assert (result.activated, result.rolled_back) == (["n1", "n2", "n3", "n4"], [])
    assert progress.waves == [["n1"], ["n2"], ["n3", "n4"]] and progress.prefetched == ["n1", "n2", "n3", "n4"]


async def test_the_next_waves_prefetch_runs_while_this_wave_verifies(temporal_env) -> None:
    let_go = asyncio.Event()

    async def slow_verify(req: WaveInput) -> WaveResult:
        await let_go.wait()
        return _ok(req)

    stand_ins = StandIns(_answers(verify_wave=slow_verify))
    client, queue = temporal_env.client, queue_name("rollout")
    async with workers(client, [RolloutWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start(client, queue, _input())
        await stand_ins.started(R.verify_wave)
        await stand_ins.until(lambda: len(stand_ins.args(R.prefetch_wave)) == 2)
        assert _nodes(stand_ins, R.prefetch_wave) == [["n1"], ["n2"]]
        assert _nodes(stand_ins, R.verify_wave) == [["n1"]]
        let_go.set()
        assert (await handle.result()).status == RolloutPhase.SUCCEEDED
    assert len(stand_ins.args(R.prefetch_wave)) == 3, "a prefetch run ahead is not run again"


async def test_only_the_canarys_check_runs_the_models_evaluations(temporal_env) -> None:
    evaluation = RolloutEvaluation(gates=[GateSpec(metric="nan_inf_count", max=0)])
    stand_ins = StandIns(_answers())
    result, _ = await _roll_out(temporal_env, stand_ins, _input(evaluation=evaluation))
    assert [req.evaluation for req in stand_ins.args(R.check_wave)] == [evaluation, None, None]
    assert {req.evaluation for req in stand_ins.args(R.verify_wave)} == {None}
    assert result.status == RolloutPhase.SUCCEEDED


async def test_a_failed_canary_check_rolls_back_the_canary_and_goes_no_further(temporal_env) -> None:
    stand_ins = StandIns(_answers(check_wave=_failing_on("n1", detail="eval score 0.1 below 0.5")))
    result, progress = await _roll_out(temporal_env, stand_ins, _input())
    assert _without_prefetch(stand_ins) == [
        "prepare_rollout",
        "verify_wave",
        "activate_wave",
        "check_wave",
        "rollback_wave",
        "end_rollout",
    ]
    assert _nodes(stand_ins, R.rollback_wave) == [["n1"]]
    assert result.status == RolloutPhase.ROLLED_BACK
    assert result.reason == "wave 1 check failed on 1 node(s) (n1): eval score 0.1 below 0.5"
    assert result.rolled_back == ["n1"]
    assert progress.outcomes["n1"].ok, "the rollback's outcome is the node's last"


async def test_a_failed_check_in_a_later_wave_rolls_back_every_activated_node(temporal_env) -> None:
    stand_ins = StandIns(_answers(check_wave=_failing_on("n2", call=2)))
    result, _ = await _roll_out(temporal_env, stand_ins, _input())
    assert _nodes(stand_ins, R.check_wave) == [["n1"], ["n1", "n2"]]
    assert _nodes(stand_ins, R.rollback_wave) == [["n1", "n2"]]
    assert "verify_wave" not in _without_prefetch(stand_ins)[5:], "the third wave never starts"
    assert (result.status, result.activated, result.rolled_back) == (
        RolloutPhase.ROLLED_BACK,
        ["n1", "n2"],
        ["n1", "n2"],
    )


async def test_a_node_that_fails_to_activate_is_rolled_back_with_the_rest(temporal_env) -> None:
    stand_ins = StandIns(_answers(activate_wave=_failing_on("n4", call=3, detail="switch failed")))
    result, _ = await _roll_out(temporal_env, stand_ins, _input())
    assert _nodes(stand_ins, R.rollback_wave) == [["n1", "n2", "n3", "n4"]]
    assert _without_prefetch(stand_ins)[-3:] == ["activate_wave", "rollback_wave", "end_rollout"]
    assert result.status == RolloutPhase.ROLLED_BACK
    assert result.activated == ["n1", "n2", "n3"] and result.reason.startswith("wave 3 activate failed")


async def test_a_step_that_errors_rolls_back(temporal_env) -> None:
    stand_ins = StandIns(_answers(check_wave=final("the agent's weights API is gone")))
    result, _ = await _roll_out(temporal_env, stand_ins, _input(waves=[WaveSpec(fraction=1.0)]))
    assert _nodes(stand_ins, R.rollback_wave) == [["n1", "n2", "n3", "n4"]]
    assert result.status == RolloutPhase.ROLLED_BACK
    assert result.reason == "wave 1 check: check_wave failed: the agent's weights API is gone"


async def test_a_node_dropped_from_the_allocation_is_left_out_of_later_steps(temporal_env) -> None:
    def verify(req: WaveInput) -> WaveResult:
        result = _ok(req)
        if any(n.node_id == "n3" for n in req.nodes):
            result.outcomes = [o for o in result.outcomes if o.node_id != "n3"]
            result.dropped = {"n3": "no longer in allocation alloc_1"}
        return result

    stand_ins = StandIns(_answers(verify_wave=verify))
    result, progress = await _roll_out(temporal_env, stand_ins, _input())
    assert _nodes(stand_ins, R.activate_wave)[-1] == ["n4"]
    assert _nodes(stand_ins, R.check_wave)[-1] == ["n1", "n2", "n4"]
    assert progress.dropped == {"n3": "no longer in allocation alloc_1"}
    assert result.status == RolloutPhase.SUCCEEDED and result.activated == ["n1", "n2", "n4"]


async def test_an_allocations_nodes_are_resolved_before_the_rollout_is_prepared(temporal_env) -> None:
    stand_ins = StandIns(_answers())
    result, _ = await _roll_out(temporal_env, stand_ins, _input(nodes=None, allocation_id="alloc_1"))
    assert _without_prefetch(stand_ins)[:2] == ["resolve_rollout_targets", "prepare_rollout"]
    [resolve] = stand_ins.args(R.resolve_rollout_targets)
    assert (resolve.tenant_id, resolve.allocation_id) == ("ten_a", "alloc_1")
    assert [n.node_id for n in stand_ins.args(R.prepare_rollout)[0].nodes] == ["n1", "n2", "n3", "n4"]
    assert result.status == RolloutPhase.SUCCEEDED


async def test_a_refused_set_up_fails_the_rollout_before_any_node_is_touched(temporal_env) -> None:
    stand_ins = StandIns(_answers(prepare_rollout=refused("no such version", "VersionNotFound")))
    result, _ = await _roll_out(temporal_env, stand_ins, _input())
    assert stand_ins.names == ["prepare_rollout"], "nothing to roll back, no swarm to end"
    assert result.status == RolloutPhase.FAILED
    assert result.reason == "prepare_rollout failed: no such version"


async def test_pause_holds_the_rollout_at_the_next_wave_and_resume_lets_it_go_on(temporal_env) -> None:
    let_go = asyncio.Event()

    async def held_check(req: WaveInput) -> WaveResult:
        await let_go.wait()
        return _ok(req)

    stand_ins = StandIns(_answers(check_wave=held_check))
    client, queue = temporal_env.client, queue_name("rollout")
    async with workers(client, [RolloutWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start(client, queue, _input(prefetch_ahead=False))
        await stand_ins.started(R.check_wave)
        paused = await handle.execute_update(RolloutWorkflow.pause, ReasonInput(reason="look at the canary"))
        assert paused.paused and paused.phase == RolloutPhase.CHECKING, "the wave under way finishes"
        let_go.set()

        async def held() -> bool:
            return (await handle.query(RolloutWorkflow.progress)).phase == RolloutPhase.PAUSED

        await eventually(held, what="the rollout to hold at the next wave")
        await asyncio.sleep(0.3)
        assert _nodes(stand_ins, R.prefetch_wave) == [["n1"]], "the next wave waits for resume"
        resumed = await handle.execute_update(RolloutWorkflow.resume, ReasonInput())
        assert not resumed.paused
        result = await handle.result()
    assert result.status == RolloutPhase.SUCCEEDED
    assert _nodes(stand_ins, R.prefetch_wave) == [["n1"], ["n2"], ["n3", "n4"]]


async def test_abort_stops_the_step_under_way_and_rolls_back_what_was_activated(temporal_env) -> None:
    never = asyncio.Event()

    async def stuck_activate(req: WaveInput) -> WaveResult:
        if req.nodes[0].node_id == "n1":
            return _ok(req)
        await never.wait()
        return _ok(req)

    stand_ins = StandIns(_answers(activate_wave=stuck_activate))
    client, queue = temporal_env.client, queue_name("rollout")
    async with workers(client, [RolloutWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start(client, queue, _input())
        await stand_ins.until(lambda: len(stand_ins.args(R.activate_wave)) == 2)
        final = await handle.execute_update(RolloutWorkflow.abort, ReasonInput(reason="bad eval numbers"))
        result = await handle.result()
        never.set()
    assert final.phase == RolloutPhase.ROLLED_BACK and final.reason == "aborted: bad eval numbers"
    # The wave whose activation was cut short is rolled back too: some of its nodes may have switched.
    assert _nodes(stand_ins, R.rollback_wave) == [["n1", "n2"]]
    assert _without_prefetch(stand_ins)[-2:] == ["rollback_wave", "end_rollout"]
    assert (result.status, result.rolled_back) == (RolloutPhase.ROLLED_BACK, ["n1", "n2"])


async def test_pause_and_resume_are_refused_once_an_abort_is_under_way(temporal_env) -> None:
    let_go = asyncio.Event()

    async def held(req: WaveInput) -> WaveResult:
        await let_go.wait()
        return _ok(req)

    stand_ins = StandIns(_answers(check_wave=held, rollback_wave=held))
    client, queue = temporal_env.client, queue_name("rollout")
    async with workers(client, [RolloutWorkflow], {queue: stand_ins.for_worker()}):
        handle = await _start(client, queue, _input())
        await stand_ins.started(R.check_wave)
        abort = await handle.start_update(
            RolloutWorkflow.abort, ReasonInput(reason="stop"), wait_for_stage=WorkflowUpdateStage.ACCEPTED
        )
        await stand_ins.started(R.rollback_wave)
        for update in (RolloutWorkflow.pause, RolloutWorkflow.resume):
            with pytest.raises(WorkflowUpdateFailedError) as refused_update:
                await handle.execute_update(update, ReasonInput())
            assert "the rollout is being aborted" in str(refused_update.value.cause)
        let_go.set()
        final_progress = await abort.result()
        await handle.result()
    assert final_progress.phase == RolloutPhase.ROLLED_BACK and not final_progress.paused
    assert _nodes(stand_ins, R.rollback_wave) == [["n1"]]
