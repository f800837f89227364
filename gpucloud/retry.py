"""Retries of what runs in a process, one helper on tenacity: a client's call, a simulated agent's
report, a shipper that waits out an outage. (Workflows and activities are retried by Temporal's
`RetryPolicy`; this is for everything outside them.)

`Backoff` is the schedule: `first_s` after the first failure, doubled after each further one, at
most `cap_s`, with `jitter` the share of each delay drawn at random (0: exact, 1: anywhere from
nothing up to it), so many callers that failed together do not come back together.

`retry_call` (and `retry_call_async`) makes a call again while `retry_on` says its error is
transient, until it succeeds, `attempts` calls were made or `deadline_s` has passed since the
first (no retry is scheduled after it), and then raises the last error. A server that says when
to come back (`Retry-After`, read by the caller's `retry_after`) is waited for instead of the
schedule, up to `retry_after_cap_s`. `sleep` and `clock` are the test's to replace.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")

RetryOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]
RetryAfter = Callable[[BaseException], float | None]
OnRetry = Callable[[BaseException, float], None]

_MAX_DOUBLINGS = 64  # far past any cap: keeps 2**n a float


@dataclass(frozen=True, kw_only=True)
class Backoff:
    first_s: float
    cap_s: float
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.first_s <= self.cap_s:
            raise ValueError(f"a backoff needs 0 <= first_s <= cap_s, not {self.first_s} and {self.cap_s}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter is a share between 0 and 1, not {self.jitter}")

    def ceiling_s(self, failures: int) -> float:
        """The longest wait after `failures` failures in a row (1 for the first)."""
        return min(self.cap_s, self.first_s * 2.0 ** min(max(failures - 1, 0), _MAX_DOUBLINGS))

    def delay_s(self, failures: int, *, rng: random.Random | None = None) -> float:
        """The wait after `failures` failures in a row: its ceiling, less up to `jitter` of it."""
        ceiling = self.ceiling_s(failures)
        return (rng or random).uniform((1 - self.jitter) * ceiling, ceiling)


def parse_retry_after(value: str | None) -> float | None:
    """A `Retry-After` header's delay in seconds (its date form is not used by these servers)."""
    if value and value.replace(".", "", 1).isdigit():
        return float(value)
    return None


def _is_transient(retry_on: RetryOn) -> Callable[[BaseException], bool]:
    if isinstance(retry_on, type | tuple):
        kinds = retry_on
        return lambda error: isinstance(error, kinds)
    return retry_on


def _options(
    *,
    retry_on: RetryOn,
    backoff: Backoff,
    attempts: int | None,
    deadline_s: float | None,
    retry_after: RetryAfter | None,
    retry_after_cap_s: float | None,
    on_retry: OnRetry | None,
    clock: Callable[[], float],
) -> dict[str, Any]:
    started = clock()

    def stop(state: tenacity.RetryCallState) -> bool:
        if attempts is not None and state.attempt_number >= attempts:
            return True
        return deadline_s is not None and clock() - started >= deadline_s

    def wait(state: tenacity.RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome else None
        told = retry_after(error) if retry_after is not None and error is not None else None
        if told is not None:
            return told if retry_after_cap_s is None else min(told, retry_after_cap_s)
        return backoff.delay_s(state.attempt_number)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        if on_retry is not None and error is not None:
            on_retry(error, state.upcoming_sleep)

    return {
        "retry": tenacity.retry_if_exception(_is_transient(retry_on)),
        "stop": stop,
        "wait": wait,
        "before_sleep": before_sleep,
        "reraise": True,
    }


def retry_call(
    call: Callable[[], T],
    *,
    retry_on: RetryOn,
    backoff: Backoff,
    attempts: int | None,
    deadline_s: float | None,
    retry_after: RetryAfter | None = None,
    retry_after_cap_s: float | None = None,
    on_retry: OnRetry | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`call()`, made again after a transient error (see the module's docstring). `attempts` and
    `deadline_s` are both asked for: None for both retries until the call succeeds."""
    options = _options(
        retry_on=retry_on,
        backoff=backoff,
        attempts=attempts,
        deadline_s=deadline_s,
        retry_after=retry_after,
        retry_after_cap_s=retry_after_cap_s,
        on_retry=on_retry,
        clock=clock,
    )
    return tenacity.Retrying(sleep=sleep, **options)(call)


async def retry_call_async(
    call: Callable[[], Awaitable[T]],
    *,
    retry_on: RetryOn,
    backoff: Backoff,
    attempts: int | None,
    deadline_s: float | None,
    retry_after: RetryAfter | None = None,
    retry_after_cap_s: float | None = None,
    on_retry: OnRetry | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """The asyncio twin of `retry_call`."""
    options = _options(
        retry_on=retry_on,
        backoff=backoff,
        attempts=attempts,
        deadline_s=deadline_s,
        retry_after=retry_after,
        retry_after_cap_s=retry_after_cap_s,
        on_retry=on_retry,
        clock=clock,
    )
    return await tenacity.AsyncRetrying(sleep=sleep, **options)(call)
