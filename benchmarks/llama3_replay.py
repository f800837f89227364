"""Llama 3 replay: a fleet failing as Meta's 405B pre-training run did, compressed, under the
whole control plane (Temporal dev server, worker, API, ledger-less, simulated fleet; SQLite).

Setup: N nodes enrolled -> available; a quarter of every full pod held back (cordoned while the
gangs are placed, then uncordoned) so replacements stay in their fabric domain; the rest allocated
in gangs of 8 to a few tenants. Then the simulated fleet's fault model runs
(`gpucloud sim --faults llama3`): `--days` of fleet time in `--wall-s` seconds, the paper's
interruption rate (419 in 54 days on 2,048 nodes) and mix by cause, each fault on the node's
simulated GPUs (XIDs and counter readings reported with the node's own credential) and as a
hardware fault its burn-in finds until the right rung of the repair ladder has run.

Figures, from the control plane's DB and the simulator's ground truth:
- faults injected by cause next to the paper's shares;
- nodes pulled (drained out of an allocation or the pool by the health loop), replacements
  attached, and each allocation's time `degraded` (availability = 1 - degraded / held);
- false drains: nodes pulled that the simulator never gave a hardware fault (target 0);
- stuck nodes: nodes in a transient state past their deadline at the end (target 0);
- control-plane CPU seconds (worker + API processes) per simulated day.

    python benchmarks/llama3_replay.py [--quick] [--nodes N] [--days D] [--wall-s S]

`--quick`: 96 nodes, 270 days of fleet time in 45 s (the same time scale as 200 nodes' 540 days
in 90 s, `--nodes 200 --days 540 --wall-s 90`, which gives about 400 faults, as many as the
paper's whole run; this about a hundred, in half the setup). Prints progress to stderr and one
JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from common import add_temporal_db_arg, bench_stack, bring_up_fleet, log, onboard_tenant, wait_for
from health import GANG, TENANTS, Probe, hold_back_spares

from gpucloud.sim.client import SimFleetClient

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TRANSIENT = ("inspecting", "burn_in", "reserved", "provisioning", "releasing", "wiping", "draining", "repairing")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its reaped children (`/proc/<pid>/stat`)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime + cutime + cstime) / CLOCK_TICKS


def control_plane_cpu(stack) -> float:
    return sum(cpu_seconds(stack.processes[name].pid) for name in ("worker", "api") if name in stack.processes)


def pulled_nodes(probe: Probe, since: datetime) -> set[str]:
    rows = probe.rows(
        "SELECT DISTINCT node_id FROM nodetransition WHERE at >= :t AND (to_state = 'draining' "
        "OR (to_state = 'quarantined' AND from_state <> 'quarantined'))",
        t=since,
    )
    rows += probe.rows("SELECT DISTINCT node_id FROM allocationevent WHERE at >= :t AND kind = 'degraded'", t=since)
    return {r[0] for r in rows if r[0]}


def degraded_seconds(probe: Probe, allocation_id: str, start: datetime, end: datetime) -> float:
    """Time the allocation spent `degraded` between `start` and `end` (its status events)."""
    events = probe.rows(
        "SELECT kind, at FROM allocationevent WHERE allocation_id = :a AND kind IN ('degraded', 'ready') ORDER BY seq",
        a=allocation_id,
    )
    total, since = 0.0, None
    for kind, at in events:
        moment = max(start, min(end, _utc(at)))
        if kind == "degraded" and since is None:
            since = moment
        elif kind == "ready" and since is not None:
            total += (moment - since).total_seconds()
            since = None
    if since is not None:
        total += (end - since).total_seconds()
    return total


def _utc(value) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def stuck(probe: Probe, now: datetime) -> list[str]:
    states = ",".join(f"'{s}'" for s in TRANSIENT)
    rows = probe.rows(f"SELECT id, deadline_at FROM node WHERE state IN ({states}) AND deadline_at IS NOT NULL")
    return sorted(node_id for node_id, deadline in rows if _utc(deadline) < now)


def allocate_in_waves(api: httpx.Client, settings, engine: sa.Engine, gangs: int, *, wave: int = 16) -> list[str]:
    """`gangs` allocations of 8 over a few tenants, `wave` at a time (each wave active before the
    next: a tenant scheduler's pace, and one the fabric managers keep up with)."""
    keys = [onboard_tenant(api, f"replay-{i}") for i in range(TENANTS)]
    clients = [
        httpx.Client(base_url=settings.api_url, headers={"Authorization": f"Bearer {k}"}, timeout=300) for k in keys
    ]
    allocations: list[str] = []
    for start in range(0, gangs, wave):
        for i in range(start, min(gangs, start + wave)):
            body = {"gpu_type": "H100", "node_count": GANG, "region": "us-east-1"}
            resp = clients[i % TENANTS].post("/v1/allocations", json=body)
            resp.raise_for_status()
            allocations.append(resp.json()["allocation"]["id"])
        wait_for(engine, "active", len(allocations) * GANG, "provisioning", 1800)
    return allocations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2048)
    parser.add_argument("--days", type=float, default=54.0, help="fleet days to replay")
    parser.add_argument("--wall-s", type=float, default=600.0, help="wall seconds to replay them in")
    parser.add_argument("--quick", action="store_true", help="96 nodes, 270 fleet days in 45 s")
    add_temporal_db_arg(parser)
    args = parser.parse_args()
    nodes, days, wall_s = (96, 270.0, 45.0) if args.quick else (args.nodes, args.days, args.wall_s)
    time_scale = days * 86_400 / wall_s

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # The health loop may pull more than its default share when the fault rate is compressed.
    os.environ["GPUCLOUD_HEALTH__BREAKER_MAX_PULLED_SHARE"] = "0.5"
    os.environ["GPUCLOUD_HEALTH__DRAIN_GRACE_S"] = "2"
    # The operator's setup calls run 16 at once: its lane takes them, none refused (the tenants'
    # lane, unused here, gives up the slots, below the worker threads: api/admission.py).
    operator_lane = {"operator_slots": 16, "tenant_slots": 24, "caller_share": 1.0, "admission_wait_s": 60.0}
    settings, stack, data_dir = bench_stack(nodes, args.temporal_db, sim_heartbeat_s=10.0, api=operator_lane)
    stack.faults, stack.fault_time_scale, stack.faults_paused = "llama3", time_scale, True
    try:
        log(f"starting stack in {data_dir} ({days:g} fleet days in {wall_s:g} s: time scale {time_scale:.0f})")
        stack.start(on_step=lambda s: log(f"  {s}"))
        engine = sa.create_engine(settings.database_url)
        probe = Probe(engine)
        api = httpx.Client(base_url=settings.api_url, headers={"Authorization": "Bearer bench-token"}, timeout=300)
        sim = SimFleetClient(settings.sim_url, token=settings.operator_token, timeout_s=60)
        bring_up_fleet(api, settings, engine, nodes)
        held = hold_back_spares(api, probe)
        gangs = (nodes - len(held)) // GANG
        log(f"allocate: {gangs} gangs of {GANG}; {len(held)} spare nodes held back")
        allocations = allocate_in_waves(api, settings, engine, gangs)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: api.post(f"/v1/nodes/{n}/uncordon").raise_for_status(), held))

        log(f"replay: faults on for {wall_s:g} s")
        cpu_before, started = control_plane_cpu(stack), datetime.now(UTC)
        sim.run_faults(True)
        deadline = time.monotonic() + wall_s
        while time.monotonic() < deadline:
            time.sleep(min(15.0, max(0.0, deadline - time.monotonic())))
            summary = sim.faults()
            log(
                f"  {summary['fleet_days']:.1f} fleet days, {summary['injected']} faults, "
                f"{summary['faulty_nodes']} nodes faulty now"
            )
        summary = sim.run_faults(False)
        ended = datetime.now(UTC)
        cpu = control_plane_cpu(stack) - cpu_before
        log("settling: 30 s for the pulls and replacements under way")
        time.sleep(30)

        faulted_hw = {
            node
            for node, categories in summary["nodes"].items()
            if any(c not in ("software", "nccl_watchdog") for c in categories)
        }
        pulled = pulled_nodes(probe, started)
        false_drains = sorted(pulled - faulted_hw)
        replacements = probe.rows(
            "SELECT count(*) FROM allocationevent WHERE at >= :t AND kind = 'replaced'", t=started
        )[0][0]
        held_s = (ended - started).total_seconds() * len(allocations)
        degraded = sum(degraded_seconds(probe, a, started, ended) for a in allocations)
        stuck_nodes = stuck(probe, datetime.now(UTC))
        figures = {
            "nodes": nodes,
            "allocations": len(allocations),
            "fleet_days": round(summary["fleet_days"], 2),
            "time_scale": round(time_scale),
            "faults_injected": summary["injected"],
            "faults_by_cause": {
                c: {"injected": v["injected"], "share": round(v["share"], 3), "paper_share": round(v["paper_share"], 3)}
                for c, v in summary["by_category"].items()
            },
            "xids_reported": summary["xids_reported"],
            "readings_reported": summary["readings_reported"],
            "nodes_with_hardware_faults": len(faulted_hw),
            "nodes_pulled": len(pulled),
            "replacements": replacements,
            "allocation_availability": round(1 - degraded / held_s, 4) if held_s else None,
            "false_drains": len(false_drains),
            "false_drain_nodes": false_drains[:10],
            "stuck_nodes": len(stuck_nodes),
            "control_plane_cpu_s_per_fleet_day": round(cpu / summary["fleet_days"], 3)
            if summary["fleet_days"]
            else None,
        }
        log(
            f"done: {len(pulled)} pulled, {replacements} replaced, "
            f"{len(false_drains)} false drains, {len(stuck_nodes)} stuck"
        )
    finally:
        stack.stop()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
