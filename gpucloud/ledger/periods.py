"""Billing periods and days: pure calendar arithmetic on UTC epoch milliseconds.

A billing period is a UTC calendar month named ``YYYY-MM``. A sample belongs to the period
that contains its start; the agent's meter cuts samples at interval boundaries that divide a
day, so in practice no sample straddles a period boundary.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta

# Years 1970 to 2999: a period before the epoch or past 9999's successor is no billing period
# (`datetime` has no year 0 and no year 10000), and the API refuses one with a 422.
PERIOD_PATTERN = r"^(19[7-9]\d|2\d{3})-(0[1-9]|1[0-2])$"
_PERIOD = re.compile(PERIOD_PATTERN)
MS_PER_DAY = 86_400_000


def _epoch_ms(moment: datetime) -> int:
    return int(moment.timestamp()) * 1000


def period_of(instant_ms: int) -> str:
    """The ``YYYY-MM`` period containing an instant."""
    moment = datetime.fromtimestamp(instant_ms // 1000, tz=UTC)
    return f"{moment.year:04d}-{moment.month:02d}"


def parse_period(period_id: str) -> tuple[int, int]:
    match = _PERIOD.match(period_id)
    if match is None:
        raise ValueError(f"period {period_id!r} is not YYYY-MM (a month from 1970-01 to 2999-12)")
    return int(match.group(1)), int(match.group(2))


def next_period(period_id: str) -> str:
    year, month = parse_period(period_id)
    return f"{year + month // 12:04d}-{month % 12 + 1:02d}"


def period_bounds(period_id: str) -> tuple[int, int]:
    """[start, end) of a period in epoch milliseconds."""
    year, month = parse_period(period_id)
    start = datetime(year, month, 1, tzinfo=UTC)
    end_year, end_month = parse_period(next_period(period_id))
    return _epoch_ms(start), _epoch_ms(datetime(end_year, end_month, 1, tzinfo=UTC))


def day_bounds(day: date) -> tuple[int, int]:
    """[start, end) of a UTC day in epoch milliseconds."""
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return _epoch_ms(start), _epoch_ms(start + timedelta(days=1))


def periods_between(first: str, last: str) -> list[str]:
    """Every period from ``first`` through ``last``, in order (empty when last < first)."""
    result = []
    period_id = first
    while period_id <= last:
        result.append(period_id)
        period_id = next_period(period_id)
    return result
