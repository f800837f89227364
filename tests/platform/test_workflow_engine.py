"""How the API answers a refusal of the workflow engine (`services/workflow_engine.py`): an engine
that is down, slow or shedding load is a 503 with Retry-After (waited out); any other refusal is a
500 naming Temporal's message and the fix, logged at ERROR, never a word of retrying. The live
refusals of a real server are in `tests/platform/test_workflow_engine_refusals.py`."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from temporalio.service import RPCError, RPCStatusCode

from gpucloud.api.app import create_app
from gpucloud.api.errors import problem_for
from gpucloud.config import Settings
from gpucloud.services.workflow_engine import engine_error, log_undelivered

pytestmark = pytest.mark.unit

WAITED_OUT = [
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.ABORTED,
]
FOR_GOOD = [
    (RPCStatusCode.INVALID_ARGUMENT, "Namespace gpucloud has no mapping defined for search attribute TenantId"),
    (RPCStatusCode.NOT_FOUND, "Namespace gpucloud is not found."),
    (RPCStatusCode.FAILED_PRECONDITION, "Namespace gpucloud is not active"),
    (RPCStatusCode.PERMISSION_DENIED, "Request unauthorized."),
]


@pytest.mark.parametrize("status", WAITED_OUT)
def test_an_engine_that_does_not_answer_is_waited_out(status: RPCStatusCode, caplog) -> None:
    problem = problem_for(
        engine_error(RPCError("tcp connect error", status, b""), what="the onboarding", left="nothing was kept")
    )
    assert (problem.status, problem.headers["Retry-After"]) == (503, "1")
    assert problem.detail == "the workflow engine did not take the onboarding; nothing was kept; retry"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(("status", "message"), FOR_GOOD)
def test_a_refusal_no_retry_fixes_names_its_cause_and_is_logged(status: RPCStatusCode, message: str, caplog) -> None:
    problem = problem_for(engine_error(RPCError(message, status, b""), what="the onboarding", left="nothing was kept"))
    assert (problem.status, problem.title, problem.extra["retryable"]) == (500, "Workflow service misconfigured", False)
    assert f"{message.rstrip('.')} ({status.name})" in problem.detail and "nothing was kept" in problem.detail
    assert "Retry-After" not in problem.headers and "retry" not in problem.detail.lower()
    fix = "gpucloud prepare" if status != RPCStatusCode.PERMISSION_DENIED else "credentials"
    assert fix in problem.detail
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert message.rstrip(".") in record.getMessage() and fix in record.getMessage()


def test_a_refusal_no_route_catches_is_still_named(tmp_path) -> None:
    """A route that lets the engine's refusal through (a rollout's query) answers it the same way,
    not as an unexpected error."""

    def refusing(status: RPCStatusCode, message: str):
        async def query(*args, **kwargs):
            raise RPCError(message, status, b"")

        return SimpleNamespace(get_workflow_handle=lambda workflow_id: SimpleNamespace(query=query))

    settings = Settings(data_dir=tmp_path, api={"operator_token": "op"})
    app = create_app(settings, temporal=refusing(RPCStatusCode.PERMISSION_DENIED, "Request unauthorized."))  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        headers = {"Authorization": "Bearer op"}
        refused = client.get("/v1/rollouts/rollout-1", headers=headers)
        assert refused.status_code == 500 and "Request unauthorized (PERMISSION_DENIED)" in refused.json()["detail"]
        assert "retry-after" not in refused.headers
        app.state.temporal = refusing(RPCStatusCode.UNAVAILABLE, "tcp connect error")
        down = client.get("/v1/rollouts/rollout-1", headers=headers)
        assert down.status_code == 503 and down.headers["retry-after"] == "1"


def test_a_signal_the_request_does_without_is_a_warning_or_an_error_naming_the_fix(caplog) -> None:
    log = logging.getLogger("gpucloud.test")
    caplog.set_level(logging.WARNING, logger="gpucloud.test")
    down = RPCError("tcp connect error", RPCStatusCode.UNAVAILABLE, b"")
    log_undelivered(log, down, "cancel signal for a1", "the workflow will see the DB intent")
    unprepared = RPCError("Namespace gpucloud is not found.", RPCStatusCode.NOT_FOUND, b"")
    log_undelivered(log, unprepared, "cancel signal for a1", "the workflow will see the DB intent")
    warned, refused = caplog.records
    assert warned.levelno == logging.WARNING and "not delivered (tcp connect error)" in warned.getMessage()
    assert refused.levelno == logging.ERROR
    assert "Namespace gpucloud is not found (NOT_FOUND)" in refused.getMessage()
    assert "gpucloud prepare" in refused.getMessage()


def test_an_update_no_worker_polls_for_is_waited_out_like_the_engine(caplog) -> None:
    """A rollout's abort while the workers are down or restarting: the engine answers
    FAILED_PRECONDITION "no poller seen", an outage of the workers, not the deployment's setup."""
    refusal = RPCError(
        "no poller seen for task queue recently, worker may be down", RPCStatusCode.FAILED_PRECONDITION, b""
    )
    problem = problem_for(engine_error(refusal, what="the abort", left="the rollout is as it was"))
    assert (problem.status, problem.headers["Retry-After"]) == (503, "1")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
