"""Reading a rollout's progress (`services/rollout_requests.visible`) when its workflow cannot
answer: a query that failed this time (a workflow task being retried) is a 503 to send again,
never a 500; one that does not exist is a 404."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from gpucloud.services import rollout_requests as requests
from gpucloud.services.errors import NotFound, Unavailable

pytestmark = pytest.mark.unit


class _Engine:
    """A Temporal client whose rollout workflow answers a query with `failure`."""

    def __init__(self, failure: Exception) -> None:
        self.failure = failure
        self.asked: list[str] = []

    def get_workflow_handle(self, workflow_id: str):
        engine = self

        class _Handle:
            async def query(self, *_args, **_kwargs):
                engine.asked.append(workflow_id)
                raise engine.failure

        return _Handle()


async def test_a_progress_query_the_workflow_failed_this_time_is_unavailable_with_retry_after() -> None:
    engine = _Engine(WorkflowQueryFailedError("[TMPRL1101] Potential deadlock detected"))
    with pytest.raises(Unavailable) as refused:
        await requests.visible(engine, "rollout-abc", tenant_id="ten_a", operator=False)  # type: ignore[arg-type]
    assert engine.asked == ["rollout-abc"]
    assert refused.value.retry_after_s == 1
    assert "did not answer" in str(refused.value) and "retry" in str(refused.value)


async def test_a_rollout_the_engine_does_not_know_is_not_found() -> None:
    engine = _Engine(RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b""))
    with pytest.raises(NotFound):
        await requests.visible(engine, "rollout-gone", tenant_id="ten_a", operator=False)  # type: ignore[arg-type]
