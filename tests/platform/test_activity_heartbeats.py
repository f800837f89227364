"""A worker that dies under an activity is noticed within the activity's heartbeat timeout, not
its start-to-close timeout (`gpucloud/activities/heartbeats.py`): a BMC action allowed 30
minutes, in flight when its worker was killed, held its node in `wiping` for those minutes."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from temporalio import activity

import gpucloud.workflows.options as options
from gpucloud.activities.heartbeats import EVERY_S
from support.heartbeat_workflow import Waits, WaitsTwice
from support.workflow_runs import queue_name, workers

# A try that may last longer than this heartbeats: a lost worker costs at most a heartbeat
# timeout, not the try's whole allowance.
LONGEST_SILENT_TRY = timedelta(minutes=2)


def _tables() -> dict[str, dict]:
    return {name: value for name, value in vars(options).items() if name.isupper() and isinstance(value, dict)}


@pytest.mark.unit
def test_every_activity_allowed_minutes_heartbeats():
    silent = {
        name: str(table["start_to_close_timeout"])
        for name, table in _tables().items()
        if table.get("start_to_close_timeout", timedelta(0)) > LONGEST_SILENT_TRY and "heartbeat_timeout" not in table
    }
    assert silent == {}, f"activities allowed minutes per try without a heartbeat timeout: {silent}"
    shortest = min(t["heartbeat_timeout"] for t in _tables().values() if "heartbeat_timeout" in t)
    assert shortest.total_seconds() >= EVERY_S * 3  # a beat or two may be late under load


@pytest.mark.workflow
async def test_waiting_activities_heartbeat_and_a_silent_one_times_out(temporal_env, monkeypatch):
    monkeypatch.setattr("gpucloud.activities.heartbeats.EVERY_S", 0.2)
    client = temporal_env.client
    waits = Waits()
    queue = queue_name("beats")
    with ThreadPoolExecutor(2) as threads:
        async with workers(
            client, [WaitsTwice], {queue: [waits.beating, waits.beating_async, waits.silent]}, activity_executor=threads
        ):
            seen = await client.execute_workflow(WaitsTwice.run, id=queue_name("beats"), task_queue=queue)
    assert seen == ["beat", "beat async", "TimeoutError"]


@pytest.mark.workflow
async def test_a_heartbeat_that_fails_does_not_stop_the_beat(temporal_env, monkeypatch):
    """A beat the worker's loop is too busy to take within its 10 s raises TimeoutError in the
    beating thread (seen in the suite); the thread beats on, so the activity is not timed out
    while its worker lives."""
    monkeypatch.setattr("gpucloud.activities.heartbeats.EVERY_S", 0.2)
    real, failed = activity.heartbeat, []

    def heartbeat(*details):
        if threading.current_thread().name == "activity-heartbeat" and not failed:
            failed.append(True)
            raise TimeoutError()
        real(*details)

    monkeypatch.setattr(activity, "heartbeat", heartbeat)
    client = temporal_env.client
    waits = Waits()
    queue = queue_name("beats")
    with ThreadPoolExecutor(2) as threads:
        async with workers(
            client, [WaitsTwice], {queue: [waits.beating, waits.beating_async, waits.silent]}, activity_executor=threads
        ):
            seen = await client.execute_workflow(WaitsTwice.run, id=queue_name("beats"), task_queue=queue)
    assert failed and seen == ["beat", "beat async", "TimeoutError"]
