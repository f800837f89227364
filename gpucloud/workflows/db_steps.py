"""A workflow's short control-database steps (load a row, compare-and-swap a state, record an
event), run as local activities with `options.DB`.

A local activity runs in the worker that runs the workflow: no activity task is scheduled,
matched, started and completed through the Temporal server, and the workflow does not wait for
a workflow task to resume on; its result is recorded in the workflow's history as a marker, so a
replay does not run it again. Every step is a compare-and-swap or idempotent write, as an
activity's would be (a local activity, too, may run more than once where a worker dies).

A local activity's failure reaches the workflow as the failure itself (an `ApplicationError`,
a `TimeoutError`, a `CancelledError`), not inside an `ActivityError` as a remote activity's
does. `db_step` wraps it in one, so the workflows handle both kinds of step alike
(`except ActivityError`, `error.cause`, `is_cancelled_exception`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from temporalio import workflow
from temporalio.exceptions import ActivityError, FailureError

import gpucloud.workflows.options as options

A = TypeVar("A")
R = TypeVar("R")


@overload
async def db_step(activity: Callable[[Any, A], Awaitable[R]], arg: A) -> R: ...


@overload
async def db_step(activity: Callable[[Any, A], R], arg: A) -> R: ...


async def db_step(activity: Callable[[Any, Any], Any], arg: Any) -> Any:
    """Run `activity(arg)` (a method of an activities class) as a local activity with the DB
    step's timeouts and retries; its failure raised as an `ActivityError` caused by it."""
    try:
        return await workflow.execute_local_activity_method(activity, arg, **options.DB)
    except ActivityError:
        raise
    except FailureError as failure:
        definition = getattr(activity, "__temporal_activity_definition", None)
        activity_type = str(getattr(definition, "name", None) or getattr(activity, "__name__", "activity"))
        raise ActivityError(
            f"local activity {activity_type} failed",
            scheduled_event_id=0,
            started_event_id=0,
            identity="",
            activity_type=activity_type,
            activity_id="",
            retry_state=None,
        ) from failure
