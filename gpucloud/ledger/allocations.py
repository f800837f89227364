"""Allocation lifecycle events as the ledger knows them: start, node added, node removed, end.

The control plane sends them so the ledger can reject usage for allocations it has never
heard of and reconcile metered usage against allocated time. Events are idempotent on
``event_id``: the same event again is acknowledged, a different event under the same id is a
conflict. All events of one allocation belong to one tenant. A ``start`` event may name the
allocation's price class (on_demand, reserved, preemptible; none is on_demand), which decides
the price its held time is billed at (``held.py``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import Connection, insert, select

from gpucloud.ledger import problems
from gpucloud.ledger.schemas import AllocationEventIn, AllocationEventOut
from gpucloud.ledger.tables import allocation_events

_CONTENT = ("allocation_id", "tenant_id", "kind", "at_ms", "node_id", "gpu_type", "gpu_count")


def record_event(connection: Connection, event: AllocationEventIn, *, now_ms: int) -> AllocationEventOut:
    """Store one event; call inside the ledger's write transaction."""
    if event.kind in ("node_added", "node_removed") and event.node_id is None:
        raise problems.LedgerProblem(problems.REQUEST_INVALID(f"a {event.kind} event names its node", field="node_id"))
    if event.kind != "start" and event.price_class is not None:
        raise problems.LedgerProblem(
            problems.REQUEST_INVALID("only a start event names the allocation's price class", field="price_class")
        )
    existing = (
        connection.execute(select(allocation_events).where(allocation_events.c.event_id == event.event_id))
        .mappings()
        .first()
    )
    if existing is not None:
        same_class = (existing["price_class"] or "on_demand") == (event.price_class or "on_demand")
        if not same_class or any(existing[name] != getattr(event, name) for name in _CONTENT):
            raise problems.LedgerProblem(
                problems.STATE_CONFLICT(f"event {event.event_id} was recorded with different content", field="event_id")
            )
        return AllocationEventOut(**existing, replayed=True)
    owner = connection.execute(
        select(allocation_events.c.tenant_id).where(allocation_events.c.allocation_id == event.allocation_id).limit(1)
    ).scalar_one_or_none()
    if owner is not None and owner != event.tenant_id:
        raise problems.LedgerProblem(
            problems.STATE_CONFLICT(f"allocation {event.allocation_id} belongs to another tenant", field="tenant_id")
        )
    row = {**event.model_dump(), "recorded_ms": now_ms}
    event_id = connection.execute(insert(allocation_events).returning(allocation_events.c.id), row).scalar_one()
    return AllocationEventOut(**row, id=event_id)


def list_events(connection: Connection, *, tenant_id: str, allocation_id: str | None) -> list[AllocationEventOut]:
    query = select(allocation_events).where(allocation_events.c.tenant_id == tenant_id)
    if allocation_id is not None:
        query = query.where(allocation_events.c.allocation_id == allocation_id)
    rows = connection.execute(query.order_by(allocation_events.c.at_ms, allocation_events.c.id)).mappings()
    return [AllocationEventOut(**row) for row in rows]


@dataclass
class AllocationTimeline:
    """When an allocation held which node, from its events; None bounds are open-ended."""

    allocation_id: str
    started_ms: int | None = None
    ended_ms: int | None = None
    node_intervals: dict[str, list[tuple[int, int | None]]] = field(default_factory=lambda: defaultdict(list))


def timelines(events: list[AllocationEventOut]) -> dict[str, AllocationTimeline]:
    """Fold events (in time order) into one timeline per allocation."""
    result: dict[str, AllocationTimeline] = {}
    for event in sorted(events, key=lambda e: (e.at_ms, e.id)):
        timeline = result.setdefault(event.allocation_id, AllocationTimeline(event.allocation_id))
        if event.kind == "start":
            timeline.started_ms = event.at_ms if timeline.started_ms is None else min(timeline.started_ms, event.at_ms)
        elif event.kind == "end":
            timeline.ended_ms = event.at_ms
        elif event.node_id is None:  # node events always name their node (checked at ingest)
            continue
        elif event.kind == "node_added":
            intervals = timeline.node_intervals[event.node_id]
            if not intervals or intervals[-1][1] is not None:
                intervals.append((event.at_ms, None))
        else:
            intervals = timeline.node_intervals[event.node_id]
            if intervals and intervals[-1][1] is None:
                intervals[-1] = (intervals[-1][0], event.at_ms)
    return result
