"""Read side of recorded usage: totals for a tenant (GPU-ms and amounts) and conflicts.

Totals are gross usage as metered, what reversal postings took back, and the net. A window
[start_ms, end_ms) selects samples by their start, the same rule that assigns them to a
billing period.

Samples are found through the (billing_period, tenant_id, start_ms) index: a sample is billed
in the period of its start or a later one, so the periods to look in are known from the window.
"""

from __future__ import annotations

import json

from sqlalchemy import Connection, case, func, select

from gpucloud.ledger.periods import period_of, periods_between
from gpucloud.ledger.schemas import ConflictOut
from gpucloud.ledger.tables import postings, usage_conflicts, usage_samples
from gpucloud.models.billing_messages import UsageByType, UsageSummary


def usage_summary(
    connection: Connection,
    *,
    tenant_id: str,
    allocation_id: str | None,
    start_ms: int | None,
    end_ms: int | None,
) -> UsageSummary:
    samples = usage_samples
    reversal = postings.alias("reversal")
    reversed_ = reversal.c.id.is_not(None)
    query = (
        select(
            samples.c.gpu_type,
            func.count(),
            func.sum(samples.c.gpu_ms),
            func.sum(samples.c.amount_micro),
            func.sum(case((reversed_, samples.c.gpu_ms), else_=0)),
            func.sum(case((reversed_, samples.c.amount_micro), else_=0)),
        )
        .select_from(samples.outerjoin(reversal, reversal.c.reverses_posting_id == samples.c.posting_id))
        .where(
            samples.c.billing_period.in_(billing_periods_since(connection, start_ms)),
            samples.c.tenant_id == tenant_id,
        )
        .group_by(samples.c.gpu_type)
        .order_by(samples.c.gpu_type)
    )
    if allocation_id is not None:
        query = query.where(samples.c.allocation_id == allocation_id)
    if start_ms is not None:
        query = query.where(samples.c.start_ms >= start_ms)
    if end_ms is not None:
        query = query.where(samples.c.start_ms < end_ms)
    by_type = [
        UsageByType(
            gpu_type=gpu_type,
            sample_count=count,
            gpu_ms=int(gpu_ms),
            amount_micro=int(amount),
            reversed_gpu_ms=int(reversed_gpu_ms),
            reversed_amount_micro=int(reversed_amount),
        )
        for gpu_type, count, gpu_ms, amount, reversed_gpu_ms, reversed_amount in connection.execute(query)
    ]
    gpu_ms = sum(t.gpu_ms for t in by_type)
    amount = sum(t.amount_micro for t in by_type)
    reversed_gpu_ms = sum(t.reversed_gpu_ms for t in by_type)
    reversed_amount = sum(t.reversed_amount_micro for t in by_type)
    return UsageSummary(
        tenant_id=tenant_id,
        allocation_id=allocation_id,
        start_ms=start_ms,
        end_ms=end_ms,
        sample_count=sum(t.sample_count for t in by_type),
        gpu_ms=gpu_ms,
        amount_micro=amount,
        reversed_gpu_ms=reversed_gpu_ms,
        reversed_amount_micro=reversed_amount,
        net_gpu_ms=gpu_ms - reversed_gpu_ms,
        net_amount_micro=amount - reversed_amount,
        by_gpu_type=by_type,
    )


def billing_periods_since(connection: Connection, start_ms: int | None) -> list[str]:
    """The billing periods that can hold samples starting at or after ``start_ms``."""
    first, last = connection.execute(
        select(func.min(usage_samples.c.billing_period), func.max(usage_samples.c.billing_period))
    ).one()
    if first is None:
        return []
    if start_ms is not None:
        first = max(first, period_of(start_ms))
    return periods_between(first, last)


def list_conflicts(connection: Connection, *, node_id: str | None, after_id: int, page_size: int) -> list[ConflictOut]:
    query = select(usage_conflicts).where(usage_conflicts.c.id > after_id)
    if node_id is not None:
        query = query.where(usage_conflicts.c.node_id == node_id)
    rows = connection.execute(query.order_by(usage_conflicts.c.id).limit(page_size)).mappings()
    return [ConflictOut(**{**row, "received": json.loads(row["received"])}) for row in rows]
