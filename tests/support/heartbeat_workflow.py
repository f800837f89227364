"""A workflow for the heartbeat test (`tests/platform/test_activity_heartbeats.py`): its own
module, since Temporal's sandbox imports a workflow's module anew."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from gpucloud.activities.heartbeats import beats_while_awaited, beats_while_running

WAIT_S = 3.0


class Waits:
    """Activities that wait on nothing for longer than their 1 s heartbeat timeout, as a BMC
    waits for a power change: one sync and one async that heartbeat from `heartbeats.py`, and
    one that does not."""

    @activity.defn(name="heartbeat_test_beating")
    @beats_while_running
    def beating(self, what: str) -> str:
        time.sleep(WAIT_S)
        return what

    @activity.defn(name="heartbeat_test_beating_async")
    @beats_while_awaited
    async def beating_async(self, what: str) -> str:
        await asyncio.sleep(WAIT_S)
        return what

    @activity.defn(name="heartbeat_test_silent")
    def silent(self, what: str) -> str:
        time.sleep(WAIT_S)
        return what


@workflow.defn(sandboxed=True)
class WaitsTwice:
    @workflow.run
    async def run(self) -> list[str]:
        options = {
            "start_to_close_timeout": timedelta(seconds=30),
            "heartbeat_timeout": timedelta(seconds=1),
            "retry_policy": RetryPolicy(maximum_attempts=1),
        }
        seen = [await workflow.execute_activity_method(Waits.beating, "beat", **options)]  # type: ignore[arg-type]
        seen.append(await workflow.execute_activity_method(Waits.beating_async, "beat async", **options))  # type: ignore[arg-type]
        try:
            await workflow.execute_activity_method(Waits.silent, "silent", **options)  # type: ignore[arg-type]
        except ActivityError as error:
            seen.append(type(error.cause).__name__)
        return seen
