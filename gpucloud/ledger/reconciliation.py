"""Reconciliation: metered usage against allocated time, per tenant per UTC day.

Allocated time comes from allocation events (a node belongs to an allocation from its
``node_added`` to its ``node_removed``, within the allocation's ``start`` and ``end``; an
allocation that never named its nodes is taken to hold every node that metered for it from
start to end). Metered time is the union of the nodes' usage samples. For every
(allocation, node) the report gives the allocated time no sample covers (``gaps``: usage
lost or not shipped yet) and metered time outside the allocation (``unallocated``: a meter
that ran too long or events that are missing). Reversals do not change coverage: they
correct money, not what was measured.

The bill is held time only (``held.py``), so this report is where the meters show: per
allocation its price class, the GPU-ms it held (what is billed), the GPU-ms its nodes metered
and the difference, and the same per node.

For a day still in progress the report stops at the ledger's clock, and a gap that runs up
to it is reported as ``pending_since_ms`` instead: the meter reports whole intervals after
they end, so the last minutes are normally on their way.

The agent starts and stops metering when it provisions and releases the node; the control
plane records ``node_added`` when it sees the provision succeed and ``node_removed`` when the
release begins. The two clocks disagree by a moment at each edge, so a gap or an unallocated
span shorter than ``edge_tolerance_ms`` (default 5 s) that touches an allocated interval's start
or end is not flagged; its length is reported as ``edge_ms``. Anything longer, or in the middle,
is.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import date

from sqlalchemy import Connection, select

from gpucloud.ledger.allocations import AllocationTimeline, list_events, timelines
from gpucloud.ledger.held import allocation_classes
from gpucloud.ledger.ingest import MAX_SAMPLE_MS
from gpucloud.ledger.periods import day_bounds
from gpucloud.ledger.pricing import ON_DEMAND
from gpucloud.ledger.schemas import (
    AllocationReconciliation,
    Interval,
    NodeReconciliation,
    ReconciliationReport,
)
from gpucloud.ledger.tables import usage_samples
from gpucloud.ledger.usage import billing_periods_since

Span = tuple[int, int]


def merge(spans: list[Span]) -> list[Span]:
    """Sorted, non-overlapping, non-adjacent spans covering the same time."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def subtract(spans: list[Span], removed: list[Span]) -> list[Span]:
    """The parts of ``spans`` not covered by ``removed`` (both merged)."""
    result = []
    for start, end in spans:
        cursor = start
        for cut_start, cut_end in removed:
            if cut_end <= cursor or cut_start >= end:
                continue
            if cut_start > cursor:
                result.append((cursor, cut_start))
            cursor = max(cursor, cut_end)
        if cursor < end:
            result.append((cursor, end))
    return result


def clip(spans: list[Span], low: int, high: int) -> list[Span]:
    return [(max(start, low), min(end, high)) for start, end in spans if start < high and end > low]


def length(spans: list[Span]) -> int:
    return sum(end - start for start, end in spans)


def _allocated_spans(timeline: AllocationTimeline, node_id: str, far_future: int) -> list[Span]:
    started = timeline.started_ms if timeline.started_ms is not None else 0
    ended = timeline.ended_ms if timeline.ended_ms is not None else far_future
    if timeline.node_intervals:
        spans = [
            (added, far_future if removed is None else removed)
            for added, removed in timeline.node_intervals.get(node_id, [])
        ]
    else:
        spans = [(started, ended)]
    return merge(clip(spans, started, ended))


EDGE_TOLERANCE_MS = 5_000


def at_edges(spans: list[Span], allocated: list[Span], tolerance_ms: int) -> tuple[list[Span], list[Span]]:
    """(flagged, tolerated): spans shorter than the tolerance that touch an allocated interval's
    start or end are tolerated."""
    edges = {edge for span in allocated for edge in span}
    tolerated = [(s, e) for s, e in spans if e - s < tolerance_ms and (s in edges or e in edges)]
    return [span for span in spans if span not in tolerated], tolerated


def reconcile(
    connection: Connection, *, tenant_id: str, day: date, now_ms: int, edge_tolerance_ms: int = EDGE_TOLERANCE_MS
) -> ReconciliationReport:
    day_start, day_end = day_bounds(day)
    horizon = max(day_start, min(day_end, now_ms))
    events = list_events(connection, tenant_id=tenant_id, allocation_id=None)
    timeline_by_allocation = timelines(events)
    classes = allocation_classes(events)
    event_gpus = {
        (e.allocation_id, e.node_id): e.gpu_count for e in events if e.kind == "node_added" and e.gpu_count is not None
    }
    sample_gpus: dict[tuple[str, str], int] = {}
    metered: dict[tuple[str, str], list[Span]] = defaultdict(list)
    metered_gpu_ms: dict[tuple[str, str], int] = defaultdict(int)
    rows = connection.execute(
        select(
            usage_samples.c.allocation_id,
            usage_samples.c.node_id,
            usage_samples.c.start_ms,
            usage_samples.c.end_ms,
            usage_samples.c.gpu_count,
        ).where(
            usage_samples.c.billing_period.in_(billing_periods_since(connection, day_start - MAX_SAMPLE_MS)),
            usage_samples.c.tenant_id == tenant_id,
            usage_samples.c.start_ms >= day_start - MAX_SAMPLE_MS,
            usage_samples.c.start_ms < day_end,
            usage_samples.c.end_ms > day_start,
        )
    )
    for allocation_id, node_id, start_ms, end_ms, gpu_count in rows:
        start_ms, end_ms = max(start_ms, day_start), min(end_ms, day_end)
        metered[(allocation_id, node_id)].append((start_ms, end_ms))
        metered_gpu_ms[(allocation_id, node_id)] += (end_ms - start_ms) * gpu_count
        sample_gpus[(allocation_id, node_id)] = gpu_count
    keys = set(metered)
    for allocation_id, timeline in timeline_by_allocation.items():
        keys.update((allocation_id, node_id) for node_id in timeline.node_intervals)
    by_allocation: dict[str, list[NodeReconciliation]] = defaultdict(list)
    for allocation_id, node_id in sorted(keys):
        found = timeline_by_allocation.get(allocation_id)
        whole = _allocated_spans(found, node_id, day_end) if found else []
        allocated = clip(whole, day_start, horizon)
        covered = merge(metered.get((allocation_id, node_id), []))
        if not allocated and not covered:
            continue
        gaps = subtract(allocated, covered)
        pending_since = None
        if now_ms < day_end and gaps and gaps[-1][1] == horizon:
            pending_since = gaps[-1][0]
            gaps = gaps[:-1]
        # The edges are the allocation's own, not where the day or the clock cut it.
        gaps, edge_gaps = at_edges(gaps, whole, edge_tolerance_ms)
        unallocated, edge_unallocated = at_edges(subtract(covered, allocated), whole, edge_tolerance_ms)
        gpus = event_gpus.get((allocation_id, node_id), sample_gpus.get((allocation_id, node_id), 0))
        by_allocation[allocation_id].append(
            NodeReconciliation(
                node_id=node_id,
                allocated_ms=length(allocated),
                held_gpu_ms=length(allocated) * gpus,
                metered_ms=length(covered),
                metered_gpu_ms=metered_gpu_ms.get((allocation_id, node_id), 0),
                gaps=[Interval(start_ms=s, end_ms=e) for s, e in gaps],
                unallocated=[Interval(start_ms=s, end_ms=e) for s, e in unallocated],
                pending_since_ms=pending_since,
                edge_ms=length(edge_gaps) + length(edge_unallocated),
            )
        )
    allocations = [
        AllocationReconciliation(
            allocation_id=a,
            price_class=classes.get(a, ON_DEMAND),
            held_gpu_ms=sum(node.held_gpu_ms for node in nodes),
            metered_gpu_ms=sum(node.metered_gpu_ms for node in nodes),
            metered_minus_held_gpu_ms=sum(node.metered_gpu_ms - node.held_gpu_ms for node in nodes),
            nodes=nodes,
        )
        for a, nodes in sorted(by_allocation.items())
    ]
    gap_count = sum(len(node.gaps) for a in allocations for node in a.nodes)
    unallocated_count = sum(len(node.unallocated) for a in allocations for node in a.nodes)
    return ReconciliationReport(
        tenant_id=tenant_id,
        day=day.isoformat(),
        start_ms=day_start,
        end_ms=day_end,
        allocations=allocations,
        gap_count=gap_count,
        unallocated_count=unallocated_count,
        ok=gap_count == 0 and unallocated_count == 0,
    )
