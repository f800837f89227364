"""Billed time is held time: what the control plane's allocation events say the tenant held.

A node is billed from its ``node_added`` event (sent when the allocation becomes ready, or when
a replacement attaches) to its ``node_removed`` event (sent when the release or the pull
begins), within the allocation's ``start`` and ``end``; an interval with no recorded end runs
on (the clock does not stop while the control plane cannot reach the ledger). The node agents'
samples are what the ledger books as usage while the period is open, but they are only
corroboration: tenants have root on their nodes and could stop the agent, edit its spool or
release the node from inside.

At the close of a period every invoice line (allocation, GPU type, usage period, price
version) of the period and the ones before it is trued up to held time: the difference
between what the events say was held and what was posted for the line so far (the meters'
usage plus earlier true-ups; reversals stay as they are) is posted as a ``held`` usage posting.
A killed agent's missing hours are billed that way; metered time outside what was held (a
meter started before the allocation was ready, an allocation cancelled before it was ever
ready) is credited. An event that arrives after its period closed is trued up at the next
close, on the next invoice, like late usage. The line's amount is exact: the true-up brings its
posted amount to ``rate.amount_for(held GPU-ms)``.

Each allocation is billed at its price class, which its ``start`` event names (none: on_demand):
the true-up brings its lines to the class's rate for the held GPU-ms (``pricing.py``; a class
the price book does not price falls back to on-demand) and records the class on its posting.
A ``reserved`` allocation's held time is covered by its capacity reservation
(``reservations.py``), so its lines are trued up to nothing.

Allocations the control plane never sent events for (a ledger used on its own) are billed on
their meters as before. A node whose ``node_added`` event carries no GPU count is counted with
the GPU count its samples report; with neither it cannot be priced and is left out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection, case, func, select

from gpucloud.ledger.allocations import timelines
from gpucloud.ledger.close import LineAggregate
from gpucloud.ledger.periods import period_bounds, period_of
from gpucloud.ledger.pricing import ON_DEMAND, RESERVED, PriceBookHistory
from gpucloud.ledger.schemas import AllocationEventOut
from gpucloud.ledger.tables import allocation_events, billing_periods, postings, usage_samples

HeldKey = tuple[str, str, str, str, int]
"""(tenant_id, allocation_id, gpu_type, usage_period, price_version_id)"""


@dataclass(frozen=True, slots=True)
class HeldPiece:
    """One node's held time within one usage period and price version."""

    key: HeldKey
    gpu_ms: int


def held_pieces(
    events: Iterable[AllocationEventOut],
    *,
    horizon_ms: int,
    history: PriceBookHistory,
    sample_gpu_counts: dict[tuple[str, str], int],
    sample_gpu_types: dict[str, str],
) -> list[HeldPiece]:
    """Held GPU-ms before ``horizon_ms``, split at usage-period and price-version boundaries."""
    events = list(events)
    tenants = {event.allocation_id: event.tenant_id for event in events}
    gpu_types = dict(sample_gpu_types)
    gpu_counts: dict[tuple[str, str], int] = dict(sample_gpu_counts)
    for event in events:
        if event.gpu_type is not None:
            gpu_types[event.allocation_id] = event.gpu_type
        if event.kind == "node_added" and event.node_id is not None and event.gpu_count is not None:
            gpu_counts[(event.allocation_id, event.node_id)] = event.gpu_count
    pieces = []
    for allocation_id, timeline in timelines(events).items():
        gpu_type = gpu_types.get(allocation_id)
        if gpu_type is None:
            continue
        low = timeline.started_ms if timeline.started_ms is not None else 0
        high = min(horizon_ms, timeline.ended_ms if timeline.ended_ms is not None else horizon_ms)
        for node_id, intervals in timeline.node_intervals.items():
            gpu_count = gpu_counts.get((allocation_id, node_id))
            if gpu_count is None:
                continue
            for added, removed in intervals:
                start, end = max(added, low), min(high, removed if removed is not None else high)
                for piece_start, piece_end, usage_period, version_id in split_by_period_and_version(
                    start, end, history
                ):
                    key = (tenants[allocation_id], allocation_id, gpu_type, usage_period, version_id)
                    pieces.append(HeldPiece(key, (piece_end - piece_start) * gpu_count))
    return pieces


def split_by_period_and_version(start: int, end: int, history: PriceBookHistory) -> Iterable[tuple[int, int, str, int]]:
    """[start, end) cut where a usage period or a price version ends; time before any version is unpriced."""
    while start < end:
        usage_period = period_of(start)
        version, _, version_until = history.version_span(start)
        piece_end = min(end, period_bounds(usage_period)[1], version_until)
        if version is not None:
            yield start, piece_end, usage_period, version.version_id
        start = piece_end


def true_up(
    connection: Connection,
    period_id: str,
    *,
    horizon_ms: int,
    history: PriceBookHistory,
    tenant_id: str | None = None,
) -> list[LineAggregate]:
    """What to post so that every line of usage periods up to ``period_id`` bills held time.

    Looks at the allocations the control plane sent events for whose bill may still change:
    those not ended, ended in or after the period, with events recorded since the last close,
    or with usage booked into the period. Each result is one line's difference (GPU-ms and
    amount, either sign); lines already right are left out."""
    allocations = _open_to_change(connection, period_id, tenant_id)
    if not allocations:
        return []
    events = _events(connection, allocations)
    posted, marked = _posted(connection, allocations)
    classes = allocation_classes(events)
    # Events from a control plane that named no GPU type or count: the samples' own, if any.
    named_type = {e.allocation_id for e in events if e.gpu_type is not None}
    unnamed = {e.allocation_id for e in events if e.allocation_id not in named_type}
    unnamed |= {e.allocation_id for e in events if e.kind == "node_added" and e.gpu_count is None}
    counts, types = _sample_shapes(connection, sorted(unnamed)) if unnamed else ({}, {})
    held: dict[HeldKey, list[int]] = defaultdict(lambda: [0, 0])
    for piece in held_pieces(
        events, horizon_ms=horizon_ms, history=history, sample_gpu_counts=counts, sample_gpu_types=types
    ):
        held[piece.key][0] += piece.gpu_ms
        held[piece.key][1] += 1
    result = []
    for key in sorted(set(held) | set(posted)):
        tenant, allocation, gpu_type, usage_period, version_id = key
        if usage_period > period_id:
            continue
        price_class = classes.get(allocation, ON_DEMAND)
        rate = history.by_id(version_id).rate_for(tenant, gpu_type, price_class)
        if rate is None:
            continue
        held_ms, pieces = held.get(key, (0, 0))
        # A reserved allocation's time is billed on its reservation, not again here.
        billed_ms = 0 if price_class == RESERVED else held_ms
        posted_ms, posted_amount = posted.get(key, (0, 0))
        gpu_ms, amount = billed_ms - posted_ms, rate.amount_for(billed_ms) - posted_amount
        # The class is read off the line's held posting: a line whose meters happened to match
        # gets a posting of nothing that says it.
        names_class = price_class != ON_DEMAND and billed_ms and key not in marked
        if gpu_ms or amount or names_class:
            result.append(
                LineAggregate(
                    tenant, allocation, gpu_type, usage_period, version_id, pieces, gpu_ms, amount, "held", price_class
                )
            )
    return result


def allocation_classes(events: Iterable[AllocationEventOut]) -> dict[str, str]:
    """Each allocation's price class, as its first ``start`` event names it (none: on_demand)."""
    classes: dict[str, str] = {}
    for event in sorted(events, key=lambda e: e.id):
        if event.kind == "start" and event.allocation_id not in classes:
            classes[event.allocation_id] = event.price_class or ON_DEMAND
    return classes


def _open_to_change(connection: Connection, period_id: str, tenant_id: str | None) -> list[str]:
    period_start, _ = period_bounds(period_id)
    last_close = connection.execute(select(func.max(billing_periods.c.closed_ms))).scalar() or 0
    ended_at = func.max(case((allocation_events.c.kind == "end", allocation_events.c.at_ms)))
    query = select(allocation_events.c.allocation_id).group_by(allocation_events.c.allocation_id)
    query = query.having(
        (ended_at.is_(None)) | (ended_at >= period_start) | (func.max(allocation_events.c.recorded_ms) >= last_close)
    )
    booked = select(postings.c.allocation_id).where(
        postings.c.billing_period == period_id, postings.c.kind == "usage", postings.c.source != "reserved"
    )
    if tenant_id is not None:
        query = query.where(allocation_events.c.tenant_id == tenant_id)
        booked = booked.where(postings.c.tenant_id == tenant_id)
    found = set(connection.execute(query).scalars())
    recent = set(connection.execute(booked.distinct()).scalars())
    if recent - found:
        # Usage booked into the period for allocations with events that did not qualify above.
        tracked = select(allocation_events.c.allocation_id).where(
            allocation_events.c.allocation_id.in_(sorted(recent - found))
        )
        found |= set(connection.execute(tracked.distinct()).scalars())
    return sorted(found)


def _events(connection: Connection, allocations: list[str]) -> list[AllocationEventOut]:
    rows = connection.execute(
        select(allocation_events)
        .where(allocation_events.c.allocation_id.in_(allocations))
        .order_by(allocation_events.c.at_ms, allocation_events.c.id)
    ).mappings()
    return [AllocationEventOut(**row) for row in rows]


def _posted(connection: Connection, allocations: list[str]) -> tuple[dict[HeldKey, tuple[int, int]], set[HeldKey]]:
    """GPU-ms and amount posted per line so far: usage postings (meters and true-ups), not
    reversals nor reservations; and the lines that have a true-up."""
    columns = (
        postings.c.tenant_id,
        postings.c.allocation_id,
        postings.c.gpu_type,
        postings.c.usage_period,
        postings.c.price_version_id,
    )
    trued_up = func.count().filter(postings.c.source == "held")
    rows = connection.execute(
        select(*columns, func.sum(postings.c.gpu_ms), func.sum(postings.c.amount_micro), trued_up)
        .where(postings.c.allocation_id.in_(allocations), postings.c.kind == "usage", postings.c.source != "reserved")
        .group_by(*columns)
    )
    posted, marked = {}, set()
    for row in rows:
        key = tuple(row[:5])
        posted[key] = (int(row[5]), int(row[6]))
        if row[7]:
            marked.add(key)
    return posted, marked


def _sample_shapes(connection: Connection, allocations: list[str]) -> tuple[dict[tuple[str, str], int], dict[str, str]]:
    """The GPU count each node's samples report and each allocation's GPU type, for events without them."""
    counts: dict[tuple[str, str], int] = {}
    types: dict[str, str] = {}
    rows = connection.execute(
        select(
            usage_samples.c.allocation_id,
            usage_samples.c.node_id,
            usage_samples.c.gpu_type,
            func.max(usage_samples.c.gpu_count),
        )
        .where(usage_samples.c.allocation_id.in_(allocations))
        .group_by(usage_samples.c.allocation_id, usage_samples.c.node_id, usage_samples.c.gpu_type)
    )
    for allocation_id, node_id, gpu_type, gpu_count in rows:
        counts[(allocation_id, node_id)] = int(gpu_count)
        types[allocation_id] = gpu_type
    return counts, types
