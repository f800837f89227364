"""The one retry helper, on a fake clock: its backoff is bounded and jittered within bounds, it
stops at its attempts or its deadline, retries only what its predicate calls transient, and waits
a server's Retry-After instead of its schedule."""

from __future__ import annotations

import random

import pytest

from gpucloud.retry import Backoff, parse_retry_after, retry_call, retry_call_async

pytestmark = pytest.mark.unit


class FakeTime:
    """A clock that only a sleep moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


class Transient(Exception):
    def __init__(self, retry_after_s: float | None = None) -> None:
        super().__init__("try again")
        self.retry_after_s = retry_after_s


def failing(times: int, error: Exception | None = None, *, result: str = "done"):
    calls: list[int] = []

    def call() -> str:
        calls.append(len(calls) + 1)
        if len(calls) <= times:
            raise error or Transient()
        return result

    return call, calls


def test_the_backoff_doubles_up_to_its_cap() -> None:
    backoff = Backoff(first_s=0.25, cap_s=5.0)
    assert [backoff.ceiling_s(n) for n in range(1, 9)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert [backoff.delay_s(n) for n in range(1, 9)] == [backoff.ceiling_s(n) for n in range(1, 9)]
    assert backoff.ceiling_s(10_000) == 5.0


def test_jitter_draws_below_the_ceiling_never_above() -> None:
    rng = random.Random(7)
    full, half = Backoff(first_s=1.0, cap_s=8.0, jitter=1.0), Backoff(first_s=1.0, cap_s=8.0, jitter=0.5)
    for failures in range(1, 12):
        ceiling = full.ceiling_s(failures)
        draws = [full.delay_s(failures, rng=rng) for _ in range(50)]
        assert all(0 <= d <= ceiling for d in draws) and len(set(draws)) > 1
        assert all(ceiling / 2 <= half.delay_s(failures, rng=rng) <= ceiling for _ in range(50))


@pytest.mark.parametrize("bad", [{"first_s": 2.0, "cap_s": 1.0}, {"first_s": -1.0, "cap_s": 1.0}])
def test_a_backoff_must_be_bounded(bad) -> None:
    with pytest.raises(ValueError):
        Backoff(**bad)
    with pytest.raises(ValueError):
        Backoff(first_s=1.0, cap_s=2.0, jitter=1.5)


def test_retries_until_it_succeeds_sleeping_the_schedule() -> None:
    time = FakeTime()
    call, calls = failing(3)
    backoff = Backoff(first_s=0.5, cap_s=1.5)
    result = retry_call(
        call, retry_on=Transient, backoff=backoff, attempts=10, deadline_s=None, sleep=time.sleep, clock=time.clock
    )
    assert result == "done" and calls == [1, 2, 3, 4]
    assert time.slept == [0.5, 1.0, 1.5]


def test_gives_up_after_its_attempts_with_the_last_error() -> None:
    time = FakeTime()
    call, calls = failing(99)
    with pytest.raises(Transient):
        retry_call(
            call,
            retry_on=Transient,
            backoff=Backoff(first_s=1.0, cap_s=1.0),
            attempts=3,
            deadline_s=None,
            sleep=time.sleep,
            clock=time.clock,
        )
    assert calls == [1, 2, 3] and time.slept == [1.0, 1.0]


def test_schedules_no_retry_once_the_deadline_has_passed() -> None:
    time = FakeTime()
    call, calls = failing(99)
    with pytest.raises(Transient):
        retry_call(
            call,
            retry_on=Transient,
            backoff=Backoff(first_s=1.0, cap_s=4.0),
            attempts=None,
            deadline_s=10.0,
            sleep=time.sleep,
            clock=time.clock,
        )
    # Calls at 0, 1, 3, 7 and 11 s: the one at 11 s fails past the deadline and is the last.
    assert time.slept == [1.0, 2.0, 4.0, 4.0] and len(calls) == 5


def test_an_error_the_predicate_does_not_call_transient_is_raised_at_once() -> None:
    time = FakeTime()
    call, calls = failing(1, KeyError("gone"))
    with pytest.raises(KeyError):
        retry_call(
            call,
            retry_on=lambda error: isinstance(error, Transient),
            backoff=Backoff(first_s=1.0, cap_s=1.0),
            attempts=5,
            deadline_s=60.0,
            sleep=time.sleep,
            clock=time.clock,
        )
    assert calls == [1] and time.slept == []


def test_a_retry_after_is_waited_instead_of_the_schedule_up_to_its_cap() -> None:
    time = FakeTime()
    errors = iter([Transient(retry_after_s=3.0), Transient(), Transient(retry_after_s=120.0)])

    def call() -> str:
        error = next(errors, None)
        if error is not None:
            raise error
        return "done"

    seen: list[tuple[str, float]] = []
    result = retry_call(
        call,
        retry_on=Transient,
        backoff=Backoff(first_s=0.25, cap_s=5.0),
        attempts=None,
        deadline_s=300.0,
        retry_after=lambda error: getattr(error, "retry_after_s", None),
        retry_after_cap_s=30.0,
        on_retry=lambda error, delay_s: seen.append((str(error), delay_s)),
        sleep=time.sleep,
        clock=time.clock,
    )
    assert result == "done"
    assert time.slept == [3.0, 0.5, 30.0]
    assert seen == [("try again", 3.0), ("try again", 0.5), ("try again", 30.0)]


async def test_the_async_twin_retries_the_same_way() -> None:
    time = FakeTime()
    attempts: list[int] = []

    async def call() -> int:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("refused")
        return len(attempts)

    result = await retry_call_async(
        call,
        retry_on=(ConnectionError, TimeoutError),
        backoff=Backoff(first_s=0.2, cap_s=5.0),
        attempts=None,
        deadline_s=None,
        sleep=time.async_sleep,
        clock=time.clock,
    )
    assert result == 3 and time.slept == [0.2, 0.4]


def test_retry_after_reads_seconds_only() -> None:
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("0.5") == 0.5
    assert parse_retry_after("") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
