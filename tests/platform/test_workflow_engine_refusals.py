"""A refusal of the workflow engine that no retry fixes is a 500 that names its cause and the fix.

The API runs against the real Temporal dev server, in a namespace nobody registered (then one
registered without the search attributes the workflows set): each create answers 500 with
Temporal's own message and `gpucloud prepare`, logged at ERROR with that message, with no
Retry-After and no word of retrying, and the CLI exits 1 (an error, not 5: waiting does not
help). Once `gpucloud prepare` has run, the same request is taken. An engine that does not
answer at all stays a 503 with Retry-After (`tests/platform/test_workflow_engine.py`)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import timedelta

import httpx
import pytest
from google.protobuf.duration_pb2 import Duration
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client
from typer.testing import CliRunner

from gpucloud.cli.common import ExitCode
from gpucloud.cli.main import app
from gpucloud.config import Settings
from gpucloud.devstack.stack import free_port
from gpucloud.prepare import prepare_temporal
from support.codec import CODEC_KEYS
from support.stack import ApiThread, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

OPERATOR = "test-operator-token"


async def _register_bare(address: str, namespace: str) -> None:
    """The namespace alone, without a search attribute."""
    client = await Client.connect(address)
    retention = Duration(seconds=int(timedelta(days=1).total_seconds()))
    await client.workflow_service.register_namespace(
        RegisterNamespaceRequest(namespace=namespace, workflow_execution_retention_period=retention)
    )


def _refused_for_good(answer: httpx.Response, cause: str) -> None:
    assert answer.status_code == 500, answer.text
    body = answer.json()
    assert body["title"] == "Workflow service misconfigured" and body["retryable"] is False
    assert cause in body["detail"] and "gpucloud prepare" in body["detail"], body["detail"]
    assert "retry" not in body["detail"].lower() and "retry-after" not in answer.headers


def test_a_namespace_never_prepared_is_named_not_retried(tmp_path, temporal_env, caplog) -> None:
    address = temporal_env.client.service_client.config.target_host
    namespace = f"never-prepared-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        data_dir=tmp_path,
        temporal={"address": address, "namespace": namespace, "task_queue": "tq-no-worker", "codec_keys": CODEC_KEYS},
        api={"port": free_port(), "operator_token": OPERATOR},
    )
    caplog.set_level(logging.ERROR, logger="gpucloud")
    api = ApiThread(settings)
    operator = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=30)
    try:
        missing = f"Namespace {namespace} is not found"
        _refused_for_good(operator.post("/v1/tenants", json={"name": "acme"}), missing)
        logged = [r for r in caplog.records if r.levelno == logging.ERROR and missing in r.getMessage()]
        assert logged and "gpucloud prepare" in logged[0].getMessage()
        assert operator.get("/v1/tenants").json()["items"] == []  # nothing of the refused create was kept

        env = {
            "GPUCLOUD_API__PORT": str(settings.api.port),
            "GPUCLOUD_API__OPERATOR_TOKEN": OPERATOR,
            "GPUCLOUD_DATA_DIR": str(tmp_path),
            "COLUMNS": "250",
        }
        shown = CliRunner().invoke(app, ["tenants", "create", "acme", "--no-wait"], env=env)
        assert shown.exit_code == ExitCode.ERROR, shown.output
        assert "Workflow service misconfigured" in shown.output and missing in " ".join(shown.output.split())

        asyncio.run(_register_bare(address, namespace))
        # Seconds pass before every part of the server knows the new namespace.
        unmapped = f"Namespace {namespace} has no mapping defined for search attribute TenantId"
        refused = wait_until(
            lambda: (
                (answer := operator.post("/v1/tenants", json={"name": "acme"})).status_code == 500
                and unmapped in answer.text
                and answer
            ),
            timeout_s=30,
            what="the create to be refused for the search attribute",
        )
        _refused_for_good(refused, unmapped)
        assert any(unmapped in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)

        # What the answer says to do is what fixes it.
        asyncio.run(prepare_temporal(settings))
        wait_until(
            lambda: operator.post("/v1/tenants", json={"name": "acme"}).status_code == 202,
            timeout_s=30,
            what="the create to be taken once the namespace is prepared",
        )
    finally:
        operator.close()
        api.stop()
