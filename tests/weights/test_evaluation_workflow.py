"""The platform evaluation of a version (`gpucloud/workflows/evaluation.py`) with stand-in
activities: keys and token from the control plane, the run on the evaluation worker's own task
queue, the finding signed and kept; a token the API refused minted again once, never twice;
every other refusal and an evaluator's own failure kept as they are."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError

from gpucloud.activities.evaluation import EvaluationActivities as E
from gpucloud.activities.evaluation_runner import EvaluationRunner
from gpucloud.config import evaluation_task_queue
from gpucloud.models.evaluation_messages import (
    EvaluateVersionInput,
    EvaluateVersionResult,
    EvaluationKeys,
    EvaluationRefusal,
    EvaluationRun,
    RecordEvaluationInput,
    RegistryAccess,
    RunEvaluationInput,
)
from gpucloud.models.workflow_ids import evaluation_workflow_id
from gpucloud.workflows.evaluation import VersionEvaluationWorkflow
from support.workflow_runs import StandIns, queue_name, refused, workers

pytestmark = pytest.mark.workflow

REQUEST = EvaluateVersionInput(
    tenant_id="ten_a", model="llama", version="a" * 64, parent="b" * 64, evaluator="sanity", operation_id="op_9"
)


class Plane:
    """The control plane's stand-ins (keys, record) and the evaluation worker's (run), with the
    runs' findings given in turn (the last repeated)."""

    def __init__(self, *runs: EvaluationRun) -> None:
        self.runs, self.queues = list(runs), []
        self.tokens, self.queue = 0, ""
        self.stand_ins = StandIns(
            {E.evaluation_keys: self.keys, EvaluationRunner.run_evaluation: self.run, E.record_evaluation: self.record}
        )

    def keys(self, req: EvaluateVersionInput) -> EvaluationKeys:
        self.tokens += 1
        return EvaluationKeys(
            public_keys=["ed25519-hex"], access=RegistryAccess(api_url="https://api", token=f"t{self.tokens}")
        )

    def run(self, inp: RunEvaluationInput) -> EvaluationRun:
        self.queues.append(activity.info().task_queue)
        return self.runs.pop(0) if len(self.runs) > 1 else self.runs[0]

    def record(self, inp: RecordEvaluationInput) -> EvaluateVersionResult:
        # As the real one: a refusal settles the operation and ends the evaluation there.
        if inp.run.refusal is not None:
            raise ApplicationError(inp.run.failure or "", type=inp.run.refusal.value, non_retryable=True)
        return EvaluateVersionResult(
            evaluator=inp.request.evaluator,
            results=inp.run.results,
            failure=inp.run.failure,
            record_digest="d" * 64,
            compared_with=inp.run.compared_with,
        )

    async def evaluate(self, client) -> EvaluateVersionResult:
        queue = queue_name("control")
        control = self.stand_ins.for_worker([E.evaluation_keys, E.record_evaluation])
        evaluations = self.stand_ins.for_worker([EvaluationRunner.run_evaluation])
        async with workers(
            client, [VersionEvaluationWorkflow], {queue: control, evaluation_task_queue(queue): evaluations}
        ):
            self.queue = queue
            return await client.execute_workflow(
                VersionEvaluationWorkflow.run,
                REQUEST,
                id=evaluation_workflow_id(REQUEST.tenant_id, f"{REQUEST.operation_id}-{uuid.uuid4().hex[:6]}"),
                task_queue=queue,
                execution_timeout=timedelta(seconds=60),
            )

    @property
    def tokens_run_with(self) -> list[str]:
        return [inp.keys.access.token for inp in self.stand_ins.args(EvaluationRunner.run_evaluation)]


REFUSED = EvaluationRun(failure="the registry refused the token", refusal=EvaluationRefusal.ACCESS_REFUSED)


async def test_an_evaluation_runs_on_the_evaluation_worker_and_is_signed_by_the_control_plane(temporal_env) -> None:
    found = EvaluationRun(results={"nan_inf_count": 0.0}, compared_with="b" * 64)
    plane = Plane(found)
    result = await plane.evaluate(temporal_env.client)
    assert plane.stand_ins.names == ["evaluation_keys", "run_evaluation", "record_evaluation"]
    assert plane.queues == [evaluation_task_queue(plane.queue)], "the run holds no platform secret: its own worker"
    [ran] = plane.stand_ins.args(EvaluationRunner.run_evaluation)
    assert (ran.request, ran.keys.public_keys, ran.keys.access.token) == (REQUEST, ["ed25519-hex"], "t1")
    [recorded] = plane.stand_ins.args(E.record_evaluation)
    assert (recorded.request, recorded.run) == (REQUEST, found)
    assert result == EvaluateVersionResult(
        evaluator="sanity", results={"nan_inf_count": 0.0}, record_digest="d" * 64, compared_with="b" * 64
    )


async def test_a_refused_token_is_minted_again_once(temporal_env) -> None:
    plane = Plane(REFUSED, EvaluationRun(results={"nan_inf_count": 0.0}))
    result = await plane.evaluate(temporal_env.client)
    assert plane.stand_ins.names == [
        "evaluation_keys",
        "run_evaluation",
        "evaluation_keys",
        "run_evaluation",
        "record_evaluation",
    ]
    assert plane.tokens_run_with == ["t1", "t2"]
    assert result.results == {"nan_inf_count": 0.0} and result.failure is None


async def test_a_second_refusal_stands_and_ends_the_evaluation(temporal_env) -> None:
    plane = Plane(REFUSED)
    with pytest.raises(WorkflowFailureError) as failed:
        await plane.evaluate(temporal_env.client)
    assert plane.tokens_run_with == ["t1", "t2"]
    assert [inp.run.refusal for inp in plane.stand_ins.args(E.record_evaluation)] == [EvaluationRefusal.ACCESS_REFUSED]
    cause = failed.value.cause
    assert isinstance(cause, ActivityError) and isinstance(cause.cause, ApplicationError)
    assert cause.cause.type == "EvaluationAccessRefused"


async def test_any_other_refusal_is_not_run_again(temporal_env) -> None:
    plane = Plane(EvaluationRun(failure="signature does not verify", refusal=EvaluationRefusal.VERSION_UNVERIFIABLE))
    with pytest.raises(WorkflowFailureError):
        await plane.evaluate(temporal_env.client)
    assert plane.stand_ins.names == ["evaluation_keys", "run_evaluation", "record_evaluation"]


async def test_an_evaluators_own_failure_is_a_finding_kept_like_any_other(temporal_env) -> None:
    plane = Plane(EvaluationRun(failure="the command exited 1"))
    result = await plane.evaluate(temporal_env.client)
    assert plane.stand_ins.names == ["evaluation_keys", "run_evaluation", "record_evaluation"]
    assert (result.failure, result.record_digest) == ("the command exited 1", "d" * 64)


async def test_a_version_gone_before_the_run_ends_the_evaluation_there(temporal_env) -> None:
    plane = Plane(EvaluationRun())
    plane.stand_ins.answers[E.evaluation_keys] = refused("no version aaaa of llama", "VersionNotFound")
    with pytest.raises(WorkflowFailureError):
        await plane.evaluate(temporal_env.client)
    assert plane.stand_ins.names == ["evaluation_keys"], "refused for good: not retried, nothing run"
