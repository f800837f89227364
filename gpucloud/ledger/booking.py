"""Booking accepted usage: rate it, post it, write it, all in ingest's transaction.

Samples are grouped by invoice line (billing period, usage period, tenant, allocation, GPU
type, price version). Each line's samples are rated as steps on the line's running total
(``rating_accumulators``; see ``pricing.py``), posted as one balanced double-entry posting per
line per batch, and inserted in bulk (``executemany`` on SQLite, ``COPY`` on Postgres). A
sample's billing period is the period of its start if that is open, else the first open one
after it: usage that arrives after its period closed becomes an adjustment on the next invoice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from itertools import repeat
from operator import add, mul, sub

from sqlalchemy import Connection, select
from sqlalchemy.dialects import postgresql, sqlite

from gpucloud.ledger.batch import (
    SAMPLE_FIELDS,
    Candidate,
    LineKey,
    end_of,
    gpu_count_of,
    line_fields,
    sample_fields,
    sample_of,
    start_of,
    version_of,
)
from gpucloud.ledger.db import insert_tuples
from gpucloud.ledger.periods import period_bounds, period_of
from gpucloud.ledger.postings import closed_periods, first_open_period, insert_posting, usage_lines
from gpucloud.ledger.tables import rating_accumulators, usage_samples

_LINE_KEY_COLUMNS = ("billing_period", "usage_period", "tenant_id", "allocation_id", "gpu_type", "price_version_id")
_SAMPLE_COLUMNS = (
    *SAMPLE_FIELDS,
    "gpu_ms",
    "amount_micro",
    "price_version_id",
    "usage_period",
    "billing_period",
    "posting_id",
    "ingested_ms",
)


class _PeriodOf:
    """``period_of`` with the last period's bounds remembered: samples come in runs."""

    def __init__(self) -> None:
        self._low, self._high, self._period = 0, 0, ""

    def __call__(self, instant_ms: int) -> str:
        if not self._low <= instant_ms < self._high:
            self._period = period_of(instant_ms)
            self._low, self._high = period_bounds(self._period)
        return self._period


def _invoice_lines(candidates: list[Candidate], closed: set[str]) -> dict[LineKey, list[Candidate]]:
    """Group samples by the invoice line they are rated and billed on."""
    distinct_lines = set(map(line_fields, map(sample_of, candidates)))
    versions = set(map(version_of, candidates))
    first_period = period_of(min(map(start_of, candidates)))
    if len(distinct_lines) == 1 and len(versions) == 1 and first_period == period_of(max(map(start_of, candidates))):
        # The usual batch: one line.
        key = (first_open_period(first_period, closed), first_period, *distinct_lines.pop(), versions.pop())
        return {key: candidates}
    usage_period_of = _PeriodOf()
    lines: dict[LineKey, list[Candidate]] = defaultdict(list)
    for candidate in candidates:
        usage_period = usage_period_of(candidate.start_ms)
        key = (
            first_open_period(usage_period, closed),
            usage_period,
            *line_fields(candidate.sample),
            candidate.price_version_id,
        )
        lines[key].append(candidate)
    return lines


def book(connection: Connection, candidates: list[Candidate], now_ms: int) -> None:
    """Rate, post and write the accepted samples."""
    if not candidates:
        return
    lines = _invoice_lines(candidates, closed_periods(connection))
    totals = _load_totals(connection, lines.keys())
    rows: list[tuple] = []
    accumulators = []
    for key, line_candidates in sorted(lines.items()):
        gpu_ms_before, max_start_before = totals.get(key, (0, -1))
        durations = map(sub, map(end_of, line_candidates), map(start_of, line_candidates))
        parts = list(map(mul, map(gpu_count_of, line_candidates), durations))
        rate = line_candidates[0].rate
        assert rate is not None  # `checks.price` priced every candidate it kept
        amounts = rate.split(gpu_ms_before, parts)
        posting_id = _post_line(connection, key, parts, amounts, now_ms)
        billing_period, usage_period, _, _, _, price_version_id = key
        # Row tuples are put together by map/zip/add, in C: at 8,000 rows per batch a Python
        # loop here costs as much as a third of SQLite's insert.
        line_columns = (price_version_id, usage_period, billing_period, posting_id, now_ms)
        computed = zip(parts, amounts, *map(repeat, line_columns), strict=False)
        rows.extend(map(add, map(sample_fields, map(sample_of, line_candidates)), computed))
        gpu_ms_total = gpu_ms_before + sum(parts)
        accumulators.append(
            {
                **dict(zip(_LINE_KEY_COLUMNS, key, strict=False)),
                "gpu_ms_total": gpu_ms_total,
                "amount_total_micro": rate.amount_for(gpu_ms_total),
                "max_start_ms": max(max_start_before, max(map(start_of, line_candidates))),
            }
        )
    insert_tuples(connection, usage_samples, _SAMPLE_COLUMNS, rows)
    _save_totals(connection, accumulators)


def _post_line(connection: Connection, key: LineKey, parts: list[int], amounts: list[int], now_ms: int) -> int:
    billing_period, usage_period, tenant_id, allocation_id, gpu_type, price_version_id = key
    amount = sum(amounts)
    return insert_posting(
        connection,
        {
            "kind": "usage",
            "billing_period": billing_period,
            "usage_period": usage_period,
            "tenant_id": tenant_id,
            "allocation_id": allocation_id,
            "gpu_type": gpu_type,
            "price_version_id": price_version_id,
            "gpu_ms": sum(parts),
            "amount_micro": amount,
            "sample_count": len(parts),
            "reverses_posting_id": None,
            "created_ms": now_ms,
        },
        usage_lines(tenant_id, gpu_type, amount),
    )


def _load_totals(connection: Connection, keys: Iterable[LineKey]) -> dict[LineKey, tuple[int, int]]:
    keys = set(keys)
    table = rating_accumulators
    query = select(*(table.c[name] for name in _LINE_KEY_COLUMNS), table.c.gpu_ms_total, table.c.max_start_ms).where(
        table.c.tenant_id.in_({key[2] for key in keys}),
        table.c.allocation_id.in_({key[3] for key in keys}),
    )
    totals = {}
    for row in connection.execute(query):
        key = tuple(row[:6])
        if key in keys:
            totals[key] = (row.gpu_ms_total, row.max_start_ms)
    return totals


def _save_totals(connection: Connection, accumulators: list[dict]) -> None:
    dialect_insert = postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert
    statement = dialect_insert(rating_accumulators)
    statement = statement.on_conflict_do_update(
        index_elements=list(_LINE_KEY_COLUMNS),
        set_={
            "gpu_ms_total": statement.excluded.gpu_ms_total,
            "amount_total_micro": statement.excluded.amount_total_micro,
            "max_start_ms": statement.excluded.max_start_ms,
        },
    )
    connection.execute(statement, accumulators)
