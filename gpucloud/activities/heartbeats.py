"""Heartbeats for activities that wait on an outside system with no progress of their own to
report (a BMC's power change, a sweep of the fleet, a ledger's close).

An activity's `start_to_close_timeout` bounds one try; a worker that dies under a try is noticed
only when that bound passes, unless the activity heartbeats: then Temporal retries it on another
worker once the `heartbeat_timeout` passes without one. A BMC action allowed 30 minutes, in
flight when its worker was killed, held its node in `wiping` for those 30 minutes. So every
activity whose try may last longer than a couple of minutes has a heartbeat timeout in
`workflows/options.py` (checked by `tests/platform/test_activity_heartbeats.py`), and the ones
that only wait beat from here while they run.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from temporalio import activity

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# Well inside the shortest heartbeat timeout of `workflows/options.py` (30 s).
EVERY_S = 5.0


def beats_while_running(fn: Callable[P, R]) -> Callable[P, R]:
    """A sync activity that heartbeats every `EVERY_S` from a thread of its own while it runs
    (its calls out are each bounded; the heartbeat says only that its worker is alive)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not activity.in_activity():  # called directly (a test, a script): nothing to tell
            return fn(*args, **kwargs)
        context = contextvars.copy_context()  # the activity's context, for `activity.heartbeat`
        done = threading.Event()

        def beat() -> None:
            while not done.wait(EVERY_S):
                try:
                    context.run(activity.heartbeat)
                except Exception as error:  # a beat the worker's loop took too long to take
                    # (it waits 10 s): the next one may pass; a thread that died would let the
                    # heartbeat timeout fail an activity whose worker is alive.
                    log.warning("activity heartbeat not sent (%r); beating on", error)

        beater = threading.Thread(target=beat, name="activity-heartbeat", daemon=True)
        beater.start()
        try:
            return fn(*args, **kwargs)
        finally:
            done.set()
            beater.join()

    return run


def beats_while_awaited(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """The same for an async activity: a task on its loop heartbeats every `EVERY_S`."""

    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not activity.in_activity():
            return await fn(*args, **kwargs)

        async def beat() -> None:
            while True:
                await asyncio.sleep(EVERY_S)
                activity.heartbeat()

        beater = asyncio.create_task(beat())
        try:
            return await fn(*args, **kwargs)
        finally:
            beater.cancel()

    return run
