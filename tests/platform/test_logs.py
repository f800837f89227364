"""Log lines as JSON (or text) carrying the ids of what they are about: from the call, from the
request's context (into threads too), and from the Temporal activity they run in."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
from temporalio import activity
from temporalio.testing import ActivityEnvironment

from gpucloud.observability import logs

pytestmark = pytest.mark.unit

log = logging.getLogger("gpucloud.test")


@pytest.fixture(autouse=True)
def restore_logging():
    """`logs.configure` replaces the root logger's handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def lines(captured: str) -> list[dict]:
    return [json.loads(line) for line in captured.splitlines() if line.startswith("{")]


def test_json_lines_carry_the_ids_of_the_call_and_of_the_context_into_threads(capsys) -> None:
    logs.configure(level="INFO", fmt="json")
    with logs.log_context(tenant_id="ten_acme", node_id=None):
        log.info("allocating %d nodes", 4, extra={"allocation_id": "alloc_1"})

        async def in_a_thread() -> None:
            await asyncio.to_thread(log.warning, "from a worker thread")

        asyncio.run(in_a_thread())
    log.info("outside")
    first, threaded, outside = lines(capsys.readouterr().err)
    assert first["message"] == "allocating 4 nodes" and first["level"] == "info"
    assert (first["tenant_id"], first["allocation_id"]) == ("ten_acme", "alloc_1") and "node_id" not in first
    assert threaded["tenant_id"] == "ten_acme" and threaded["level"] == "warning"
    assert "tenant_id" not in outside and outside["time"].endswith("Z")


def test_an_activity_logs_with_the_ids_its_workflow_names(capsys) -> None:
    logs.configure(level="INFO", fmt="json")

    @activity.defn
    async def drain() -> None:
        log.info("draining")

    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id="node-h100-0042", activity_type="drain")
    asyncio.run(env.run(drain))
    [line] = lines(capsys.readouterr().err)
    assert (line["node_id"], line["workflow_id"], line["activity"]) == ("h100-0042", "node-h100-0042", "drain")


def test_text_lines_name_the_ids_and_errors_keep_their_traceback(capsys) -> None:
    logs.configure(level="INFO", fmt="text")
    with logs.log_context(allocation_id="alloc_9"):
        log.info("ready")
    assert capsys.readouterr().err.rstrip().endswith("gpucloud.test: ready [allocation_id=alloc_9]")
    logs.configure(level="INFO", fmt="json")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    [line] = lines(capsys.readouterr().err)
    assert "ValueError: boom" in line["error"]


def test_a_command_logs_json_when_told(tmp_path) -> None:
    env = {**os.environ, "GPUCLOUD_DATA_DIR": str(tmp_path), "GPUCLOUD_TELEMETRY__LOG_FORMAT": "json"}
    done = subprocess.run(
        [sys.executable, "-m", "gpucloud.cli.main", "migrate", "--output", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    logged = lines(done.stderr)
    assert logged and all(line["level"] in ("info", "warning") for line in logged)
    assert any("Running upgrade" in line["message"] for line in logged)


CORE_LOGS = """
import asyncio, sys, time
from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker
from gpucloud.adapters.temporal import default_runtime
from gpucloud.observability import logs

@activity.defn
async def nothing() -> None: ...

async def main():
    logs.configure(fmt="json")
    client = await Client.connect(sys.argv[1], namespace="no-such-namespace", runtime=default_runtime())
    try:
        await asyncio.wait_for(Worker(client, task_queue="q", activities=[nothing]).run(), 10)
    except BaseException:
        pass

asyncio.run(main())
time.sleep(3)  # the core forwards its lines in batches
"""


def test_the_temporal_cores_own_lines_join_the_json_stream(bare_temporal: str) -> None:
    """The SDK's core (Rust) would print its warnings as coloured text to stderr; the runtime
    every gpucloud client uses forwards them through Python's logging, so they are JSON too."""
    done = subprocess.run([sys.executable, "-c", CORE_LOGS, bare_temporal], capture_output=True, text=True, timeout=60)
    assert "\x1b[" not in done.stderr, done.stderr[-2000:]
    assert all(line.startswith("{") for line in done.stderr.splitlines() if line.strip()), done.stderr[-2000:]
    logged = lines(done.stderr)
    core = [line for line in logged if line["logger"].startswith("temporalio.core")]
    assert core and "no-such-namespace" in core[0]["message"], done.stderr[-2000:]
