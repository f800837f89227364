"""Health loop latency: fatal XIDs on active nodes pulled and replaced, a burst of them, and
application XIDs that must never drain, through the real stack (Temporal dev server, worker, API
and simulated fleet as separate processes, SQLite).

Setup: N nodes enrolled -> available; in each full pod a quarter of the nodes is held back
(cordoned while the gangs are placed, then uncordoned) so every pod keeps spare capacity for
replacements in its own fabric domain; the rest is allocated in gangs of 8 to a few tenants.

Then, through the operator API (`POST /v1/nodes/{id}/xid`, `POST /v1/agents/events`):
- 1,000 application XIDs (13, 31, 43, 45, 68) over active nodes of every tenant: none may drain.
- Fatal XID 79 on single active nodes, one at a time: XID -> cordoned (the health loop's cordon,
  in the judgement's transaction), XID -> pulled (out of the allocation, the allocation
  `degraded`), XID -> `replacement_started`, XID -> allocation `ready` again.
- A burst: XID 79 on many nodes at once (concurrent requests), XID -> cordoned and -> pulled for each.

Timestamps are the control plane's own (allocation events and node transitions in the DB), taken
against the wall clock read just before each XID was posted (same machine, same clock). The
circuit breaker's share is raised (`GPUCLOUD_HEALTH__BREAKER_MAX_PULLED_SHARE`) so the burst is allowed.

    python benchmarks/health.py [--quick] [--nodes N] [--temporal-db memory|file]

Prints progress to stderr and one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    add_temporal_db_arg,
    bench_stack,
    bring_up_fleet,
    history_profile,
    log,
    onboard_tenant,
    percentile,
    wait_for,
)

from gpucloud.config import Settings
from gpucloud.models.workflow_ids import allocation_workflow_id, node_workflow_id

APPLICATION_XIDS = (13, 31, 43, 45, 68)
FATAL_XID = 79
GANG = 8
SPARE_SHARE = 0.25  # of each full pod, kept free for replacements
TENANTS = 4


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class Probe:
    """Reads the control plane's DB: when each pulled node left its allocation, when its
    replacement started, when the allocation was ready again."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def rows(self, sql: str, **params) -> list:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params).all())

    def nodes(self) -> list:
        return self.rows("SELECT id, pod, state, allocation_id, tenant_id, health, drain_requested FROM node")

    def milestones(self, victim: str, allocation_id: str) -> dict[str, datetime]:
        """pulled / replacement_started / ready for one victim, as far as they happened."""
        events = self.rows(
            "SELECT seq, kind, node_id, reason, at FROM allocationevent WHERE allocation_id = :a ORDER BY seq",
            a=allocation_id,
        )
        found: dict[str, datetime] = {}
        replaced_seq = None
        for seq, kind, node_id, reason, at in events:
            if kind == "degraded" and node_id == victim:
                found.setdefault("pulled", _utc(at))
            elif kind == "replacement_started" and f"to replace {victim}" in reason:
                found.setdefault("replacement_started", _utc(at))
            elif kind == "replaced" and node_id == victim:
                replaced_seq = seq
            elif kind == "ready" and replaced_seq is not None and seq > replaced_seq:
                found.setdefault("ready", _utc(at))
        draining = self.rows(
            "SELECT min(at) FROM nodetransition WHERE node_id = :n AND to_state = 'draining'", n=victim
        )[0][0]
        if draining is not None:
            found["pulled"] = min(found.get("pulled", _utc(draining)), _utc(draining))
        cordoned = self.rows(
            "SELECT min(at) FROM nodetransition WHERE node_id = :n AND event = 'cordon' AND actor = 'health'", n=victim
        )[0][0]
        if cordoned is not None:
            found["cordoned"] = _utc(cordoned)
        return found

    def drain_signs(self, node_ids: list[str]) -> list[str]:
        """Nodes with any sign of a pull: a drain transition, drain intent, a degraded event."""
        if not node_ids:
            return []
        ids = ",".join(f"'{n}'" for n in node_ids)  # ids come from our own DB, not from input
        drained = {
            r[0]
            for r in self.rows(
                f"SELECT DISTINCT node_id FROM nodetransition WHERE node_id IN ({ids}) "
                "AND (event = 'drain' OR to_state IN ('draining', 'quarantined'))"
            )
        }
        drained |= {r[0] for r in self.rows(f"SELECT id FROM node WHERE id IN ({ids}) AND drain_requested")}
        drained |= {
            r[0]
            for r in self.rows(
                f"SELECT DISTINCT node_id FROM allocationevent WHERE node_id IN ({ids}) "
                "AND kind IN ('degraded', 'fault_notice')"
            )
        }
        return sorted(drained)


def _utc(value) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _table_names(engine: sa.Engine) -> None:
    names = set(sa.inspect(engine).get_table_names())
    for needed in ("node", "nodetransition", "allocationevent"):
        if needed not in names:
            raise SystemExit(f"table {needed!r} not in the control-plane DB ({sorted(names)})")


def hold_back_spares(api: httpx.Client, probe: Probe) -> list[str]:
    """Cordon a quarter of every full pod so the gangs leave room for replacements there."""
    by_pod: dict[str, list[str]] = defaultdict(list)
    for node_id, pod, *_ in probe.nodes():
        by_pod[pod].append(node_id)
    full = max(len(v) for v in by_pod.values())
    held = [
        n for ids in by_pod.values() if len(ids) == full for n in sorted(ids)[-max(1, int(len(ids) * SPARE_SHARE)) :]
    ]
    with ThreadPoolExecutor(16) as pool:
        list(
            pool.map(
                lambda n: api.post(f"/v1/nodes/{n}/cordon", json={"reason": "bench spare"}).raise_for_status(), held
            )
        )
    return held


def allocate(api: httpx.Client, settings: Settings, engine: sa.Engine, gangs: int) -> dict[str, str]:
    """`gangs` allocations of 8 nodes, round-robin over a few tenants; allocation id -> tenant key."""
    keys = []
    for i in range(TENANTS):
        keys.append(onboard_tenant(api, f"bench-{i}"))
    clients = [
        httpx.Client(base_url=settings.api_url, headers={"Authorization": f"Bearer {k}"}, timeout=300) for k in keys
    ]
    allocations = {}
    for i in range(gangs):
        resp = clients[i % TENANTS].post(
            "/v1/allocations", json={"gpu_type": "H100", "node_count": GANG, "region": "us-east-1"}
        )
        resp.raise_for_status()
        allocations[resp.json()["allocation"]["id"]] = keys[i % TENANTS]
    wait_for(engine, "active", gangs * GANG, "provisioning", 1800)
    return allocations


def pick_victims(probe: Probe, count: int) -> list[tuple[str, str]]:
    """(node, allocation) pairs: no more victims in a pod than it has spare nodes, and spread
    over allocations (a second victim in one allocation waits for the first's replacement)."""
    nodes = probe.nodes()
    spare = Counter(pod for _, pod, state, *_ in nodes if state == "available")
    per_alloc: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for node_id, pod, state, alloc_id, *_ in sorted(nodes):
        if state == "active" and alloc_id:
            per_alloc[alloc_id].append((node_id, pod))
    victims: list[tuple[str, str]] = []
    rounds = 0
    while len(victims) < count and rounds < GANG:
        for alloc_id, members in sorted(per_alloc.items()):
            if len(victims) == count:
                break
            if rounds < len(members):
                node_id, pod = members[rounds]
                if spare[pod] > 0:
                    spare[pod] -= 1
                    victims.append((node_id, alloc_id))
        rounds += 1
    if len(victims) < count:
        raise SystemExit(f"only {len(victims)} victims with spare capacity in their pod, wanted {count}")
    return victims


def inject(api: httpx.Client, node_id: str) -> datetime:
    at = datetime.now(UTC)  # a report the lane turns away and takes later counts from here
    resp = api.post(f"/v1/nodes/{node_id}/xid", json={"xid": FATAL_XID, "gpu_index": 3})
    while resp.status_code in (429, 503):
        time.sleep(min(1.0, float(resp.headers.get("retry-after", "0.2"))))
        resp = api.post(f"/v1/nodes/{node_id}/xid", json={"xid": FATAL_XID, "gpu_index": 3})
    resp.raise_for_status()
    decision = resp.json()["decisions"][0]
    if decision["pull"] != "replace":
        raise SystemExit(f"XID {FATAL_XID} on {node_id}: expected a replace, got {decision}")
    return at


def wait_milestones(probe: Probe, victims: list[tuple[str, str]], want: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        got = {v: probe.milestones(*v) for v in victims}
        if all(want in m for m in got.values()):
            return got
        if time.monotonic() > deadline:
            missing = [v[0] for v, m in got.items() if want not in m]
            raise SystemExit(f"timed out waiting for {want} on {len(missing)} nodes, e.g. {missing[:3]}")
        time.sleep(0.1)


def application_xids(api: httpx.Client, probe: Probe, total: int, exclude: set[str]) -> tuple[list[str], int]:
    """`total` application XIDs over active nodes of every tenant, in agent-sized batches;
    returns the nodes hit and how many decisions asked for a pull."""
    active = sorted(n[0] for n in probe.nodes() if n[2] == "active" and n[0] not in exclude)
    rng = random.Random(7)
    targets = rng.sample(active, min(len(active), max(1, total // 5)))
    now = datetime.now(UTC).isoformat()
    events = [
        {
            "node_id": targets[i % len(targets)],
            "gpu_index": rng.randrange(8),
            "xid": APPLICATION_XIDS[i % len(APPLICATION_XIDS)],
            "timestamp": now,
        }
        for i in range(total)
    ]
    pulls = 0
    for i in range(0, total, 100):
        resp = api.post("/v1/agents/events", json={"events": events[i : i + 100]})
        resp.raise_for_status()
        pulls += sum(1 for d in resp.json()["decisions"] if d["pull"] or d["action"] not in ("none", "watch"))
    return targets, pulls


def latencies(starts: dict[tuple[str, str], datetime], milestones: dict, what: str) -> list[float]:
    return [(milestones[v][what] - t0).total_seconds() for v, t0 in starts.items() if what in milestones[v]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="100 nodes, 8 single faults, a 15-node burst")
    parser.add_argument("--singles", type=int, default=None, help="single fatal XIDs, one at a time (50)")
    parser.add_argument("--burst", type=int, default=None, help="nodes in the fatal burst (150)")
    parser.add_argument("--app-xids", type=int, default=1000)
    parser.add_argument(
        "--breaker-share",
        type=float,
        default=0.5,
        help="GPUCLOUD_HEALTH__BREAKER_MAX_PULLED_SHARE for this run, so the burst is allowed",
    )
    add_temporal_db_arg(parser)
    args = parser.parse_args()
    nodes = 100 if args.quick else args.nodes
    singles = args.singles if args.singles is not None else (8 if args.quick else 50)
    burst = args.burst if args.burst is not None else (15 if args.quick else 150)

    # A `timeout` or kill stops the stack's processes too (the finally below), not only this one.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ["GPUCLOUD_HEALTH__BREAKER_MAX_PULLED_SHARE"] = str(args.breaker_share)
    # The burst measures node-level pulls of independent faults: correlation is off, since a
    # burst this size lands several nodes behind each rack and would be held as rack incidents
    # (one fleet incident per component, no pulls: `tests/health/test_fleet_incidents.py`).
    os.environ["GPUCLOUD_HEALTH__CORRELATION_MIN_NODES"] = str(1_000_000)
    # The agents heartbeat as in production (every 10 s): a fleet under faults still reports.
    # The operator's calls run up to 64 at once (the burst): its lane takes 16, the rest wait.
    operator_lane = {"operator_slots": 16, "tenant_slots": 24, "caller_share": 1.0, "admission_wait_s": 60.0}
    settings, stack, data_dir = bench_stack(nodes, args.temporal_db, sim_heartbeat_s=10.0, api=operator_lane)
    try:
        log(f"starting stack in {data_dir}")
        stack.start(on_step=lambda s: log(f"  {s}"))
        engine = sa.create_engine(settings.database_url)
        probe = Probe(engine)
        api = httpx.Client(base_url=settings.api_url, headers={"Authorization": "Bearer bench-token"}, timeout=300)
        bring_up_fleet(api, settings, engine, nodes)
        _table_names(engine)

        held = hold_back_spares(api, probe)
        gangs = (nodes - len(held)) // GANG
        log(f"allocate: {gangs} gangs of {GANG} over {TENANTS} tenants; {len(held)} spare nodes held back")
        allocations = allocate(api, settings, engine, gangs)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: api.post(f"/v1/nodes/{n}/uncordon").raise_for_status(), held))

        victims = pick_victims(probe, singles + burst)
        log(f"application XIDs: {args.app_xids} on active nodes not chosen for a fatal XID")
        app_nodes, app_pulls = application_xids(api, probe, args.app_xids, exclude={v[0] for v in victims})
        time.sleep(3)  # anything they set off would have started by now
        false_drains = probe.drain_signs(app_nodes)
        log(f"  {len(app_nodes)} nodes hit, {app_pulls} pull decisions, {len(false_drains)} drained")

        log(f"single faults: XID {FATAL_XID} on {singles} active nodes, one at a time")
        single_starts, single_marks = {}, {}
        for victim in victims[:singles]:
            single_starts[victim] = inject(api, victim[0])
            single_marks.update(wait_milestones(probe, [victim], "ready", 120))
        cordon = latencies(single_starts, single_marks, "cordoned")
        pulled = latencies(single_starts, single_marks, "pulled")
        started = latencies(single_starts, single_marks, "replacement_started")
        ready = latencies(single_starts, single_marks, "ready")
        log(
            f"  cordoned p99 {percentile(cordon, 99):.3f}s, pulled p50 {percentile(pulled, 50):.3f}s, "
            f"replacement started p99 {percentile(started, 99):.3f}s, "
            f"ready again p99 {percentile(ready, 99):.3f}s"
        )

        log(f"burst: XID {FATAL_XID} on {burst} nodes at once")
        burst_victims = victims[singles:]
        with ThreadPoolExecutor(min(64, burst)) as pool:
            burst_starts = dict(zip(burst_victims, pool.map(lambda v: inject(api, v[0]), burst_victims), strict=True))
        burst_began = min(burst_starts.values())
        burst_marks = wait_milestones(probe, burst_victims, "cordoned", 600)
        burst_cordon = latencies(burst_starts, burst_marks, "cordoned")
        log(f"  cordoned p99 {percentile(burst_cordon, 99):.3f}s")
        burst_marks = wait_milestones(probe, burst_victims, "pulled", 600)
        burst_pulled = latencies(burst_starts, burst_marks, "pulled")
        # A second fault in one allocation is pulled after the first one's replacement is attached
        # (the allocation workflow replaces one node at a time): report the first ones apart.
        firsts = {v: t for v, t in burst_starts.items() if v == next(b for b in burst_victims if b[1] == v[1])}
        burst_pulled_first = latencies(firsts, burst_marks, "pulled")
        log(
            f"  pulled p99 {percentile(burst_pulled, 99):.3f}s "
            f"(first fault of its allocation: p99 {percentile(burst_pulled_first, 99):.3f}s)"
        )
        burst_marks = wait_milestones(probe, burst_victims, "ready", 900)
        burst_ready = latencies(burst_starts, burst_marks, "ready")
        # Where the burst's time went: the allocations' workflows (pulls, replacements) and the
        # victims' node operations (drains), activity by activity, queued vs running.
        profile = history_profile(
            settings,
            [allocation_workflow_id(a) for a in sorted({a for _, a in burst_victims})]
            + [node_workflow_id(n) for n, _ in burst_victims],
            since=burst_began,
        )
        for name, figures in profile.items():
            log(f"  {name}: {figures}")
        last_pulled = max(m["pulled"] for m in burst_marks.values())
        alerts = api.get("/v1/alerts").json()["items"]
        states = Counter(n[2] for n in probe.nodes())
    finally:
        stack.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    print(
        json.dumps(
            {
                "temporal_db": args.temporal_db,
                "nodes": nodes,
                "allocations": len(allocations),
                "spare_nodes": len(held),
                "singles": singles,
                "cordon_p50_s": _rounded(percentile(cordon, 50)),
                "cordon_p99_s": _rounded(percentile(cordon, 99)),
                "cordon_max_s": _rounded(max(cordon)),
                "pulled_p50_s": _rounded(percentile(pulled, 50)),
                "pulled_p99_s": _rounded(percentile(pulled, 99)),
                "replacement_started_p50_s": _rounded(percentile(started, 50)),
                "replacement_started_p99_s": _rounded(percentile(started, 99)),
                "ready_again_p50_s": _rounded(percentile(ready, 50)),
                "ready_again_p99_s": _rounded(percentile(ready, 99)),
                "burst_nodes": burst,
                "burst_cordon_p50_s": _rounded(percentile(burst_cordon, 50)),
                "burst_cordon_p99_s": _rounded(percentile(burst_cordon, 99)),
                "burst_allocations": len(firsts),
                "burst_pulled_p99_s": _rounded(percentile(burst_pulled, 99)),
                "burst_pulled_first_in_allocation_p99_s": _rounded(percentile(burst_pulled_first, 99)),
                "burst_last_pulled_s": _rounded((last_pulled - burst_began).total_seconds()),
                "burst_ready_again_p99_s": _rounded(percentile(burst_ready, 99)),
                "burst_ready_again_mean_s": _rounded(statistics.fmean(burst_ready)),
                "app_xids": args.app_xids,
                "app_xid_nodes": len(app_nodes),
                "app_xid_pull_decisions": app_pulls,
                "false_drains": len(false_drains),
                "breaker_max_pulled_share": args.breaker_share,
                "operator_alerts": len(alerts),
                "final_states": dict(sorted(states.items())),
                "burst_profile": profile,
            }
        )
    )


if __name__ == "__main__":
    main()
