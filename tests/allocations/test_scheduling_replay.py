"""The scheduling policy replayed over a trace (`gpucloud.scheduler.replay`, issue 43's
measurement): waits worked out by hand, no node in two allocations, FIFO against backfill,
reservations, the trace's parsing and the fluid bound."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

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

pytestmark = pytest.mark.unit


def job(id: str, at: float, nodes: int, runtime: float, tenant: str = "t", **kw) -> TraceJob:
    return TraceJob(id, at, nodes, runtime, tenant, **kw)


def starts(result: ReplayResult) -> dict[str, float | None]:
    return {id: rec.start for id, rec in result.records.items()}


def assert_no_node_twice(result: ReplayResult) -> None:
    for node, spans in result.intervals.items():
        spans = sorted(spans)
        for (_, end, a), (start, _, b) in pairwise(spans):
            assert start >= end, f"{node} is in {a} until {end} and in {b} from {start}"


# One domain of 4 nodes. `big` (4 nodes) waits behind `long`; `short` fits beside `long` and ends
# before `long` does, so it never delays `big`; `late` (2 nodes, 500 s) would push `big` back.
HAND = [
    job("long", 0, 2, 100),
    job("big", 10, 4, 50),
    job("short", 20, 2, 60),  # ends at 80 < 100: backfills beside `long`
    job("late", 30, 2, 500),  # would end at 530 > 100: waits for `big`
]


def test_the_replay_gives_the_waits_worked_out_by_hand():
    result = replay(HAND, fleet(4, 4))
    # long: at once. big: when long ends (100). short: at once, beside long (backfilled).
    # late: after big (100 + 50 = 150).
    assert starts(result) == {"long": 0, "big": 100, "short": 20, "late": 150}
    assert {id: rec.wait_s for id, rec in result.records.items()} == {"long": 0, "big": 90, "short": 0, "late": 120}
    assert result.records["short"].backfilled and not result.records["late"].backfilled
    assert result.end_s == 650


def test_fifo_blocks_behind_its_head_where_backfill_does_not():
    fifo = replay(HAND, fleet(4, 4), fifo=True)
    # big is the head from 10 to 100: short and late wait behind it, though short fits at 20.
    assert starts(fifo) == {"long": 0, "big": 100, "short": 150, "late": 150}
    assert replay(HAND, fleet(4, 4)).records["short"].start == 20


def test_a_gang_waits_for_one_domain_even_when_the_fleet_has_the_nodes():
    # Domains n0..n2 and n3..n4: a (best fit) takes n3, b n0 and n1; n2 and n4 are free, one in
    # each domain, so the 2-node g waits for a's domain at 100.
    result = replay([job("a", 0, 1, 100), job("b", 0, 2, 200), job("g", 1, 2, 10)], fleet(5, 3))
    assert starts(result)["g"] == 100
    # A 3-node gang never fits in domains of 2, though the fleet has 4 nodes.
    with pytest.raises(Exception, match="never placed"):
        replay([job("g3", 0, 3, 10)], fleet(4, 2))


def test_a_reservation_is_on_time_though_the_queue_would_take_its_nodes():
    jobs = [
        job("r", 0, 4, 1000, "res", reserve_at_s=5000),
        job("spot", 0, 2, 20_000, "s", tier="preemptible"),
        job("w1", 4000, 2, 50),  # ends before the reservation: placed
        job("w2", 4500, 2, 5000),  # would run into it: waits until it ends
    ]
    # Held from an hour before its start: the preemptible job starts on its nodes first.
    result = replay(jobs, fleet(4, 4), settings=PolicySettings(lead_time_s=3_600.0), grace_s=0)
    assert starts(result) == {"r": 5000, "spot": 0, "w1": 4000, "w2": 6000}
    assert result.preemptions == 1  # spot, with notice, so that the nodes are free at 5000
    spot = result.records["spot"]
    assert spot.preempted == 1 and spot.end is not None and spot.end > 6000  # queued again, then finished
    assert_no_node_twice(result)


def test_a_preemption_releases_after_notice_and_grace():
    settings = PolicySettings(preemption_notice_s=100)
    jobs = [job("spot", 0, 2, 10_000, "s", tier="preemptible"), job("od", 10, 2, 50, "t")]
    result = replay(jobs, fleet(2, 2), settings=settings, grace_s=20)
    assert result.records["od"].start == 130  # preempted at 10, released 100 + 20 later
    assert result.preemptions == 1
    assert_no_node_twice(result)


def _random_trace(seed: int, count: int) -> list[TraceJob]:
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        at = rng.uniform(0, 20_000)
        if i % 17 == 0:
            jobs.append(job(f"r{i}", at, rng.choice((2, 4)), rng.uniform(500, 3000), "res", reserve_at_s=at + 6000))
            continue
        tier = "preemptible" if i % 5 == 0 else "on_demand"
        nodes = rng.choice((1, 1, 1, 1, 2, 4, 8))
        jobs.append(job(f"j{i}", at, nodes, rng.uniform(60, 4000), rng.choice("abc"), tier=tier))
    return jobs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_node_is_ever_in_two_allocations_and_utilization_is_under_the_bound(seed):
    jobs = _random_trace(seed, 150)
    nodes = fleet(24, 8)
    for fifo in (False, True):
        result = replay(jobs, nodes, fifo=fifo, estimate_noise=0.5 if seed == 3 else 0.0, seed=seed)
        assert_no_node_twice(result)
        records = result.records.values()
        assert all(rec.start is not None and rec.end is not None for rec in records if not rec.job.is_reservation)
        # A late reservation holds its nodes from when it is placed to its end.
        work = sum(
            rec.job.nodes * (rec.job.runtime_s if fifo or not rec.job.is_reservation else rec.end - rec.start)
            for rec in records
            if rec.start is not None and rec.end is not None
        )
        done = sum(end - start for spans in result.intervals.values() for start, end, _ in spans)
        assert done == pytest.approx(work)  # preempted work resumes where it stopped: none lost, none twice
        assert 0 < result.utilization <= fluid_bound(jobs, 24, result.horizon_s) + 1e-9


def test_the_fluid_bound_by_hand():
    # 4 nodes, horizon 100. a: 2 × 100 at 0; b: 4 nodes at 50, of which 4 × 50 fit before 100.
    # The fluid fleet does a's 200 by 50 (at 4 per second), then b's 200: all of 400.
    jobs = [job("a", 0, 2, 100), job("b", 50, 4, 150)]
    assert fluid_bound(jobs, 4, 100) == pytest.approx(400 / 400)
    # 1 node for 10 s: the fleet is idle but for it.
    assert fluid_bound([job("a", 0, 1, 10)], 4, 100) == pytest.approx(10 / 400)
    # A job arriving at 90 does at most its width × 10 s within the window, however long it runs.
    assert fluid_bound([job("late", 90, 2, 1000)], 4, 100) == pytest.approx(20 / 400)
    # Work beyond the fleet's rate waits: 8 nodes' worth for 100 s on 4 nodes fills the window.
    assert fluid_bound([job("x", 0, 4, 100), job("y", 0, 4, 100)], 4, 100) == pytest.approx(1.0)


def test_jain_by_hand():
    assert jain_fairness({"a": 10, "b": 10, "c": 10}, "abc") == pytest.approx(1.0)
    assert jain_fairness({"a": 30}, "abc") == pytest.approx(1 / 3)
    assert jain_fairness({"a": 10, "b": 30}, "ab") == pytest.approx(40**2 / (2 * (100 + 900)))
    assert jain_fairness({"a": 10}, "a") is None


def test_a_flooding_tenant_gets_its_share_not_the_fleet_under_the_policy():
    # Two tenants of equal share on 4 nodes, both with more queued than the fleet holds: `flood`
    # 40 one-node jobs at 0, `other` 20 at 1. FIFO serves the flood first; fair share interleaves.
    jobs = [job(f"f{i}", 0, 1, 100, "flood") for i in range(40)]
    jobs += [job(f"o{i}", 1, 1, 100, "other") for i in range(20)]
    both = ["flood", "other"]
    policy, fifo = (replay(jobs, fleet(4, 4), fifo=f, fair_tenants=both) for f in (False, True))
    # Both wait from 1 until other's last job starts at 900. Under the policy, at 100 all 4 freed
    # nodes go to other (no usage yet against flood's 400 node-s), then 2 each every 100 s.
    assert policy.saturated_s == pytest.approx(899)
    assert policy.saturated_node_s == pytest.approx({"flood": 4 * 99 + 2 * 700, "other": 4 * 100 + 2 * 700})
    assert fifo.saturated_node_s == pytest.approx({"flood": 4 * 899, "other": 0})  # until flood's last starts
    assert jain_fairness(policy.saturated_node_s, both) > 0.95 > 0.5 == jain_fairness(fifo.saturated_node_s, both)
    assert max(policy.records[f"o{i}"].wait_s or 0 for i in range(20)) < 1000
    assert min(fifo.records[f"o{i}"].wait_s or 0 for i in range(20)) >= 999


def test_a_trace_is_parsed_and_a_bad_line_is_named_by_line_and_field():
    lines = [
        '{"submit_s": 5, "nodes": 2, "runtime_s": 60.5, "tenant": "a"}',
        "",
        '{"submit_s": 0, "nodes": 1, "runtime_s": 10, "tenant": "b", "tier": "preemptible"}',
        '{"submit_s": 1, "nodes": 4, "runtime_s": 100, "tenant": "c", "reserve_at_s": 50}',
    ]
    jobs = parse_trace(lines)
    assert [(j.id, j.submit_s, j.nodes, j.tier, j.reserve_at_s) for j in jobs] == [
        ("j3", 0, 1, "preemptible", None),
        ("j4", 1, 4, "on_demand", 50),
        ("j1", 5, 2, "on_demand", None),
    ]
    assert parse_trace([j.to_json() for j in jobs]) == [
        TraceJob(f"j{i}", j.submit_s, j.nodes, j.runtime_s, j.tenant, j.tier, j.reserve_at_s)
        for i, j in enumerate(jobs, start=1)
    ]
    good = {"submit_s": 0, "nodes": 1, "runtime_s": 10, "tenant": "a"}
    bad = [
        ({**good, "nodes": 0}, "field 'nodes'"),
        ({**good, "nodes": 1.5}, "field 'nodes'"),
        ({k: v for k, v in good.items() if k != "runtime_s"}, "field 'runtime_s' is missing"),
        ({**good, "runtime_s": -1}, "field 'runtime_s'"),
        ({**good, "submit_s": "soon"}, "field 'submit_s'"),
        ({**good, "tenant": ""}, "field 'tenant'"),
        ({**good, "tier": "gold"}, "field 'tier'"),
        ({**good, "reserve_at_s": -5}, "field 'reserve_at_s'"),
        ({**good, "gpus": 8}, "field 'gpus'"),
    ]
    for data, field in bad:
        with pytest.raises(TraceError, match=f"^line 2: {re.escape(field)}"):
            parse_trace([json.dumps(good), json.dumps(data)])
    with pytest.raises(TraceError, match=r"^line 1: not JSON"):
        parse_trace(["{nope"])


def test_the_benchmark_refuses_a_bad_trace_file_naming_line_and_field(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"submit_s": 0, "nodes": 1, "runtime_s": 5, "tenant": "a"}\n{"submit_s": 1, "nodes": "two"}\n')
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduling.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[1])}
    done = subprocess.run(
        [sys.executable, str(script), "--trace", str(trace)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2
    assert "line 2: field 'nodes' must be a finite number" in done.stderr


def test_the_benchmark_refuses_a_stack_sample_on_domains_the_simulated_fleet_does_not_have():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduling.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[1])}
    done = subprocess.run(
        [sys.executable, str(script), "--stack", "10", "--domain-size", "16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--stack: the simulated fleet's pods are 32 nodes" in done.stderr
