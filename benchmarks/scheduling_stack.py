"""A sample of a scheduling trace through the real stack (issue 43's `stack_matches_policy`), for
`benchmarks/scheduling.py --stack N` and the integration test tests/allocations/test_stack_policy.py.

`compress` takes N consecutive on-demand requests of a trace (reservations and preemptible work
left out) from a given instant, and compresses time: runtimes by a factor c, submission gaps by
c / `fleet_ratio` (the trace's fleet over the stack's, so a smaller stack fleet sees the same load),
with c chosen so the submissions span `span_s` seconds. Runtimes become whole seconds (the API's
`expected_duration_s` is an integer), at least one and at most `max_runtime_s` (so the trace's
day-long tail does not hold the run open for long after the rest has ended).

`drive` runs the compressed sample against a running stack: each request is created through the
HTTP API at its compressed submission time, `capacity: {wait: queue}` with `expected_duration_s`
= its compressed runtime, under its trace tenant's API key; the database is read every `watch_s`
for allocations that became ready (and for the queue's head, which the next plan keeps first), and
each is cancelled through the API its runtime after that.
When every request has ended (released, or failed with a reason) and the fleet is back to
`available`, the rows are read: each request's submission (`created_at`) and placement
(`placed_at`, written by the plan that placed it), what each placement took (the `ready` and
`cancel_requested` events, each node's next transition to `available`), and the invariants:

- `node_overlaps`: nodes reserved for an allocation while another still held them: in each
  node's transitions, in the order they were written, a reservation (`op_id` `reserve-<id>`)
  with no return to `available` since the one before (clock-free: the `released` event comes
  after the nodes are released, and a node wiped in no time may be placed again before it);
- `unresolved`: requests neither placed and released nor failed with a reason;
- `gangs_outside_one_domain`: allocations whose nodes are not `node_count` nodes of its
  `fabric_domain`.

Helper, not a benchmark of its own (benchmarks/smoke.py's HELPERS).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.models.health_tables import AllocationEvent
from gpucloud.models.tables import Allocation, Node, NodeTransition
from gpucloud.scheduler.replay import TraceJob
from gpucloud.scheduler.stack_check import AllocationRecord, NodeRecord, SampleRequest, Service, reserved_while_held

TERMINAL = {"released", "failed"}
RETRY_STATUSES = {429, 503}


@dataclass(frozen=True)
class Compressed:
    requests: list[SampleRequest]
    factor: float  # trace seconds per compressed second, for runtimes
    trace_span_s: float  # the sample's submissions' span in the trace


def compress(
    jobs: Sequence[TraceJob],
    n: int,
    *,
    since_s: float,
    span_s: float,
    fleet_ratio: float,
    max_runtime_s: float | None = None,
) -> Compressed:
    """N on-demand requests of the trace from `since_s`, time compressed (see the module docstring),
    each compressed runtime cut at `max_runtime_s`."""
    picked = [j for j in jobs if not j.is_reservation and j.tier == "on_demand" and j.submit_s >= since_s][:n]
    if len(picked) < n:
        raise ValueError(f"the trace has {len(picked)} on-demand requests from {since_s:g} s, not {n}")
    first = picked[0].submit_s
    trace_span = max(picked[-1].submit_s - first, 1.0)
    factor = trace_span * fleet_ratio / span_s
    requests = [
        SampleRequest(
            id=j.id,
            tenant=j.tenant,
            nodes=j.nodes,
            submit_s=round((j.submit_s - first) * fleet_ratio / factor, 3),
            expected_s=float(max(1, min(round(j.runtime_s / factor), max_runtime_s or math.inf))),
        )
        for j in picked
    ]
    return Compressed(requests, factor, trace_span)


@dataclass
class StackRun:
    """What the stack did with the sample (times in seconds from the run's start)."""

    allocation_of: dict[str, str]  # request id -> allocation id
    submitted: dict[str, float]
    placed: dict[str, float | None]
    services: dict[str, Service]
    failures: dict[str, str]  # request id -> failure reason (expired) or the create's refusal
    node_overlaps: int
    unresolved: list[str]
    gangs_outside_one_domain: list[str]
    wall_s: float
    api_errors: int = 0
    # The rows as `stack_check.audit` reads them (the sample's allocations, the pool's nodes).
    allocations: list[AllocationRecord] = field(default_factory=list)
    nodes: list[NodeRecord] = field(default_factory=list)
    # The queue's head as the stack's plans left it, at each watch that saw it change: the queued
    # allocations at position 1 with a promised start, which the next plan keeps first.
    heads: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)


def _rel(at: datetime | None, t0: datetime) -> float | None:
    if at is None:
        return None
    at = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    return (at - t0).total_seconds()


async def _send(call: Callable[[], object], *, patience_s: float = 60.0) -> httpx.Response:
    """The call's answer, sent again (same Idempotency-Key) through overload and dropped connections."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            resp = await call()  # type: ignore[misc]
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
            continue
        if resp.status_code not in RETRY_STATUSES or time.monotonic() > deadline:
            return resp
        await asyncio.sleep(min(float(resp.headers.get("Retry-After", "0.5")), 1.0))


async def drive(
    api_url: str,
    db_url: str,
    keys: dict[str, str],
    sample: Sequence[SampleRequest],
    *,
    gpu_type: str = "H100",
    region: str = "us-east-1",
    watch_s: float = 0.2,
    timeout_s: float = 1800.0,
    log: Callable[[str], None] = lambda _: None,
) -> StackRun:
    """Run the sample through the stack at `api_url` (see the module docstring)."""
    engine = sa.create_engine(db_url)
    run = uuid.uuid4().hex[:8]
    allocation_of: dict[str, str] = {}
    refused: dict[str, str] = {}
    runtime = {r.id: r.expected_s for r in sample}
    errors = 0
    t0 = datetime.now(UTC)
    started = time.monotonic()
    deadline = started + timeout_s
    async with httpx.AsyncClient(base_url=api_url, timeout=60) as http:

        async def create(r: SampleRequest) -> None:
            nonlocal errors
            body = {
                "gpu_type": gpu_type,
                "region": region,
                "node_count": r.nodes,
                "capacity": {"wait": "queue"},
                "expected_duration_s": int(r.expected_s),
            }
            headers = {"Authorization": f"Bearer {keys[r.tenant]}", "Idempotency-Key": f"stack-{run}-{r.id}"}
            resp = await _send(lambda: http.post("/v1/allocations", json=body, headers=headers))
            if resp.status_code in (201, 202):
                allocation_of[r.id] = resp.json()["allocation"]["id"]
            else:
                errors += 1
                refused[r.id] = f"create answered {resp.status_code}: {resp.text[:300]}"

        async def cancel(r_id: str, at: float) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tenant = next(r.tenant for r in sample if r.id == r_id)
            headers = {"Authorization": f"Bearer {keys[tenant]}"}
            resp = await _send(lambda: http.post(f"/v1/allocations/{allocation_of[r_id]}/cancel", headers=headers))
            if resp.status_code != 202:
                errors += 1
                log(f"  cancel of {r_id} answered {resp.status_code}: {resp.text[:200]}")

        async def submit_all() -> None:
            tasks = []
            for r in sorted(sample, key=lambda r: r.submit_s):
                await asyncio.sleep(max(0.0, started + r.submit_s - time.monotonic()))
                tasks.append(asyncio.create_task(create(r)))
            await asyncio.gather(*tasks)

        submitter = asyncio.create_task(submit_all())
        cancels: dict[str, asyncio.Task] = {}
        request_of: dict[str, str] = {}
        ended: set[str] = set()
        heads: list[tuple[float, tuple[str, ...]]] = []
        last_log = 0.0
        while True:
            if time.monotonic() > deadline:
                submitter.cancel()
                raise TimeoutError(
                    f"the sample did not finish within {timeout_s:g} s: {len(ended)} of {len(sample)} ended"
                )
            request_of.update({a: r for r, a in allocation_of.items()})
            watching = [a for a in request_of if a not in ended]
            if watching:
                with engine.connect() as conn:
                    rows = conn.execute(
                        sa.select(
                            col(Allocation.id),
                            col(Allocation.status),
                            col(Allocation.queue_position),
                            col(Allocation.estimated_start_at),
                        ).where(col(Allocation.id).in_(watching))
                    ).all()
                seen_at = _rel(datetime.now(UTC), t0) or 0.0
                head = tuple(sorted(a for a, status, pos, est in rows if status == "queued" and pos == 1 and est))
                if not heads or heads[-1][1] != head:
                    heads.append((seen_at, head))
                for alloc_id, status, _, _ in rows:
                    r_id = request_of[alloc_id]
                    if status == "ready" and r_id not in cancels:
                        cancels[r_id] = asyncio.create_task(cancel(r_id, time.monotonic() + runtime[r_id]))
                    if status in TERMINAL:
                        ended.add(alloc_id)
            if submitter.done() and len(ended) + len(refused) >= len(sample):
                break
            if time.monotonic() - last_log > 15:
                last_log = time.monotonic()
                log(
                    f"  stack sample: {time.monotonic() - started:.0f} s, {len(allocation_of)} created,"
                    f" {len(cancels)} ready, {len(ended)} ended of {len(sample)}"
                )
            await asyncio.sleep(watch_s)
        await submitter
        await asyncio.gather(*cancels.values())
    # The nodes' way back: wait until every node is available again (or out of service).
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            busy = conn.execute(
                sa.select(sa.func.count()).select_from(Node).where(col(Node.state).not_in(["available", "quarantined"]))
            ).scalar_one()
        if busy == 0:
            break
        await asyncio.sleep(watch_s)
    wall_s = time.monotonic() - started
    result = _read(engine, t0, allocation_of, refused, sample)
    result.wall_s, result.api_errors, result.heads = wall_s, errors, heads
    engine.dispose()
    return result


def _read(
    engine: sa.Engine,
    t0: datetime,
    allocation_of: dict[str, str],
    refused: dict[str, str],
    sample: Sequence[SampleRequest],
) -> StackRun:
    with Session(engine) as session:
        ids = list(allocation_of.values())
        allocs = {a.id: a for a in session.exec(select(Allocation).where(col(Allocation.id).in_(ids))).all()}
        events: dict[tuple[str, str], datetime] = {}
        for e in session.exec(
            select(AllocationEvent).where(
                col(AllocationEvent.allocation_id).in_(ids),
                col(AllocationEvent.kind).in_(["ready", "cancel_requested", "released"]),
            )
        ).all():
            events.setdefault((e.allocation_id, e.kind), e.at)
        pod_of = dict(session.execute(sa.select(col(Node.id), col(Node.pod))).all())
        back: dict[str, list[datetime]] = defaultdict(list)
        moves: dict[str, list[tuple[float, str]]] = defaultdict(list)
        written = session.execute(
            sa.select(
                col(NodeTransition.node_id),
                col(NodeTransition.at),
                col(NodeTransition.to_state),
                col(NodeTransition.op_id),
            ).order_by(col(NodeTransition.seq))
        ).all()
        for node_id, at, to_state, _ in written:
            moves[node_id].append((_rel(at, t0) or 0.0, to_state))
            if to_state == "available":
                back[node_id].append(at)
        overlaps = reserved_while_held([(node_id, to_state, op_id) for node_id, _, to_state, op_id in written])

    submitted: dict[str, float] = {}
    placed: dict[str, float | None] = {}
    services: dict[str, Service] = {}
    failures = dict(refused)
    unresolved: list[str] = []
    outside: list[str] = []
    for r in sample:
        alloc = allocs.get(allocation_of.get(r.id, ""))
        if alloc is None:
            placed[r.id] = None
            if r.id not in failures:
                unresolved.append(r.id)
            continue
        submitted[r.id] = _rel(alloc.created_at, t0) or 0.0
        placed[r.id] = _rel(alloc.placed_at, t0)
        if alloc.status == "failed":
            failures[r.id] = alloc.failure_reason or ""
            if not alloc.failure_reason:
                unresolved.append(r.id)
            continue
        ready = _rel(events.get((alloc.id, "ready")), t0)
        cancel = _rel(events.get((alloc.id, "cancel_requested")), t0)
        released = _rel(events.get((alloc.id, "released")), t0)
        start = placed[r.id]
        if alloc.status != "released" or start is None or ready is None or cancel is None or released is None:
            unresolved.append(r.id)
            continue
        if len(alloc.node_ids) != alloc.node_count or {pod_of.get(n) for n in alloc.node_ids} != {alloc.fabric_domain}:
            outside.append(r.id)
        returns = []
        for n in alloc.node_ids:
            later = [t for t in (_rel(at, t0) for at in back.get(n, [])) if t is not None and t >= cancel]
            returns.append((later[0] if later else released) - cancel)
        services[r.id] = Service(max(0.0, ready - start), max(0.0, cancel - ready), tuple(returns))
    records = []
    for alloc in allocs.values():
        terminal = alloc.status in TERMINAL
        records.append(
            AllocationRecord(
                id=alloc.id,
                tenant=alloc.tenant_id,
                node_count=alloc.node_count,
                expected_s=None if alloc.expected_duration_s is None else float(alloc.expected_duration_s),
                created=_rel(alloc.created_at, t0) or 0.0,
                placed=_rel(alloc.placed_at, t0),
                node_ids=tuple(alloc.node_ids),
                cancel_requested=_rel(events.get((alloc.id, "cancel_requested")), t0),
                ended=_rel(alloc.updated_at, t0) if terminal else None,
            )
        )
    node_records = [NodeRecord(n, pod, tuple(moves.get(n, ()))) for n, pod in sorted(pod_of.items())]
    return StackRun(
        allocation_of=dict(allocation_of),
        submitted=submitted,
        placed=placed,
        services=services,
        failures=failures,
        node_overlaps=overlaps,
        unresolved=unresolved,
        gangs_outside_one_domain=outside,
        wall_s=0.0,
        allocations=records,
        nodes=node_records,
    )
