"""The scheduling policy (issue 43) replayed in process over a GPU-cluster trace, beside strict
FIFO over the same trace in the same process, and the trace's fluid bound.

    python benchmarks/scheduling.py [--quick] [--trace FILE] [--nodes 256] [--domain-size 32]
                                    [--days 3] [--seed 1] [--estimate-noise 0] [--grace-s 30]
                                    [--lead-time-s 3600]
                                    [--write-trace FILE]
                                    [--stack N] [--stack-nodes 256] [--stack-span-s 300]

The engine is `gpucloud.scheduler.replay` (its docstring defines the replay, the FIFO baseline,
the fluid bound and the utilization window). Requests carry `expected_duration_s` = their true
runtime (perfect estimates) unless `--estimate-noise S` multiplies each by a seeded log-normal
factor of sigma S. The policy runs with its default `PolicySettings` but for `--lead-time-s`
(how long before its start a reservation's nodes are held back); a preempted allocation releases
its nodes `preemption_notice_s + --grace-s` after the preemption.

The trace. `--trace FILE` reads JSON lines `{"submit_s", "nodes", "runtime_s", "tenant"}`
(optional `"tier"`: on_demand or preemptible; optional `"reserve_at_s"`: a capacity reservation
of `nodes` from then for `runtime_s`). Without it the trace is synthetic: Microsoft's Philly
trace (github.com/msr-fiddle/philly-traces) holds its data as a 1.06 GB Git LFS object
(`trace-data.tar.gz`) that could not be fetched here (only the LFS pointer is in the repository),
so the jobs are drawn, seeded, from the distributions published with it in Jeon et al.,
"Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads", USENIX ATC 2019,
as read approximately off its plots (not the data; replace them with `--trace`):
- gang size: the paper buckets jobs by GPU count as 1, 2-4, 5-8 and >8 GPUs (Figs. 2 and 3);
  jobs of up to 8 GPUs are the great majority and a job of G GPUs asks for ceil(G/8) 8-GPU
  nodes, so 1-node gangs are 85% of jobs; the >8-GPU tail is spread over 2, 4, 8 and 16 nodes
  (16, 32, 64, 128 GPUs) as 7%, 4%, 2.5% and 1.5% (`NODE_MIX`);
- run time: Fig. 2 (CDF of run time per size bucket) spans minutes to weeks and larger jobs run
  longer: log-normal with a median of 40 minutes for 1-node gangs rising to 3 hours for 16-node
  ones, sigma 1.4, cut to [1 minute, 1 day] (`RUNTIME_MEDIAN_S`; the cut keeps a 3-day trace's
  load from hanging on a few draws);
- arrivals: Poisson per tenant (the paper gives no arrival-rate distribution to draw from);
  the rates are set from the fleet's size so that the offered load is `BASE_LOAD` of the fleet,
  then, over a saturation window of 12 hours from a quarter of the span, the three steady
  tenants offer 0.35 of the fleet each while `flood` floods the queue (a burst of jobs worth a
  quarter of the window's capacity, in its first hour, on top of its steady share), so fair share
  and backfill matter; the backlog drains over the following day.
Tenants `flood`, `steady1..3` have equal shares; `spot` submits preemptible 1-node work (a
tenth of the load) and `reserve` makes capacity reservations (8 or 16 nodes for 2 to 4 hours,
booked 12 hours ahead, some in the saturation window).

Figures (the last line is one JSON object of them, after a human table on stderr):
`utilization`, `fifo_utilization`, `utilization_bound`; `wait_p50_s`/`wait_p99_s` per gang size
class (1, 2, 3-4, 5-8, 9-16, 17-32, ... nodes) for the policy and FIFO; `jain_fairness` (and
FIFO's): Jain's index of the node-seconds the equal-share tenants held over the time all of them
had on-demand requests waiting (the fleet saturated for them); `reservations_on_time`: the share
of reservations whose nodes were all theirs at their start; `preemptions`; `decide_ms_mean`:
the policy's time per call. `targets_met` says which of the issue's targets hold.

The stack against the policy (`--stack N`, 0 by default: off). N consecutive on-demand requests of
the trace from the start of its saturation window (reservations and preemptible work left out)
go through the real stack: a private `gpucloud up` (Temporal dev server, worker, API, simulated
fleet of `--stack-nodes` nodes in pods of 32, SQLite, simulated latencies 0, `scheduler.poll_s`
0.5), time compressed so the submissions span `--stack-span-s` seconds (runtimes by the same
factor, cut at the span; submission gaps stretched by the trace's fleet over the stack's, so the
load is the trace's). Each request is created through the API at its time with `capacity: {wait:
queue}` and `expected_duration_s`, and cancelled its runtime after it became ready
(`benchmarks/scheduling_stack.py`). `stack_matches_policy` is the fraction of the sample placed as
the policy decided (`gpucloud.scheduler.stack_check.audit`): at each instant the stack placed
something, `decide()` is asked again on the pool's state rebuilt from the rows, and the placement
matches when that decision makes it too. `stack` holds the rest: `placed_late` (a decision that
stood unexecuted for more than `tolerance_s`), the invariants read from the database
(`node_overlaps`, `unresolved`, `gangs_outside_one_domain`, all 0 when met), `replay` (the whole
sample replayed through the policy alone on the stack's own service times and compared start by
start: order agreement, Kendall's tau, start differences), and the time per request. The target
`stack_matches_policy >= 0.99` also needs every invariant met. Without `--stack`,
`stack_matches_policy` is null. `--stack-records FILE` keeps the rows the audit read, as JSON.

`--quick`: 128 nodes in domains of 32, 2 days (the CI smoke run), and a stack sample of 48
requests on 32 nodes spanning 30 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gpucloud.scheduler.policy import PolicySettings
from gpucloud.scheduler.replay import (
    ReplayResult,
    TraceError,
    TraceJob,
    fleet,
    fluid_bound,
    jain_fairness,
    parse_trace,
    replay,
)

HOUR, DAY = 3600.0, 86400.0
NODE_MIX = ((1, 0.85), (2, 0.07), (4, 0.04), (8, 0.025), (16, 0.015))
RUNTIME_MEDIAN_S = {1: 40 * 60.0, 2: 60 * 60.0, 4: 90 * 60.0, 8: 2 * HOUR, 16: 3 * HOUR}
RUNTIME_SIGMA = 1.4
RUNTIME_RANGE_S = (60.0, DAY)
BASE_LOAD = 0.7  # of the fleet, over the whole trace (the spot tenant's tenth included)
WINDOW_S = 12 * HOUR  # the saturation window
WINDOW_LOAD = 0.35  # of the fleet, each steady tenant's in the window
FLOOD = 0.25  # of the window's capacity, the flood's burst
FAIR_TENANTS = ("flood", "steady1", "steady2", "steady3")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _mean_runtime(nodes: int) -> float:
    """The mean of the cut log-normal, by sampling once (seeded): for setting arrival rates."""
    rng = random.Random(12345)
    lo, hi = RUNTIME_RANGE_S
    draws = [
        min(hi, max(lo, rng.lognormvariate(math.log(RUNTIME_MEDIAN_S[nodes]), RUNTIME_SIGMA))) for _ in range(4000)
    ]
    return sum(draws) / len(draws)


def synthetic_trace(nodes: int, days: float, seed: int, *, max_gang: int) -> list[TraceJob]:
    """The Philly-shaped trace described in the module docstring."""
    rng = random.Random(seed)
    mix = [(n, p) for n, p in NODE_MIX if n <= max_gang]
    total_p = sum(p for _, p in mix)
    mix = [(n, p / total_p) for n, p in mix]
    mean_work = sum(p * n * _mean_runtime(n) for n, p in mix)  # node-seconds per on-demand job
    horizon = days * DAY
    window = (0.25 * horizon, 0.25 * horizon + WINDOW_S)

    def gang() -> int:
        x, acc = rng.random(), 0.0
        for n, p in mix:
            acc += p
            if x < acc:
                return n
        return mix[-1][0]

    def runtime(n: int) -> float:
        lo, hi = RUNTIME_RANGE_S
        return round(min(hi, max(lo, rng.lognormvariate(math.log(RUNTIME_MEDIAN_S[n]), RUNTIME_SIGMA))), 1)

    lines: list[tuple[float, int, float, str, str, float | None]] = []
    capacity = nodes  # node-seconds per second
    # Steady tenants: BASE_LOAD × 0.9 of the fleet among the four, WINDOW_LOAD each in the window.
    for tenant in FAIR_TENANTS:
        t = 0.0
        while True:
            steady = window[0] <= t < window[1] and tenant != "flood"
            load = WINDOW_LOAD if steady else BASE_LOAD * 0.9 / len(FAIR_TENANTS)
            t += rng.expovariate(load * capacity / mean_work)
            if t >= horizon:
                break
            n = gang()
            lines.append((t, n, runtime(n), tenant, "on_demand", None))
    # The flood: FLOOD of the window's capacity, submitted over its first hour.
    flood_work, work = FLOOD * capacity * (window[1] - window[0]), 0.0
    while work < flood_work:
        n = gang()
        r = runtime(n)
        lines.append((window[0] + rng.random() * HOUR, n, r, "flood", "on_demand", None))
        work += n * r
    # Spot: preemptible 1-node work, a tenth of the base load.
    t, spot_mean = 0.0, _mean_runtime(1)
    while True:
        t += rng.expovariate(BASE_LOAD * 0.1 * capacity / spot_mean)
        if t >= horizon:
            break
        lines.append((t, 1, runtime(1), "spot", "preemptible", None))
    # Reservations: every 8 hours from the 12th, booked 12 hours ahead.
    at = 12 * HOUR
    while at < horizon - 4 * HOUR:
        size = min(rng.choice((8, 16)), max_gang)
        lines.append((at - 12 * HOUR, size, rng.choice((2, 3, 4)) * HOUR, "reserve", "on_demand", at))
        at += 8 * HOUR
    lines.sort(key=lambda x: x[0])
    return [
        TraceJob(f"j{i}", round(s, 1), n, r, tenant, tier, None if res is None else round(res, 1))
        for i, (s, n, r, tenant, tier, res) in enumerate(lines, start=1)
    ]


def size_class(nodes: int) -> str:
    """1, 2, 3-4, 5-8, 9-16, ...: gangs by the power of two they round up to."""
    if nodes <= 2:
        return str(nodes)
    top = 1 << (nodes - 1).bit_length()
    return f"{top // 2 + 1}-{top}"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))  # nearest rank
    return round(ordered[k], 1)


def waits(result: ReplayResult) -> dict[str, dict[str, float | int | None]]:
    by_class: dict[str, list[float]] = {}
    for rec in result.records.values():
        if rec.job.is_reservation or rec.job.tier != "on_demand" or rec.wait_s is None:
            continue
        by_class.setdefault(size_class(rec.job.nodes), []).append(rec.wait_s)
    order = sorted(by_class, key=lambda c: int(c.split("-")[-1]))
    return {
        c: {"jobs": len(by_class[c]), "wait_p50_s": _pct(by_class[c], 0.5), "wait_p99_s": _pct(by_class[c], 0.99)}
        for c in order
    }


def one_node_p99_by_tenant(result: ReplayResult) -> dict[str, float | None]:
    """For reading the 1-node target: whose waits make the p99."""
    by_tenant: dict[str, list[float]] = {}
    for rec in result.records.values():
        if rec.job.nodes == 1 and not rec.job.is_reservation and rec.job.tier == "on_demand" and rec.wait_s is not None:
            by_tenant.setdefault(rec.job.tenant, []).append(rec.wait_s)
    return {t: _pct(w, 0.99) for t, w in sorted(by_tenant.items())}


def jain(result: ReplayResult) -> float | None:
    index = jain_fairness(result.saturated_node_s, FAIR_TENANTS) if result.saturated_s > 0 else None
    return None if index is None else round(index, 4)


def reservations_on_time(result: ReplayResult) -> tuple[float | None, int, list[float]]:
    """(share on time, how many, each one's start past its time in s: inf if never placed)."""
    resv = [r for r in result.records.values() if r.job.is_reservation]
    if not resv:
        return None, 0, []
    late = [(r.start - r.job.arrives_s) if r.start is not None else math.inf for r in resv]
    on_time = sum(1 for x in late if x <= 1e-6)
    return round(on_time / len(resv), 4), len(resv), late


SIM_POD = 32  # the simulated fleet's pods (fabric domains): 8 racks of 4 nodes
STACK_POLL_S = 0.5
STACK_READ_SLACK_S = 0.5  # how long after its `now` a plan may read its rows (`stack_check.audit`)
STACK_WATCH_S = 0.2  # how often the driver reads the rows (and the queue's head the next plan keeps)


def stack_figures(jobs: list[TraceJob], options: argparse.Namespace, *, since_s: float) -> dict:
    """A sample of the trace through a private stack and the policy (see the module docstring)."""
    import asyncio
    import shutil

    import httpx
    from common import bench_stack, bring_up_fleet, onboard_tenant
    from scheduling_stack import compress, drive

    from gpucloud.config import SchedulerSettings
    from gpucloud.scheduler.policy import Node, Pool
    from gpucloud.scheduler.stack_check import SampleRequest, audit, compare, replay_observed
    from gpucloud.services.scheduling import policy_settings

    sample = compress(
        jobs,
        options.stack,
        since_s=since_s,
        span_s=options.stack_span_s,
        fleet_ratio=options.nodes / options.stack_nodes,
        max_runtime_s=options.stack_span_s,
    )
    scheduler = SchedulerSettings(poll_s=STACK_POLL_S, queue_recheck_s=5.0)
    settings, stack, data_dir = bench_stack(options.stack_nodes, "memory", scheduler=scheduler.model_dump())
    try:
        log(f"stack: starting in {data_dir}")
        stack.start(on_step=lambda s: log(f"  {s}"))
        api = httpx.Client(
            base_url=settings.api_url, headers={"Authorization": f"Bearer {settings.operator_token}"}, timeout=120
        )
        import sqlalchemy as sa

        engine = sa.create_engine(settings.database_url)
        bring_up_fleet(api, settings, engine, options.stack_nodes)
        keys = {t: onboard_tenant(api, t) for t in sorted({r.tenant for r in sample.requests})}
        log(
            f"stack: {len(sample.requests)} requests on {options.stack_nodes} nodes, time compressed"
            f" {sample.factor:.0f}x, submissions over {options.stack_span_s:g} s"
        )
        started = time.monotonic()
        run = asyncio.run(
            drive(
                settings.api_url,
                settings.database_url,
                keys,
                sample.requests,
                watch_s=STACK_WATCH_S,
                timeout_s=3600.0,
                log=log,
            )
        )
        stack_s = time.monotonic() - started
        with engine.connect() as conn:
            pods = dict(conn.execute(sa.text("SELECT id, pod FROM node")).all())
        engine.dispose()
    finally:
        stack.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    pool = Pool("H100", "us-east-1")
    nodes = [Node(n, pool, pod) for n, pod in sorted(pods.items())]
    observed = [
        SampleRequest(r.id, r.tenant, r.nodes, run.submitted.get(r.id, r.submit_s), r.expected_s)
        for r in sample.requests
    ]
    settings_p = policy_settings(scheduler)
    if options.stack_records:
        options.stack_records.write_text(
            json.dumps(
                {
                    "allocations": [dataclasses.asdict(a) for a in run.allocations],
                    "nodes": [dataclasses.asdict(n) for n in run.nodes],
                    "sample": [dataclasses.asdict(r) for r in observed],
                    "allocation_of": run.allocation_of,
                    "services": {r: dataclasses.asdict(x) for r, x in run.services.items()},
                    "heads": run.heads,
                }
            )
        )
    started = time.monotonic()
    checked = audit(
        run.allocations,
        run.nodes,
        pool=pool,
        settings=settings_p,
        poll_s=STACK_POLL_S,
        tolerance_s=2 * STACK_POLL_S,
        read_slack_s=STACK_READ_SLACK_S,
        heads_seen=run.heads,
        watch_s=STACK_WATCH_S,
    )
    audit_s = time.monotonic() - started
    policy_starts = replay_observed(observed, nodes, run.services, settings=settings_p)
    agreement = compare(run.placed, policy_starts, tolerance_s=2 * STACK_POLL_S)
    log(
        f"stack: {stack_s:.0f} s; {checked.as_decided} of {checked.placed} placed as decided, {checked.late} late"
        f" ({checked.instants} decisions audited in {audit_s:.0f} s); whole-run replay: order"
        f" {agreement.order_matches:.4f}, kendall tau {agreement.kendall_tau}, start diff p99"
        f" {agreement.start_diff_p99_s}; overlaps {run.node_overlaps}, unresolved {len(run.unresolved)},"
        f" outside one domain {len(run.gangs_outside_one_domain)}"
    )
    waits = [p - run.submitted[r] for r, p in run.placed.items() if p is not None and r in run.submitted]

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    provision = sorted(s.provision_s for s in run.services.values())
    back = sorted(x for s in run.services.values() for x in s.return_s)
    return {
        "matches_policy": round(checked.matches, 4),
        "nodes": options.stack_nodes,
        "time_compression": round(sample.factor, 1),
        "span_s": options.stack_span_s,
        "tolerance_s": checked.tolerance_s,
        "read_slack_s": checked.read_slack_s,
        "placed": checked.placed,
        "placed_as_decided": checked.as_decided,
        "placed_late": checked.late,
        "decision_lag_p50_s": r3(checked.lag_p50_s),
        "decision_lag_p99_s": r3(checked.lag_p99_s),
        "decision_lag_max_s": r3(checked.lag_max_s),
        "decisions_audited": checked.instants,
        "not_decided_examples": list(checked.not_decided),
        "late_examples": list(checked.late_examples),
        "replay": {
            "order_matches": round(agreement.order_matches, 4),
            "placed_both": agreement.placed_both,
            "placed_stack_only": agreement.placed_stack_only,
            "placed_policy_only": agreement.placed_policy_only,
            "inversions": agreement.inversions,
            "kendall_tau": r3(agreement.kendall_tau),
            "start_diff_p50_s": r3(agreement.start_diff_p50_s),
            "start_diff_p99_s": r3(agreement.start_diff_p99_s),
            "start_diff_max_s": r3(agreement.start_diff_max_s),
            "mismatched_examples": list(agreement.mismatched),
        },
        "wait_p50_s": r3(_pct(waits, 0.5)),
        "wait_p99_s": r3(_pct(waits, 0.99)),
        "provision_p50_s": r3(_pct(provision, 0.5)),
        "return_p50_s": r3(_pct(back, 0.5)),
        "failures": len(run.failures),
        "api_errors": run.api_errors,
        "invariants": {
            "node_overlaps": run.node_overlaps,
            "unresolved": len(run.unresolved),
            "gangs_outside_one_domain": len(run.gangs_outside_one_domain),
        },
        "stack_run_s": round(stack_s, 1),
        "s_per_request": round(stack_s / len(sample.requests), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 nodes, domains of 32, 2 days")
    parser.add_argument("--trace", type=Path, help="JSON lines of jobs (default: the synthetic Philly-shaped trace)")
    parser.add_argument("--write-trace", type=Path, help="write the trace replayed as JSON lines")
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--domain-size", type=int, default=32)
    parser.add_argument("--days", type=float, default=3.0, help="the synthetic trace's span")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--estimate-noise", type=float, default=0.0, help="sigma of log(expected/true runtime)")
    parser.add_argument(
        "--lead-time-s",
        type=float,
        default=PolicySettings().lead_time_s,
        help="PolicySettings.lead_time_s: how long before its start a reservation's nodes are held",
    )
    parser.add_argument("--grace-s", type=float, default=30.0, help="a preempted allocation's stop, after its notice")
    parser.add_argument(
        "--keep-heads",
        action="store_true",
        help="hand each decision's heads to the next (SchedulerState.heads): a head keeps its reservation",
    )
    parser.add_argument("--stack", type=int, default=0, metavar="N", help="run N requests through the real stack")
    parser.add_argument("--stack-nodes", type=int, help="the stack's simulated fleet (default: --nodes)")
    parser.add_argument("--stack-span-s", type=float, default=300.0, help="the stack sample's submissions' span")
    parser.add_argument("--stack-records", type=Path, help="write the stack sample's rows as JSON (for reading)")
    options = parser.parse_args()
    if options.quick:
        options.nodes, options.domain_size, options.days = 128, 32, 2.0
        options.stack, options.stack_nodes, options.stack_span_s = 48, 32, 30.0
    if options.stack_nodes is None:
        options.stack_nodes = options.nodes
    if options.stack and (options.domain_size != SIM_POD or options.stack_nodes % SIM_POD):
        parser.error(
            f"--stack: the simulated fleet's pods are {SIM_POD} nodes: --domain-size {SIM_POD}, "
            f"--stack-nodes a multiple of it"
        )
    if options.stack < 0:
        parser.error("--stack: a number of requests, 0 or more")

    if options.trace:
        try:
            jobs = parse_trace(options.trace.read_text().splitlines())
        except TraceError as e:
            parser.error(f"--trace {options.trace}: {e}")
        source = f"file {options.trace}"
    else:
        jobs = synthetic_trace(options.nodes, options.days, options.seed, max_gang=options.domain_size)
        source = f"synthetic Philly-shaped (Jeon et al., ATC 2019), seed {options.seed}"
    too_big = [j for j in jobs if j.nodes > options.domain_size]
    if too_big:
        parser.error(f"{len(too_big)} jobs ask for more nodes than a fabric domain has, e.g. {too_big[0]}")
    if options.write_trace:
        options.write_trace.write_text("".join(j.to_json() + "\n" for j in jobs))
    nodes = fleet(options.nodes, options.domain_size)
    settings = PolicySettings(lead_time_s=options.lead_time_s)
    log(f"trace: {source}: {len(jobs)} jobs on {options.nodes} nodes in domains of {options.domain_size}")

    started = time.monotonic()
    common = {"grace_s": options.grace_s, "estimate_noise": options.estimate_noise, "seed": options.seed}
    policy = replay(jobs, nodes, settings=settings, fair_tenants=FAIR_TENANTS, keep_heads=options.keep_heads, **common)
    policy_s = time.monotonic() - started
    log(f"policy replay: {policy_s:.1f} s, {policy.decisions} decisions, {policy.decide_s:.1f} s in decide()")
    started = time.monotonic()
    fifo = replay(jobs, nodes, settings=settings, fifo=True, fair_tenants=FAIR_TENANTS, **common)
    log(f"FIFO replay: {time.monotonic() - started:.1f} s")
    bound = fluid_bound(jobs, options.nodes, policy.horizon_s)

    policy_waits, fifo_waits = waits(policy), waits(fifo)
    on_time, n_resv, late_s = reservations_on_time(policy)
    largest = max(policy_waits, key=lambda c: int(c.split("-")[-1])) if policy_waits else None
    utilization, fifo_utilization = round(policy.utilization, 4), round(fifo.utilization, 4)
    jain_policy, jain_fifo = jain(policy), jain(fifo)

    def ratio(a: float | None, b: float | None) -> float | None:
        if a is None or b is None:
            return None
        return round(a / b, 4) if b > 0 else (0.0 if a == 0 else math.inf)

    one_p99 = ratio(policy_waits.get("1", {}).get("wait_p99_s"), fifo_waits.get("1", {}).get("wait_p99_s"))
    big_p50 = ratio(policy_waits[largest]["wait_p50_s"], fifo_waits[largest]["wait_p50_s"]) if largest else None
    big_p99 = ratio(policy_waits[largest]["wait_p99_s"], fifo_waits[largest]["wait_p99_s"]) if largest else None
    targets = {
        "utilization >= 0.9 * utilization_bound": utilization >= 0.9 * bound,
        "utilization >= fifo_utilization": utilization >= fifo_utilization,
        "1-node wait_p99 <= fifo 1-node wait_p99 / 5": one_p99 is not None and one_p99 <= 0.2,
        f"largest gang class ({largest} nodes) wait_p50 and wait_p99 <= 2 * fifo's": big_p50 is not None
        and big_p99 is not None
        and big_p50 <= 2
        and big_p99 <= 2,
        "jain_fairness >= 0.95": jain_policy is not None and jain_policy >= 0.95,
        "reservations_on_time == 1.0": on_time == 1.0,
    }
    figures = {
        "trace": source,
        "jobs": len(jobs),
        "nodes": options.nodes,
        "domain_size": options.domain_size,
        "horizon_s": policy.horizon_s,
        "estimate_noise": options.estimate_noise,
        "lead_time_s": options.lead_time_s,
        "keep_heads": options.keep_heads,
        "grace_s": options.grace_s,
        "utilization": utilization,
        "utilization_bound": round(bound, 4),
        "fifo_utilization": fifo_utilization,
        "wait_by_gang_nodes": policy_waits,
        "fifo_wait_by_gang_nodes": fifo_waits,
        "wait_ratio_to_fifo": {"1_node_p99": one_p99, "largest_p50": big_p50, "largest_p99": big_p99},
        "one_node_wait_p99_s_by_tenant": one_node_p99_by_tenant(policy),
        "fifo_one_node_wait_p99_s_by_tenant": one_node_p99_by_tenant(fifo),
        "jain_fairness": jain_policy,
        "fifo_jain_fairness": jain_fifo,
        "saturated_s": round(policy.saturated_s),
        "fifo_saturated_s": round(fifo.saturated_s),
        "reservations": n_resv,
        "reservations_on_time": on_time,
        # Late: its start past the reservation's; never placed ones (still late at their end) apart.
        "reservation_worst_late_s": round(max([x for x in late_s if not math.isinf(x)], default=0.0), 1),
        "reservations_never_placed": sum(1 for x in late_s if math.isinf(x)),
        "preemptions": policy.preemptions,
        "backfilled": sum(1 for r in policy.records.values() if r.backfilled),
        "decisions": policy.decisions,
        "decide_ms_mean": round(1000 * policy.decide_s / max(1, policy.decisions), 2),
        "policy_replay_s": round(policy_s, 1),
        "targets_met": targets,
        "all_targets_met": all(targets.values()),
        "stack_matches_policy": None,
        "stack_sample": 0,
    }
    if options.stack:
        stack = stack_figures(jobs, options, since_s=0.25 * options.days * DAY if not options.trace else 0.0)
        figures["stack_matches_policy"] = stack.pop("matches_policy")
        figures["stack_sample"] = options.stack
        figures["stack"] = stack
        targets["stack_matches_policy >= 0.99"] = figures["stack_matches_policy"] >= 0.99 and not any(
            stack["invariants"].values()
        )
        figures["all_targets_met"] = all(targets.values())
    table = [
        ("utilization / bound / fifo", f"{utilization} / {bound:.4f} / {fifo_utilization}"),
        ("jain (policy / fifo)", f"{jain_policy} / {jain_fifo}"),
        ("reservations on time", f"{on_time} of {n_resv}"),
        ("preemptions", str(policy.preemptions)),
    ]
    for c in policy_waits:
        pw, fw = policy_waits[c], fifo_waits.get(c, {})
        table.append(
            (
                f"wait {c} nodes p50/p99 (policy | fifo)",
                f"{pw['wait_p50_s']}/{pw['wait_p99_s']} | {fw.get('wait_p50_s')}/{fw.get('wait_p99_s')}",
            )
        )
    table += [(f"target: {k}", "met" if v else "MISSED") for k, v in targets.items()]
    width = max(len(k) for k, _ in table)
    for k, v in table:
        log(f"  {k:<{width}}  {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
