"""Llama 3 replay: a fleet failing as Meta's 405B pre-training run did, compressed, under the
whole control plane (Temporal dev server, worker, API, ledger-less, simulated fleet; SQLite).

Setup: N nodes enrolled -> available; a quarter of every full pod held back (cordoned while the
gangs are placed, then uncordoned) so replacements stay in their fabric domain; the rest allocated
in gangs of 8 to a few tenants. Then the simulated fleet's fault model runs
(`gpucloud sim --faults llama3`): `--days` of fleet time in `--wall-s` seconds, the paper's
interruption rate (419 in 54 days on 2,048 nodes) and mix by cause, each fault on the node's
simulated GPUs (XIDs and counter readings reported with the node's own credential), the faults
NVML cannot see as host-condition signals (`POST /v1/agents/signals`), and as a hardware fault
its burn-in finds until the right rung of the repair ladder has run. With `--min-per-category K`
(K = 1 with `--quick`) the simulator injects at least K faults of every category, so the rare
ones (silent data corruption, NIC, NCCL watchdog) are measured too: a category still short of K
at its checkpoint (spread over the first three quarters of the replay, the rarest last) gets
one then, on a node drawn as the model draws them; `faults_forced` says how many, by category.

Time. The compression applies to the fault model only: fault arrivals (and counter drifts) run
`time_scale` times faster than the wall clock (`fleet_s_per_wall_s` is what the simulator
actually ran). The control plane is not compressed: its clocks, rule windows and timeouts are the
wall clock's, so a detection latency measured here in wall seconds is also the latency in the
simulation's own terms (what the same control plane would take on a real fleet, on this
machine's CPUs); no figure below is scaled. Two policy windows are set in fleet time instead, as
the compressed fault rate needs: the circuit breaker's window is an hour of fleet time (else
months of faults fall in one wall hour and it refuses a fifth of the pulls), and its pulled
share is raised to 0.5; the correlation window (5 minutes) is 5 minutes of fleet time (else any
three independent faults behind one rack in the replay are held as a rack incident, not
pulled); the drain grace is 2 s.

Figures, from the control plane's DB and API and the simulator's ground truth (`GET /v1/faults`:
every fault's time, node, category, and whom the node served then):
- faults injected by cause next to the paper's shares;
- detection, per category (`detection_by_category`): each hardware fault is matched to the first
  incident (`GET /v1/incidents`) opened on its node at or after the fault and before the node's
  next fault. Detection latency = the incident's `created_at` (when the incident workflow's first
  activity wrote the row: when an operator can first see it; its `detected_at` is the fault's own
  time, as the node reported it) less the fault's injection time (the simulator's clock as it
  applied the fault, the time its XIDs and signals carry). `detect_p50_s`/`detect_p99_s` over
  the faults on nodes in service (available, reserved, provisioning or active: a fault on a node
  already out for repair is counted as `out_of_service`, burn-in's to find); `detect_held_p99_s`
  over those a tenant held; `caught_before_next_tenant`: the share of in-service faults whose
  incident opened before the node was next reserved for another tenant's allocation (an
  undetected fault is not caught); `settled_by_wipe`: faults the next GPU reset settles (XIDs
  flagged `next_reset`, 94 among them) on a tenant's node, which open no incident by design (the job
  restarts, the node stays) and which the wipe at the node's release reset before its next
  tenant: counted as caught, not as detected, and not in `faults_undetected`;
  `incident_category`: how the incidents filed them (XIDs 119 and 120 are both faulty GPU and
  GSP in the mix, so the filing can differ from the cause);
- over all: `categories_undetected` (categories with in-service hardware faults and no incident;
  `software` and `nccl_watchdog` are the workload's faults, never pulled by design, listed in
  `categories_never_pulled_by_design`), `faults_undetected`, `non_xid_detect_p99_s` (the worst
  `detect_p99_s` of the categories that never show an XID: host maintenance, NIC, silent data
  corruption, other), `false_pulls` (incidents on nodes the simulator had given no hardware
  fault before; target 0), `extra_incidents` (a second incident for one fault),
  `breaker_refusals` (pulls the circuit breaker refused: those faults open no incident);
- spare capacity (`spares`): each pool's spares needed and held (`GET /v1/fleet/spares`, whose
  rate, window and turnaround are in wall hours, so it plans on the Llama 3 rate and a 72-hour
  turnaround) beside the replacement wait seen: from a pull (the allocation's `degraded` event
  for the node) to its replacement attached (`replaced`), p50/p99, and the pulls not replaced by
  the end; and `at_replay_rate`, the same model on what the replay measured in wall time (mean
  nodes out, each from its incident to its return to `available`): the spares the compressed
  fault rate needed, beside those held back. A repair of a minute of wall time is months of
  fleet time, so the replay needs far more spares than a real pool and runs short of them;
- nodes pulled (drained out of an allocation or the pool by the health loop), replacements
  attached, and each allocation's time `degraded` (availability = 1 - degraded / held);
- false drains: nodes pulled that the simulator never gave a hardware fault (target 0);
- stuck nodes: nodes in a transient state past their deadline at the end (target 0);
- control-plane CPU seconds (worker + API processes) per simulated day.

Each fault with its incident is written to `replay_faults.json` in the run's data directory.

    python benchmarks/llama3_replay.py [--quick] [--nodes N] [--days D] [--wall-s S] [--min-per-category K]

`--quick`: 96 nodes, 270 days of fleet time in 45 s (the same time scale as 200 nodes' 540 days
in 90 s, `--nodes 200 --days 540 --wall-s 90`, which gives about 400 faults, as many as the
paper's whole run; this about a hundred, in half the setup), at least one fault of each
category. Prints progress to stderr and one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from common import add_temporal_db_arg, bench_stack, bring_up_fleet, log, onboard_tenant, percentile, wait_for
from health import GANG, TENANTS, Probe, hold_back_spares

from gpucloud.health.categories import FaultCategory
from gpucloud.health.spares import poisson_quantile
from gpucloud.health.xid import XID_TABLE
from gpucloud.sim.client import SimFleetClient
from gpucloud.sim.fault_injection import FIXED_BY
from gpucloud.sim.faults import NON_XID_CATEGORIES

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TRANSIENT = ("inspecting", "burn_in", "reserved", "provisioning", "releasing", "wiping", "draining", "repairing")
# A node in one of these could serve a tenant (or does): a fault on it is one a pull is for. In
# the others (draining, in repair, wiping, in burn-in, quarantined) it is out of service already.
IN_SERVICE = ("available", "reserved", "provisioning", "active")
# The simulator and the control plane read the same clock (one machine): a fault's incident
# cannot open before it, but allow for rounding.
CLOCK_TOLERANCE_S = 1.0
# Categories whose faults leave the hardware alone (`sim/fault_injection.py` FIXED_BY): the
# workload's, counted and never pulled, so never an incident.
APPLICATION = tuple(c.value for c in FaultCategory if c not in FIXED_BY)


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


def list_incidents(api: httpx.Client) -> list[dict]:
    """Every incident, as an operator lists them (`GET /v1/incidents`, oldest first)."""
    items: list[dict] = []
    token = None
    while True:
        params: dict = {"page_size": 1000} | ({"page_token": token} if token else {})
        response = api.get("/v1/incidents", params=params)
        response.raise_for_status()
        page = response.json()
        items += page["items"]
        token = page.get("next_page_token")
        if not token:
            return items


def node_histories(probe: Probe, nodes: set[str]) -> dict[str, list[tuple[datetime, str, str, str]]]:
    """Each node's transitions, in order: (at, to_state, event, cause)."""
    history: dict[str, list[tuple[datetime, str, str, str]]] = {n: [] for n in nodes}
    for node_id, at, to_state, event, cause in probe.rows(
        "SELECT node_id, at, to_state, event, cause FROM nodetransition ORDER BY seq"
    ):
        if node_id in history:
            history[node_id].append((_utc(at), to_state, event, cause or ""))
    return history


def state_at(history: list[tuple[datetime, str, str, str]], moment: datetime) -> str | None:
    """The node's state at `moment`, as its history shows it."""
    state = None
    for at, to_state, _, _ in history:
        if at > moment:
            break
        state = to_state
    return state


def next_tenant_at(
    history: list[tuple[datetime, str, str, str]], moment: datetime, tenant: str | None, tenants: dict[str, str]
) -> datetime | None:
    """When the node was next reserved, after `moment`, for an allocation of a tenant other than
    `tenant` (the one its agent served at the fault; None: it served none)."""
    for at, to_state, event, cause in history:
        if at <= moment or to_state != "reserved" or event != "reserve":
            continue
        allocation = cause.removeprefix("allocation ").strip()
        if tenants.get(allocation) != tenant or tenant is None:
            return at
    return None


# XIDs whose fault the next GPU reset settles (`health/xid.py`, flagged `next_reset`): on a tenant's
# node the job restarts and the node stays (no incident, by design); the wipe at its release
# resets every GPU before anyone else gets it.
RESET_SETTLED_XIDS = frozenset(x for x, p in XID_TABLE.items() if p.reset_pending)
HELD_STATES = ("reserved", "provisioning", "active")


def wiped_between(history: list[tuple[datetime, str, str, str]], start: datetime, end: datetime | None) -> bool:
    """Whether the node was wiped (it entered `wiping`) after `start` and before `end`."""
    return any(at > start and (end is None or at < end) and to == "wiping" for at, to, _, _ in history)


def _seconds(values: list[float], q: float) -> float | None:
    found = percentile(values, q)
    return None if found is None else round(found, 3)


def breaker_refusals(probe: Probe, since: datetime) -> dict[str, list[datetime]]:
    """The circuit breaker's refusals (its operator alerts) since `since`, by node."""
    refused: dict[str, list[datetime]] = {}
    for node_id, at in probe.rows(
        "SELECT node_id, at FROM operator_alert WHERE kind = 'circuit_breaker' AND at >= :t", t=since
    ):
        refused.setdefault(node_id or "", []).append(_utc(at))
    return refused


def detection(probe: Probe, incidents: list[dict], injections: list[dict], since: datetime) -> dict:
    """Each injected fault matched to the incident it opened, by node and time: the first
    incident opened on the node at or after the fault (less `CLOCK_TOLERANCE_S`) and before the
    node's next hardware fault. Detection latency = the incident row's `created_at` (when the
    incident workflow's first activity wrote it: when an operator can first see it) less the
    fault's injection time (the simulator's clock when it applied the fault, the time its XIDs
    and signals carry). Per category, and the figures over all (see the module docstring)."""
    tenants = dict(probe.rows("SELECT id, tenant_id FROM allocation"))
    by_node: dict[str, list[dict]] = {}
    for incident in incidents:
        incident["_created"] = _utc(incident["created_at"])
        by_node.setdefault(incident["node_ids"][0] if incident["node_ids"] else "", []).append(incident)
    for found in by_node.values():
        found.sort(key=lambda i: i["_created"])
    faults = sorted(
        ({**f, "_at": _utc(f["at"])} for f in injections if f["hardware"]), key=lambda f: (f["node_id"], f["_at"])
    )
    histories = node_histories(probe, {f["node_id"] for f in faults} | set(by_node))
    refused = breaker_refusals(probe, since)
    used: set[str] = set()
    tolerance = timedelta(seconds=CLOCK_TOLERANCE_S)
    for index, fault in enumerate(faults):
        following = faults[index + 1] if index + 1 < len(faults) else None
        until = following["_at"] if following and following["node_id"] == fault["node_id"] else None
        history = histories.get(fault["node_id"], [])
        fault["state"] = state_at(history, fault["_at"])
        fault["next_tenant_at"] = next_tenant_at(history, fault["_at"], fault["tenant_id"], tenants)
        fault["incident"] = None
        fault["breaker_refused"] = any(
            fault["_at"] - tolerance <= at and (until is None or at < until) for at in refused.get(fault["node_id"], [])
        )
        # A fault the reset settles, on a tenant's node: no incident by design; the release's wipe
        # resets it before the node's next tenant (`settled_by_wipe`).
        fault["settled_by_wipe"] = (
            bool(fault["xids"])
            and set(fault["xids"]) <= RESET_SETTLED_XIDS
            and fault["state"] in HELD_STATES
            and (fault["next_tenant_at"] is None or wiped_between(history, fault["_at"], fault["next_tenant_at"]))
        )
        for incident in by_node.get(fault["node_id"], []):
            if incident["id"] in used or incident["_created"] < fault["_at"] - tolerance:
                continue
            if until is None or incident["_created"] < until:
                used.add(incident["id"])
                fault["incident"] = incident
            break

    per_category: dict[str, dict] = {}
    for category in FaultCategory:
        mine = [f for f in faults if f["category"] == category.value]
        in_service = [f for f in mine if f["state"] in IN_SERVICE]
        detected = [f for f in in_service if f["incident"] is not None]
        latency = [(f["incident"]["_created"] - f["_at"]).total_seconds() for f in detected]
        held = [
            (f["incident"]["_created"] - f["_at"]).total_seconds()
            for f in detected
            if f["state"] in ("reserved", "provisioning", "active")
        ]
        settled = [f for f in in_service if f["incident"] is None and f["settled_by_wipe"]]
        caught = settled + [
            f
            for f in in_service
            if f["incident"] is not None
            and (f["next_tenant_at"] is None or f["incident"]["_created"] < f["next_tenant_at"])
        ]
        filed: dict[str, int] = {}
        for f in detected:
            filed[f["incident"]["category"]] = filed.get(f["incident"]["category"], 0) + 1
        per_category[category.value] = {
            "hardware_faults": len(mine),
            "in_service": len(in_service),
            "on_held_nodes": sum(1 for f in in_service if f["state"] != "available"),
            "detected": len(detected),
            "settled_by_wipe": len(settled),
            "detect_p50_s": _seconds(latency, 50),
            "detect_p99_s": _seconds(latency, 99),
            "detect_held_p99_s": _seconds(held, 99),
            "caught_before_next_tenant": round(len(caught) / len(in_service), 3) if in_service else None,
            "went_to_next_tenant_first": sum(
                1 for f in in_service if f not in caught and f["next_tenant_at"] is not None
            ),
            "undetected_breaker_refused": sum(1 for f in in_service if f["incident"] is None and f["breaker_refused"]),
            "out_of_service": len(mine) - len(in_service),
            "out_of_service_detected": sum(1 for f in mine if f not in in_service and f["incident"] is not None),
            "incident_category": filed,
            "no_xid": category in NON_XID_CATEGORIES,
            "application": category.value in APPLICATION,
        }
    unmatched = [i for found in by_node.values() for i in found if i["id"] not in used]
    faulted_before = {
        i["id"] for i in unmatched if any(f["node_id"] in i["node_ids"] and f["_at"] <= i["_created"] for f in faults)
    }
    non_xid = [
        v["detect_p99_s"]
        for c, v in per_category.items()
        if v["no_xid"] and not v["application"] and v["detect_p99_s"] is not None
    ]
    return {
        "faults": [
            {k: v for k, v in f.items() if not k.startswith("_")}
            | {
                "incident": f["incident"]["id"] if f["incident"] else None,
                "incident_opened": f["incident"]["created_at"] if f["incident"] else None,
                "next_tenant_at": f["next_tenant_at"].isoformat() if f["next_tenant_at"] else None,
            }
            for f in faults
        ],
        "breaker_refusals": sum(len(v) for v in refused.values()),
        "by_category": per_category,
        "categories_undetected": sorted(
            c
            for c, v in per_category.items()
            if v["in_service"] > v["settled_by_wipe"] and not v["detected"] and not v["application"]
        ),
        "faults_undetected": sum(v["in_service"] - v["detected"] - v["settled_by_wipe"] for v in per_category.values()),
        "faults_settled_by_wipe": sum(v["settled_by_wipe"] for v in per_category.values()),
        "non_xid_detect_p99_s": max(non_xid) if non_xid else None,
        "false_pulls": len(unmatched) - len(faulted_before),
        "false_pull_incidents": sorted(i["id"] for i in unmatched if i["id"] not in faulted_before)[:10],
        "extra_incidents": len(faulted_before),
    }


def replacement_waits(probe: Probe, since: datetime) -> tuple[list[float], int]:
    """Each replacement's wait: from the pull (the allocation's `degraded` event for the node)
    to the replacement attached (its `replaced` event); and the pulls never replaced."""
    events = probe.rows(
        "SELECT allocation_id, kind, node_id, at FROM allocationevent "
        "WHERE at >= :t AND kind IN ('degraded', 'replaced') ORDER BY seq",
        t=since,
    )
    pulled: dict[tuple[str, str], datetime] = {}
    waits = []
    for allocation_id, kind, node_id, at in events:
        key = (allocation_id, node_id)
        if kind == "degraded":
            pulled.setdefault(key, _utc(at))
        elif key in pulled:
            waits.append((_utc(at) - pulled.pop(key)).total_seconds())
    return waits, len(pulled)


def at_replay_rate(
    probe: Probe, incidents: list[dict], start: datetime, end: datetime, *, held: int, probability: float
) -> dict:
    """The spares the replay itself needed, by the same M/G/inf model as `GET /v1/fleet/spares`
    (`health/spares.py`) but on what it measured, in wall time: the mean count of nodes out (each
    pulled node from its incident's opening to its next return to `available`, or the end),
    whose Poisson quantile at `probability` is the spares needed, beside the spares held back."""
    span = (end - start).total_seconds()
    out_s, turnaround, failures = 0.0, [], 0
    for incident in incidents:
        opened = _utc(incident["created_at"])
        if not start <= opened <= end or not incident["node_ids"]:
            continue
        failures += 1
        back = probe.rows(
            "SELECT min(at) FROM nodetransition WHERE node_id = :n AND to_state = 'available' "
            "AND from_state <> 'available' AND at > :t",
            n=incident["node_ids"][0],
            t=opened,
        )[0][0]
        returned = _utc(back) if back is not None else None
        if returned is not None:
            turnaround.append((returned - opened).total_seconds())
        out_s += (min(returned or end, end) - opened).total_seconds()
    mean_out = out_s / span if span > 0 else 0.0
    return {
        "failures": failures,
        "nodes_out_mean": round(mean_out, 2),
        "turnaround_p50_s": _seconds(turnaround, 50),
        "still_out_after_settling": failures - len(turnaround),
        "spares_needed": poisson_quantile(probability, mean_out),
        "spares_held_back": held,
    }


def spares_figure(
    api: httpx.Client, probe: Probe, since: datetime, end: datetime, incidents: list[dict], *, held: int
) -> dict:
    """Spares each pool needs (`GET /v1/fleet/spares`) beside the replacement wait seen."""
    response = api.get("/v1/fleet/spares")
    response.raise_for_status()
    keep = (
        "pool",
        "nodes",
        "spares_held",
        "spares_needed",
        "shortfall",
        "failures",
        "rate_source",
        "failures_per_node_hour",
        "repair_hours",
        "replacement_target_hours",
        "expected_out",
        "spare_on_failure",
    )
    waits, unreplaced = replacement_waits(probe, since)
    pools = response.json()["pools"]
    probability = pools[0]["probability"] if pools else 0.99
    return {
        "pools": [{k: pool.get(k) for k in keep} for pool in pools],
        "at_replay_rate": at_replay_rate(probe, incidents, since, end, held=held, probability=probability),
        "replacements_measured": len(waits),
        "replacement_wait_p50_s": _seconds(waits, 50),
        "replacement_wait_p99_s": _seconds(waits, 99),
        "pulls_not_replaced": unreplaced,
    }


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
    parser.add_argument(
        "--min-per-category",
        type=int,
        default=None,
        help="inject at least this many faults of every category (default: 1 with --quick, else 0)",
    )
    add_temporal_db_arg(parser)
    args = parser.parse_args()
    nodes, days, wall_s = (96, 270.0, 45.0) if args.quick else (args.nodes, args.days, args.wall_s)
    minimum = args.min_per_category if args.min_per_category is not None else (1 if args.quick else 0)
    time_scale = days * 86_400 / wall_s

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # The health loop may pull more than its default share when the fault rate is compressed.
    os.environ["GPUCLOUD_HEALTH__BREAKER_MAX_PULLED_SHARE"] = "0.5"
    # Its window is an hour of fleet time (milliseconds of wall time): with the default wall
    # hour, months of the fleet's faults would fall in one window and the breaker would refuse
    # a fifth of the pulls, tenants' budgets spent (what an operator is asked to decide on).
    os.environ["GPUCLOUD_HEALTH__BREAKER_WINDOW_S"] = repr(3600.0 / time_scale)
    # Likewise the correlation window (`health/correlation.py`, 5 minutes): in fleet time, or any
    # three independent faults behind one rack within 5 wall minutes (months of the fleet's) would
    # be held as one rack incident and not pulled.
    os.environ["GPUCLOUD_HEALTH__CORRELATION_WINDOW_S"] = repr(300.0 / time_scale)
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

        log(f"replay: faults on for {wall_s:g} s" + (f", at least {minimum} of each category" if minimum else ""))
        cpu_before, started = control_plane_cpu(stack), datetime.now(UTC)
        # The forced faults' checkpoints spread over the first three quarters of the replay (the
        # rarest category's last, at 11/12 of that): time is left to detect each.
        sim.run_faults(True, minimum_per_category=minimum, over_fleet_s=0.75 * days * 86_400)
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
        replay_wall_s = (ended - started).total_seconds()
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
        incidents = list_incidents(api)
        detected = detection(probe, incidents, summary["injections"], started)
        (data_dir / "replay_faults.json").write_text(json.dumps(detected["faults"], indent=1))
        for fault in detected["faults"]:
            if fault["incident"] is None and fault["state"] in IN_SERVICE and not fault["settled_by_wipe"]:
                log(
                    f"  undetected: {fault['category']} on {fault['node_id']} ({fault['state']}) at {fault['at']}"
                    + (", the circuit breaker refused its pull" if fault["breaker_refused"] else "")
                )
        log(f"  each fault and its incident: {data_dir / 'replay_faults.json'}")
        spares = spares_figure(api, probe, started, ended, incidents, held=len(held))
        figures = {
            "nodes": nodes,
            "allocations": len(allocations),
            "fleet_days": round(summary["fleet_days"], 2),
            "time_scale": round(time_scale),
            # Fleet time the fault model actually ran per wall second of the replay.
            "fleet_s_per_wall_s": round(summary["fleet_days"] * 86_400 / replay_wall_s) if replay_wall_s else None,
            "time_base": "detect_* and replacement_wait_* are wall seconds: the control plane runs "
            "uncompressed, so they are also its simulated-time latencies; only fault arrivals "
            "(and counter drift) are compressed",
            "faults_injected": summary["injected"],
            "minimum_per_category": summary.get("minimum_per_category", 0),
            "faults_forced": summary.get("forced", {}),
            "faults_by_cause": {
                c: {
                    "injected": v["injected"],
                    "forced": v.get("forced", 0),
                    "share": round(v["share"], 3),
                    "paper_share": round(v["paper_share"], 3),
                }
                for c, v in summary["by_category"].items()
            },
            "detection_by_category": detected["by_category"],
            "categories_undetected": detected["categories_undetected"],
            "categories_never_pulled_by_design": list(APPLICATION),
            "faults_undetected": detected["faults_undetected"],
            "faults_settled_by_wipe": detected["faults_settled_by_wipe"],
            "non_xid_detect_p99_s": detected["non_xid_detect_p99_s"],
            "false_pulls": detected["false_pulls"],
            "false_pull_incidents": detected["false_pull_incidents"],
            "extra_incidents": detected["extra_incidents"],
            "breaker_refusals": detected["breaker_refusals"],
            "spares": spares,
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
            f"{len(false_drains)} false drains, {len(stuck_nodes)} stuck; "
            f"undetected categories {detected['categories_undetected']}, "
            f"non-XID detection p99 {detected['non_xid_detect_p99_s']} s, {detected['false_pulls']} false pulls"
        )
    finally:
        stack.stop()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
