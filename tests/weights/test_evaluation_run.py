"""The evaluation workflow on the real Temporal server, its activities stood in for: a run whose
token expired while the API was away is given a fresh token once; a second refusal stands."""

from __future__ import annotations

import uuid

import pytest
from temporalio import activity
from temporalio.worker import Worker

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
from gpucloud.workflows.evaluation import VersionEvaluationWorkflow

pytestmark = pytest.mark.integration


class StandIns:
    def __init__(self, refusals: int) -> None:
        self.refusals, self.tokens, self.ran_with, self.recorded = refusals, 0, [], []

    @activity.defn(name="evaluation_keys")
    async def evaluation_keys(self, req: EvaluateVersionInput) -> EvaluationKeys:
        self.tokens += 1
        return EvaluationKeys(public_keys=[], access=RegistryAccess(api_url="https://api", token=f"t{self.tokens}"))

    @activity.defn(name="run_evaluation")
    async def run_evaluation(self, inp: RunEvaluationInput) -> EvaluationRun:
        self.ran_with.append(inp.keys.access.token)
        if len(self.ran_with) <= self.refusals:
            return EvaluationRun(failure="the registry refused the token", refusal=EvaluationRefusal.ACCESS_REFUSED)
        return EvaluationRun(results={"nan_inf_count": 0.0})

    @activity.defn(name="record_evaluation")
    async def record_evaluation(self, inp: RecordEvaluationInput) -> EvaluateVersionResult:
        self.recorded.append(inp.run)
        return EvaluateVersionResult(
            evaluator=inp.request.evaluator, results=inp.run.results, failure=inp.run.failure, record_digest="d" * 64
        )


async def _evaluate(temporal_env, stand_ins: StandIns) -> EvaluateVersionResult:
    queue = f"eval-{uuid.uuid4().hex[:8]}"
    client = temporal_env.client
    request = EvaluateVersionInput(tenant_id="ten_a", model="m", version="a" * 64, evaluator="sanity")
    control = Worker(
        client,
        task_queue=queue,
        workflows=[VersionEvaluationWorkflow],
        activities=[stand_ins.evaluation_keys, stand_ins.record_evaluation],
    )
    evaluations = Worker(client, task_queue=evaluation_task_queue(queue), activities=[stand_ins.run_evaluation])
    async with control, evaluations:
        return await client.execute_workflow(
            VersionEvaluationWorkflow.run, request, id=f"evaluate-{uuid.uuid4().hex}", task_queue=queue
        )


async def test_an_expired_token_is_minted_again_once(temporal_env) -> None:
    stand_ins = StandIns(refusals=1)
    result = await _evaluate(temporal_env, stand_ins)
    assert stand_ins.ran_with == ["t1", "t2"]
    assert result.results == {"nan_inf_count": 0.0} and result.failure is None


async def test_a_second_refusal_stands(temporal_env) -> None:
    stand_ins = StandIns(refusals=5)
    result = await _evaluate(temporal_env, stand_ins)
    assert stand_ins.ran_with == ["t1", "t2"]
    assert [run.refusal for run in stand_ins.recorded] == [EvaluationRefusal.ACCESS_REFUSED]
    assert result.failure == "the registry refused the token"
