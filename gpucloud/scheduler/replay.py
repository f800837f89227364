"""A GPU-cluster trace replayed through the scheduling policy, in process (issue 43, measurement).

A discrete-event simulation of one pool of `nodes` nodes in fabric domains of `domain_size`.
Events are a job's submission, its completion (its `runtime_s` after its work starts), a
preempted allocation's release (`preemption_notice_s + grace_s` after the preemption), and a
capacity reservation's four instants (hold: `start - lead_time_s`, notice: `start -
preemption_notice_s`, start, end). After the events of one instant are applied, `decide()` is
called on the whole state and what it decides is carried out, as the workflows would:

- a placement takes its nodes at once; its work starts then, or, if it preempts, when its
  victims have released the nodes (`preemption_notice_s + grace_s` later); it ends `runtime_s`
  after it starts. Requests carry `expected_duration_s` = the true runtime (perfect estimates),
  or the runtime times a seeded log-normal factor with `estimate_noise` as its sigma;
- a preempted allocation keeps working until it releases its nodes; its job is queued again
  (same tenant, same submission time, tier preemptible) with what is left of its runtime, as a
  job that checkpoints would be; the released nodes not taken by the placement that preempted
  them are held (`Node.held`) until the release;
- a reservation placed (tier `reserved`) holds its nodes until its end.

Tenants' usage (`TenantShare.usage_node_s`) is the node-seconds their allocations held, decayed
with the policy's half-life, as of each decision. Each replay checks as it goes that no node is
in two allocations at once (`ReplayError` otherwise) and records every node's work intervals.

`fifo=True` replays the same trace through `fifo_decide` instead: strict first come, first
served with the same gang-in-one-domain constraint and best fit, no backfill (a queued head that
does not fit blocks everyone behind it), no fair share, no preemption; a reservation is a job
submitted at its start for its length, and a preemptible job an ordinary one.

`utilization_bound` is the fluid bound of the window [0, H]: every job's work arrives at its
submission (a reservation's at its start), as much of it as the job's own width could do by H
(`nodes × min(runtime_s, H - arrival)`: no job runs before it arrives or on more nodes than it
asks for), and the whole fleet serves the backlog at `nodes` node-seconds per second, with no
gang or fabric constraint (any job's work split across any nodes at any time) and perfect
knowledge. No schedule does more work in the window than this fluid server, so it bounds the
`utilization` of every replay, FIFO's and the policy's.

Utilization is over the window [0, `horizon_s`] (default: the last submission or reservation
start): node-seconds of work done in it / (`nodes × horizon_s`). Replays run until every job has
finished, so every job has a wait (`start - submit_s` of its first start).

Floor 0, like the policy: pure and stdlib only.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from gpucloud.scheduler.policy import (
    Allocation,
    CapacityReservation,
    Decision,
    Node,
    Placement,
    PolicySettings,
    Pool,
    QueuedRequest,
    SchedulerState,
    TenantShare,
    decayed_usage,
    decide,
)

POOL = Pool("replay", "sim")
TIERS = ("on_demand", "preemptible")


class TraceError(ValueError):
    """A trace line that is not a job: the message names the line and the field."""


class ReplayError(RuntimeError):
    """The replay found a decision it cannot carry out (a node given twice, an unknown node)."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One trace line. With `reserve_at_s` it is a capacity reservation made at `submit_s` for
    `nodes` nodes from `reserve_at_s` for `runtime_s`."""

    id: str
    submit_s: float
    nodes: int
    runtime_s: float
    tenant: str
    tier: str = "on_demand"
    reserve_at_s: float | None = None

    @property
    def is_reservation(self) -> bool:
        return self.reserve_at_s is not None

    @property
    def arrives_s(self) -> float:
        """When its work can first start: the submission, or the reservation's start."""
        return self.submit_s if self.reserve_at_s is None else self.reserve_at_s

    def to_json(self) -> str:
        line: dict[str, object] = {
            "submit_s": self.submit_s,
            "nodes": self.nodes,
            "runtime_s": self.runtime_s,
            "tenant": self.tenant,
        }
        if self.tier != "on_demand":
            line["tier"] = self.tier
        if self.reserve_at_s is not None:
            line["reserve_at_s"] = self.reserve_at_s
        return json.dumps(line)


def _number(line_no: int, data: dict, key: str, *, integer: bool = False, minimum: float = 0.0) -> float:
    if key not in data:
        raise TraceError(f"line {line_no}: field {key!r} is missing")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"line {line_no}: field {key!r} must be a finite number, not {value!r}")
    if integer and value != int(value):
        raise TraceError(f"line {line_no}: field {key!r} must be a whole number, not {value!r}")
    if value < minimum:
        raise TraceError(f"line {line_no}: field {key!r} must be at least {minimum:g}, not {value!r}")
    return float(value)


def parse_trace(lines: Iterable[str]) -> list[TraceJob]:
    """JSON lines `{"submit_s", "nodes", "runtime_s", "tenant"}` (optional `"tier"`: on_demand or
    preemptible; optional `"reserve_at_s"`: a capacity reservation), blank lines skipped. Job ids
    are `j<line number>`; the jobs come back in submission order."""
    jobs = []
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise TraceError(f"line {line_no}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise TraceError(f"line {line_no}: not a JSON object")
        unknown = set(data) - {"submit_s", "nodes", "runtime_s", "tenant", "tier", "reserve_at_s"}
        if unknown:
            raise TraceError(f"line {line_no}: field {sorted(unknown)[0]!r} is not a trace field")
        submit = _number(line_no, data, "submit_s")
        nodes = int(_number(line_no, data, "nodes", integer=True, minimum=1))
        runtime = _number(line_no, data, "runtime_s")
        if runtime <= 0:
            raise TraceError(f"line {line_no}: field 'runtime_s' must be positive, not {data['runtime_s']!r}")
        tenant = data.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            raise TraceError(f"line {line_no}: field 'tenant' must be a non-empty string, not {tenant!r}")
        tier = data.get("tier", "on_demand")
        if tier not in TIERS:
            raise TraceError(f"line {line_no}: field 'tier' must be one of {', '.join(TIERS)}, not {tier!r}")
        reserve_at = None
        if "reserve_at_s" in data:
            reserve_at = _number(line_no, data, "reserve_at_s", minimum=submit)
            if tier != "on_demand":
                raise TraceError(f"line {line_no}: field 'tier': a reservation has no tier, not {tier!r}")
        jobs.append(TraceJob(f"j{line_no}", submit, nodes, runtime, tenant, tier, reserve_at))
    return sorted(jobs, key=lambda j: (j.submit_s, j.id))


def fleet(nodes: int, domain_size: int, pool: Pool = POOL) -> tuple[Node, ...]:
    """`nodes` nodes in domains of `domain_size` (the last one smaller if it does not divide)."""
    if nodes < 1 or domain_size < 1:
        raise ValueError("nodes and domain_size must be positive")
    width = len(str(nodes - 1))
    return tuple(Node(f"n{i:0{width}d}", pool, f"d{i // domain_size:03d}") for i in range(nodes))


# ---- the FIFO baseline ------------------------------------------------------------------------


def fifo_decide(state: SchedulerState) -> Decision:
    """Strict FCFS, no backfill: the queue in (submitted_at, id) order; each request in turn is
    placed on the best-fit domain with `node_count` free nodes; the first that does not fit
    stops the walk. No fair share, no preemption, no reservations (see the module docstring)."""
    busy = {n for a in state.allocations for n in a.node_ids} | {n.id for n in state.nodes if n.held}
    domains: dict[str, list[str]] = defaultdict(list)
    for node in sorted(state.nodes, key=lambda n: n.id):
        if node.id not in busy:
            domains[node.fabric_domain].append(node.id)
    placements = []
    for r in sorted(state.queue, key=lambda r: (r.submitted_at, r.id)):
        fits = [(len(free), d) for d, free in domains.items() if len(free) >= r.node_count]
        if not fits:
            break
        _, domain = min(fits)
        taken, domains[domain] = domains[domain][: r.node_count], domains[domain][r.node_count :]
        placements.append(Placement(r.id, r.tenant, r.pool, tuple(taken), domain, r.tier))
    return Decision(placements=tuple(placements))


# ---- the replay -------------------------------------------------------------------------------


@dataclass
class JobRecord:
    """What became of one trace job (a reservation: `start` is when its nodes were all its)."""

    job: TraceJob
    start: float | None = None  # first start of work
    end: float | None = None  # last end of work
    preempted: int = 0
    backfilled: bool = False

    @property
    def wait_s(self) -> float | None:
        return None if self.start is None else self.start - self.job.arrives_s


@dataclass
class ReplayResult:
    nodes: int
    horizon_s: float
    records: dict[str, JobRecord]
    intervals: dict[str, list[tuple[float, float, str]]]  # node → (work start, work end, allocation)
    used_node_s: float  # work done within [0, horizon_s]
    preemptions: int
    decisions: int
    decide_s: float  # time spent in the decide function (wall, perf_counter)
    # The node-seconds each of `fair_tenants` held while all of them had on-demand requests
    # waiting (the fleet saturated for every one of them), and how long that was.
    saturated_node_s: dict[str, float]
    saturated_s: float
    end_s: float  # when the last job finished

    @property
    def utilization(self) -> float:
        return self.used_node_s / (self.nodes * self.horizon_s) if self.horizon_s > 0 else 0.0


@dataclass
class _Running:
    alloc: Allocation
    job: TraceJob
    work_start: float
    work_end: float
    token: int


@dataclass
class _Sim:
    settings: PolicySettings
    nodes: tuple[Node, ...]
    grace_s: float
    horizon_s: float
    fair_tenants: frozenset[str]
    now: float = 0.0
    seq: int = 0
    events: list[tuple[float, int, str, object]] = field(default_factory=list)
    queue: dict[str, QueuedRequest] = field(default_factory=dict)
    job_of: dict[str, TraceJob] = field(default_factory=dict)  # request id → the trace job
    remaining: dict[str, float] = field(default_factory=dict)  # request id → runtime left
    running: dict[str, _Running] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # node → allocation holding it
    held: dict[str, float] = field(default_factory=dict)  # node → release time (preempted, not re-placed)
    reservations: dict[str, CapacityReservation] = field(default_factory=dict)
    reservation_job: dict[str, TraceJob] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)
    records: dict[str, JobRecord] = field(default_factory=dict)
    intervals: dict[str, list[tuple[float, float, str]]] = field(default_factory=lambda: defaultdict(list))
    used_node_s: float = 0.0
    preemptions: int = 0
    saturated_node_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    saturated_s: float = 0.0
    requeues: int = 0
    heads: tuple[str, ...] = ()  # the last decision's heads, handed to the next (`SchedulerState.heads`)

    def push(self, at: float, kind: str, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def work(self, node: str, start: float, end: float, alloc_id: str) -> None:
        if end <= start:
            return
        self.intervals[node].append((start, end, alloc_id))
        self.used_node_s += max(0.0, min(end, self.horizon_s) - max(start, 0.0))

    def advance(self, to: float) -> None:
        """Account the interval [now, to), in which nothing changes."""
        dt = to - self.now
        if dt <= 0:
            return
        held_by: dict[str, int] = defaultdict(int)
        for r in self.running.values():
            held_by[r.alloc.tenant] += len(r.alloc.node_ids)
        half = self.settings.half_life_s
        for tenant in set(self.usage) | set(held_by):
            self.usage[tenant] = decayed_usage(self.usage.get(tenant, 0.0), self.now, to, half) + held_by[tenant] * dt
        if self.fair_tenants and self.fair_tenants <= {r.tenant for r in self.queue.values() if r.tier == "on_demand"}:
            self.saturated_s += dt
            for tenant in self.fair_tenants:
                self.saturated_node_s[tenant] += held_by[tenant] * dt
        self.now = to

    def state(self) -> SchedulerState:
        nodes = tuple(replace(n, held=True, held_until=self.held[n.id]) if n.id in self.held else n for n in self.nodes)
        shares = tuple(TenantShare(t, POOL, 1.0, u, self.now) for t, u in sorted(self.usage.items()))
        return SchedulerState(
            now=self.now,
            nodes=nodes,
            allocations=tuple(r.alloc for r in self.running.values()),
            queue=tuple(self.queue.values()),
            reservations=tuple(self.reservations.values()),
            shares=shares,
            settings=self.settings,
            heads=self.heads,
        )

    def release_delay(self) -> float:
        return self.settings.preemption_notice_s + self.grace_s

    def start_running(self, alloc: Allocation, job: TraceJob, work_start: float, runtime: float) -> None:
        for n in alloc.node_ids:
            if n in self.owner or n in self.held:
                raise ReplayError(f"{alloc.id}: node {n} is already in {self.owner.get(n, 'a release')}")
            self.owner[n] = alloc.id
        self.seq += 1
        run = _Running(alloc, job, work_start, work_start + runtime, self.seq)
        self.running[alloc.id] = run
        self.push(run.work_end, "end", (alloc.id, run.token))

    def finish(self, alloc_id: str, at: float) -> None:
        run = self.running.pop(alloc_id)
        for n in run.alloc.node_ids:
            if self.owner.get(n) == alloc_id:
                del self.owner[n]
            self.work(n, run.work_start, at, alloc_id)
        rec = self.records[run.job.id]
        rec.end = at if rec.end is None else max(rec.end, at)


def _noisy(runtime: float, sigma: float, rng: random.Random) -> float:
    return runtime if sigma <= 0 else runtime * math.exp(rng.gauss(0.0, sigma))


def replay(
    jobs: Sequence[TraceJob],
    nodes: tuple[Node, ...],
    *,
    settings: PolicySettings | None = None,
    fifo: bool = False,
    grace_s: float = 30.0,
    estimate_noise: float = 0.0,
    seed: int = 0,
    horizon_s: float | None = None,
    fair_tenants: Iterable[str] = (),
    decide_fn: Callable[[SchedulerState], Decision] | None = None,
    clock: Callable[[], float] | None = None,
    keep_heads: bool = False,
) -> ReplayResult:
    """Replay `jobs` on `nodes` (see the module docstring) until every job has finished.
    `keep_heads`: hand each decision's heads to the next (`SchedulerState.heads`)."""
    settings = settings or PolicySettings()
    decide_fn = decide_fn or (fifo_decide if fifo else decide)
    if horizon_s is None:
        horizon_s = max((j.arrives_s for j in jobs), default=0.0)
    known = {n.id for n in nodes}
    rng = random.Random(seed)
    sim = _Sim(settings, nodes, grace_s, horizon_s, frozenset(fair_tenants))
    for job in jobs:
        sim.records[job.id] = JobRecord(job)
        if job.is_reservation and not fifo:
            sim.push(job.submit_s, "reserve", job)
            assert job.reserve_at_s is not None
            start, end = job.reserve_at_s, job.reserve_at_s + job.runtime_s
            for at in (start - settings.lead_time_s, start - settings.preemption_notice_s, start, end):
                if at > job.submit_s:
                    sim.push(at, "tick", None)
        else:
            sim.push(job.arrives_s, "submit", job)
    decisions, decide_s = 0, 0.0
    timer = clock or _perf_counter
    while sim.events:
        at = sim.events[0][0]
        sim.advance(at)
        while sim.events and sim.events[0][0] <= at:
            _, _, kind, payload = heapq.heappop(sim.events)
            if kind == "submit":
                assert isinstance(payload, TraceJob)
                job = payload
                expected = _noisy(job.runtime_s, estimate_noise, rng)
                tier = "on_demand" if job.is_reservation else job.tier
                sim.queue[job.id] = QueuedRequest(
                    job.id,
                    job.tenant,
                    POOL,
                    job.nodes,
                    job.arrives_s,
                    None,
                    expected,
                    tier,  # type: ignore[arg-type]
                )
                sim.job_of[job.id], sim.remaining[job.id] = job, job.runtime_s
            elif kind == "reserve":
                assert isinstance(payload, TraceJob) and payload.reserve_at_s is not None
                job = payload
                start = payload.reserve_at_s
                sim.reservations[job.id] = CapacityReservation(
                    job.id, job.tenant, POOL, job.nodes, start, start + job.runtime_s
                )
                sim.reservation_job[job.id] = job
            elif kind == "end":
                assert isinstance(payload, tuple)
                alloc_id, token = payload
                run = sim.running.get(alloc_id)
                if run is not None and run.token == token:
                    sim.finish(alloc_id, at)
                    sim.reservations.pop(alloc_id, None)
            elif kind == "freed":
                for n in payload:  # type: ignore[attr-defined]
                    if sim.held.get(n) == at:
                        del sim.held[n]
        started = timer()
        decision = decide_fn(sim.state())
        if keep_heads:
            sim.heads = tuple(h.request_id for h in decision.heads if h.start is not None)
        decide_s += timer() - started
        decisions += 1
        _apply(sim, decision, known, rng, estimate_noise)
    if sim.queue:
        raise ReplayError(f"{len(sim.queue)} requests never placed, e.g. {next(iter(sim.queue))}")
    end_s = max((r.end for r in sim.records.values() if r.end is not None), default=0.0)
    return ReplayResult(
        nodes=len(nodes),
        horizon_s=horizon_s,
        records=sim.records,
        intervals=dict(sim.intervals),
        used_node_s=sim.used_node_s,
        preemptions=sim.preemptions,
        decisions=decisions,
        decide_s=decide_s,
        saturated_node_s=dict(sim.saturated_node_s),
        saturated_s=sim.saturated_s,
        end_s=end_s,
    )


def _perf_counter() -> float:
    import time  # stdlib; the clock is only read to report where the replay's time goes

    return time.perf_counter()


def _apply(sim: _Sim, decision: Decision, known: set[str], rng: random.Random, noise: float) -> None:
    now = sim.now
    freed: dict[str, float] = {}  # node → when its preempted work releases it
    for p in decision.preemptions:
        run = sim.running.pop(p.allocation_id, None)
        if run is None:
            continue  # already preempted (preemptions are idempotent by id) or finished
        sim.preemptions += 1
        release = min(run.work_end, now + sim.release_delay())  # work goes on through the notice
        for n in run.alloc.node_ids:
            del sim.owner[n]
            sim.work(n, run.work_start, release, run.alloc.id)
            freed[n] = release
        rec = sim.records[run.job.id]
        rec.end = release if rec.end is None else max(rec.end, release)
        if run.work_end > release:  # queued again with what is left, as a job that checkpoints
            rec.preempted += 1
            sim.requeues += 1
            left = run.work_end - release
            rid = f"{run.job.id}#{sim.requeues}"
            expected = _noisy(left, noise, rng)
            sim.queue[rid] = QueuedRequest(
                rid, run.job.tenant, POOL, run.job.nodes, run.job.arrives_s, None, expected, "preemptible"
            )
            sim.job_of[rid], sim.remaining[rid] = run.job, left
    for placement in decision.placements:
        unknown = [n for n in placement.node_ids if n not in known]
        if unknown:
            raise ReplayError(f"{placement.id}: unknown nodes {unknown}")
        start = max([now] + [freed.get(n, now) for n in placement.node_ids])
        if placement.tier == "reserved":
            r = sim.reservations[placement.id]
            job = sim.reservation_job[placement.id]
            alloc = Allocation(placement.id, r.tenant, POOL, placement.node_ids, "reserved", r.end, reservation_id=r.id)
            sim.start_running(alloc, job, start, max(0.0, r.end - start))
        else:
            request = sim.queue.pop(placement.id, None)
            if request is None:
                raise ReplayError(f"{placement.id}: placed but not queued")
            job, left = sim.job_of.pop(placement.id), sim.remaining.pop(placement.id)
            duration = request.expected_duration_s
            end = None if duration is None else start + duration
            alloc = Allocation(placement.id, request.tenant, POOL, placement.node_ids, placement.tier, end)
            sim.start_running(alloc, job, start, left)
            if placement.backfilled:
                sim.records[job.id].backfilled = True
        rec = sim.records[job.id]
        if rec.start is None:
            rec.start = start
    for n, release in freed.items():
        if n not in sim.owner and release > now:
            sim.held[n] = release
            sim.push(release, "freed", (n,))
    for e in decision.expired:
        sim.queue.pop(e.request_id, None)
    for alloc_id in decision.ended:
        if alloc_id in sim.running:
            sim.finish(alloc_id, now)
            sim.reservations.pop(alloc_id, None)


def fluid_bound(jobs: Iterable[TraceJob], nodes: int, horizon_s: float) -> float:
    """`utilization_bound` (see the module docstring): the fluid fleet's work in [0, horizon_s]
    over `nodes × horizon_s`. Work `nodes × min(runtime_s, horizon_s - arrives_s)` arrives at
    each job's `arrives_s`; the backlog drains at `nodes` per second."""
    if horizon_s <= 0 or nodes <= 0:
        return 0.0
    arrivals = sorted(
        (j.arrives_s, j.nodes * min(j.runtime_s, horizon_s - j.arrives_s)) for j in jobs if j.arrives_s < horizon_s
    )
    backlog, done, t = 0.0, 0.0, 0.0
    for at, work in [*arrivals, (horizon_s, 0.0)]:
        served = min(backlog, nodes * (max(at, 0.0) - t))
        done += served
        backlog -= served
        t = max(at, t)
        backlog += work
    return done / (nodes * horizon_s)


def jain_fairness(node_s: dict[str, float], tenants: Iterable[str]) -> float | None:
    """Jain's index (Σx)² / (n Σx²) of the node-seconds of `tenants` (equal shares): 1 when all
    got the same, 1/n when one got everything; None for fewer than two tenants or no use."""
    x = [node_s.get(t, 0.0) for t in tenants]
    if len(x) < 2 or sum(x) <= 0:
        return None
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x))
