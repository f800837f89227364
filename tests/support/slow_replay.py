"""A workflow for the replay tests: its own module, since Temporal's sandbox imports a workflow's
module anew (a test module, rewritten by pytest, cannot be)."""

from __future__ import annotations

import time

from temporalio import workflow


@workflow.defn(sandboxed=True)
class SlowToReplay:
    """Holds its thread for longer than the deadlock detector's 2 s while it is replayed, as a
    starved test process or a garbage collection inside the activation can."""

    @workflow.run
    async def run(self) -> str:
        await workflow.sleep(0.01)
        if workflow.unsafe.is_replaying():
            with workflow.unsafe.sandbox_unrestricted():
                time.sleep(2.5)  # noqa: ASYNC251 (blocking the thread is the point)
        return "done"
