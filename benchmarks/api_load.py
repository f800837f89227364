"""The public API under concurrent clients, against the floor the same machine reaches.

A private stack (`gpucloud up`'s processes: Temporal dev server, worker, API, simulated fleet)
on SQLite and, when it answers, on Postgres. One tenant's clients run a mix for `--seconds` at
each level of concurrency: list allocations (40 %), get one (40 %), create a 1-node allocation
and cancel it (20 %). In the same run, the floor: a minimal FastAPI app on the same database
(`api_floor.py`, its own process) doing the same primary-key read with the same client.

Figures per database and level: requests/s, p50/p99 per operation, timeouts (no answer in
`TIMEOUT_S`), 5xx other than 503, 503s and 429s (both carry Retry-After, which the clients
honour, as `gpucloud.client` does). Then:
- `ratio_get_vs_floor`: the API's get rate at 64 clients over the floor's, and the two p99s;
- `fairness_p99_ratio`: a second tenant's single client's get p99 while the first runs the top
  level, over its p99 alone; `fairness_floor_p99_ratio`: the same for a single client of the
  floor app (its own process) beside the same load on the API, which is what the machine's
  contention alone costs; `fairness_vs_floor` is the first over the second;
  `fairness_machine_p99_ratio`: the floor app's client beside the load over the API's probe
  alone, the least any process on this machine reaches against the target's own denominator,
  and `fairness_beside_vs_floor_beside`: the API's probe beside the load over the floor app's;
- `fleet_capacity_nodes`: the largest fleet whose agents' heartbeats (each node its own request,
  every 10 s, sent open loop as real agents' timers send them: a report goes out when due, and
  its latency counts from then) the API answers with p99 <= 1 s and nothing but 2xx while 64
  tenant clients run the mix; `floor_capacity_nodes`: the same for the floor app's primary-key
  read beside the same tenant load (what the machine leaves for one request with one read), and
  `fleet_capacity_vs_floor`. `fleet_alone_capacity_nodes` and `floor_alone_capacity_nodes`: both
  with no tenant load (what one API process holds for agents, against the floor app). The
  fleet's reports come from 64 nodes' credentials, each node sending the share of the fleet's
  rate (a 2,000-node fleet: 200 reports/s, about 3 a second per node), so a report's refresh
  write (one per node per third of the heartbeat timeout) is rarer than in a real fleet of that
  size: these figures are for reports that change nothing.

- `goodput_ratio_4x`: clients that ignore Retry-After (a refused request is sent again at once),
  spread over 8 tenants, each listing allocations: 2xx answers per second at the client count
  where they peak (of `GOODPUT_LEVELS`), and at 4x that count, over the peak's (target >= 0.8:
  refusals must not eat the capacity they protect). `goodput_ratio_8x` the same at 8x: with the
  peak at 32 clients that is 256, 32 a tenant against a tenant's share of 16 slots (measured:
  104 to 136 refusals in 10 s beside 3,500 to 4,400 answers; the lane's 32 slots bind first).

    python benchmarks/api_load.py [--quick] [--db sqlite|postgres|both] [--seconds S] [--agents-api]
                                  [--heartbeats-only] [--capacity-only] [--goodput-only]

`--agents-api`: the agents' reports go to an API process of their own (the same code and database
on another port) instead of the tenants' one.

`--capacity-only`: only `fleet_capacity_nodes` and the floor's, alternated twice.

`--goodput-only`: only `goodput_ratio_4x` and `goodput_ratio_8x`.

`--heartbeats-only`: 12 agents' heartbeats on an otherwise idle stack, and the floor app's read
from 12 clients, alternated twice (`heartbeats_idle_vs_floor`): the cost of one report with
nothing beside it.

Progress on stderr; one JSON line of figures last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_stack, log, onboard_tenant, reset_postgres
from common import percentile as nearest_rank

from gpucloud.devstack.stack import free_port
from gpucloud.protocol.reporter import ReportClient
from gpucloud.protocol.reports import Heartbeat
from gpucloud.sim.client import SimFleetClient

TIMEOUT_S = 30.0
POSTGRES = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
HEARTBEAT_S = 10.0
# A paced sender this far behind its schedule stops: that fleet size has failed.
BEHIND_S = 5.0
# ... or with this many reports unanswered (more would only queue in the sender).
MAX_UNANSWERED = 256
# Impatient clients (of 8 tenants) at which goodput is measured; the peak's 4x after them.
GOODPUT_TENANTS = 8
GOODPUT_LEVELS = (16, 32, 64)
DETAIL = ("levels", "floor", "heartbeats", "floor_reports", "goodput")  # kept under "results", not repeated at the top


def percentile(values: list[float], q: float) -> float:
    """`common.percentile`, NaN for no values (a figure that rounds and divides)."""
    found = nearest_rank(values, q)
    return math.nan if found is None else found


class Tally:
    def __init__(self) -> None:
        self.latency: defaultdict[str, list[float]] = defaultdict(list)
        self.status: Counter[str] = Counter()
        self.errors: list[str] = []

    def add(self, op: str, status: int | str, seconds: float) -> None:
        self.status[str(status)] += 1
        if isinstance(status, int) and status < 500 and status != 429:
            self.latency[op].append(seconds)

    def figures(self, seconds: float) -> dict:
        answered = sum(n for s, n in self.status.items() if s not in ("timeout", "transport", "behind"))
        return {
            "requests_per_s": round(answered / seconds, 1),
            **{f"{op}_p50_s": round(percentile(v, 50), 3) for op, v in sorted(self.latency.items())},
            **{f"{op}_p99_s": round(percentile(v, 99), 3) for op, v in sorted(self.latency.items())},
            "timeouts": self.status["timeout"],
            "transport_errors": self.status["transport"],
            "errors_5xx": sum(n for s, n in self.status.items() if s.startswith("5") and s != "503"),
            "overloaded_503": self.status["503"],
            "throttled_429": self.status["429"],
        }


async def _timed(
    tally: Tally, op: str, call, *, began: float | None = None, patient: bool = True
) -> httpx.Response | None:
    """Send `call` and count its answer; its latency from `began` (default: now). A `patient`
    client waits out a refusal's Retry-After; an impatient one returns at once."""
    began = time.monotonic() if began is None else began
    try:
        response = await call
    except httpx.TimeoutException:
        tally.add(op, "timeout", time.monotonic() - began)
        return None
    except httpx.TransportError as exc:  # a connection refused or reset: no answer either
        tally.add(op, "transport", time.monotonic() - began)
        tally.errors.append(f"{op}: {exc!r}")
        return None
    tally.add(op, response.status_code, time.monotonic() - began)
    if patient and response.status_code in (429, 503):
        # A well-behaved client (as `gpucloud.client` is) waits as long as it was told to.
        retry_after = response.headers.get("retry-after")
        if retry_after is None:
            tally.add(op, "no-retry-after", 0.0)
        await asyncio.sleep(float(retry_after or 1))
    return response


async def mixed_client(http: httpx.AsyncClient, tally: Tally, ids: list[str], until: float, rng: random.Random):
    while time.monotonic() < until:
        roll = rng.random()
        if roll < 0.4:
            await _timed(tally, "list", http.get("/v1/allocations", params={"page_size": 50}))
        elif roll < 0.8:
            await _timed(tally, "get", http.get(f"/v1/allocations/{rng.choice(ids)}"))
        else:
            body = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}
            headers = {"Idempotency-Key": uuid.uuid4().hex}
            created = await _timed(tally, "create", http.post("/v1/allocations", json=body, headers=headers))
            if created is not None and created.status_code == 202:
                alloc_id = created.json()["allocation"]["id"]
                await _timed(tally, "cancel", http.post(f"/v1/allocations/{alloc_id}/cancel"))


async def get_client(http: httpx.AsyncClient, tally: Tally, ids: list[str], until: float, rng: random.Random):
    while time.monotonic() < until:
        await _timed(tally, "get", http.get(f"/v1/allocations/{rng.choice(ids)}"))


async def impatient_client(http: httpx.AsyncClient, tally: Tally, until: float, rng: random.Random):
    """A tenant's client that ignores Retry-After: a refused list is sent again at once."""
    while time.monotonic() < until:
        await _timed(tally, "list", http.get("/v1/allocations", params={"page_size": 10}), patient=False)


async def heartbeat_client(http: httpx.AsyncClient, tally: Tally, agents: dict[str, str], until: float, rng):
    """An agent as real ones report: its own node, its own credential, one heartbeat a request."""
    while time.monotonic() < until:
        node_id = rng.choice(sorted(agents))
        beat = ReportClient(http).heartbeats([Heartbeat(node_id=node_id)], credential=agents[node_id])
        await _timed(tally, "heartbeat", beat)


def _client(url: str, token: str | None, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=TIMEOUT_S, limits=limits)


async def run_clients(url: str, token: str | None, n: int, seconds: float, body, *args) -> Tally:
    tally = Tally()
    until = time.monotonic() + seconds
    async with _client(url, token, n) as http:
        await asyncio.gather(*(body(http, tally, *args, until, random.Random(i)) for i in range(n)))
    return tally


def _group(url: str, token: str | None, n: int, seconds: float, body_name: str, args: tuple) -> Tally:
    return asyncio.run(run_clients(url, token, n, seconds, globals()[body_name], *args))


async def apart(fn, *args) -> Tally:
    """`fn(*args)` in a process of its own: when two groups run at once, one group's
    client-side queueing (256 clients on one event loop) must not show as the other's latency."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return await asyncio.wrap_future(pool.submit(fn, *args))


async def run_apart(url: str, token: str | None, n: int, seconds: float, body, *args) -> Tally:
    """`run_clients` in a process of its own (`apart`)."""
    return await apart(_group, url, token, n, seconds, body.__name__, args)


async def measure(
    settings, floor_url: str, keys: tuple[str, str], ids: list[str], nodes: dict[str, str], args, agents_url: str
) -> dict:
    api = settings.api_url
    tenant_key, other_key = keys
    if args.heartbeats_only:
        return await _heartbeats_alone(agents_url, floor_url, ids, nodes, args)
    if args.goodput_only:
        return await _goodput(api, args.goodput_keys, args.seconds, floor_url, ids)
    if args.capacity_only:
        alone = await _capacities_alone(ids, nodes, args, agents_url, floor_url)
        return {**alone, **await _capacities(api, tenant_key, ids, nodes, args, agents_url, floor_url, args.tries)}
    capacity_alone = await _capacities_alone(ids, nodes, args, agents_url, floor_url)
    levels, floors = {}, {}
    for n in args.levels:
        tally = await run_clients(api, tenant_key, n, args.seconds, mixed_client, ids)
        levels[n] = tally.figures(args.seconds)
        floor_tally = await run_clients(floor_url, None, n, args.seconds, get_client, ids)
        floors[n] = floor_tally.figures(args.seconds)
        log(f"  {n:>4} clients: API {levels[n]}  floor {floors[n]['requests_per_s']} req/s")
    # The get rate at 64 clients: the API's gets alone, against the floor's.
    gets = await run_clients(api, tenant_key, 64, args.seconds, get_client, ids)
    get_figures, floor64 = gets.figures(args.seconds), floors.get(64) or floors[max(floors)]
    # Fairness: a second tenant's single client, alone and beside the top level.
    alone = await run_apart(api, other_key, 1, args.seconds, get_client, ids)
    top = max(args.levels)
    loaded, beside = await asyncio.gather(
        run_apart(api, tenant_key, top, args.seconds, mixed_client, ids),
        run_apart(api, other_key, 1, args.seconds, get_client, ids),
    )
    log(f"  fairness: the loaded tenant {loaded.figures(args.seconds)}")
    # What the machine alone does to that client: the same single client against the floor app
    # (its own process, sharing nothing with the API but the machine's 2 cores), alone and beside
    # the same load on the API. No admission policy can do better than a process of its own.
    floor_alone = await run_apart(floor_url, None, 1, args.seconds, get_client, ids)
    _, floor_beside = await asyncio.gather(
        run_apart(api, tenant_key, top, args.seconds, mixed_client, ids),
        run_apart(floor_url, None, 1, args.seconds, get_client, ids),
    )
    floor_alone_p99 = percentile(floor_alone.latency["get"], 99)
    floor_beside_p99 = percentile(floor_beside.latency["get"], 99)
    floor_ratio = floor_beside_p99 / max(floor_alone_p99, 1e-3)
    log(f"  fairness floor: a client of its own process, p99 x{floor_ratio:.2f} beside the load")
    # Agents' heartbeats, each its own request, beside 64 tenant clients, and the floor's.
    capacities = await _capacities(api, tenant_key, ids, nodes, args, agents_url, floor_url, tries=1)
    alone_p99 = percentile(alone.latency["get"], 99)
    beside_p99 = percentile(beside.latency["get"], 99)
    return {
        "levels": levels,
        "floor": floors,
        "get_64_requests_per_s": get_figures["requests_per_s"],
        "get_64_p99_s": get_figures.get("get_p99_s"),
        "floor_64_requests_per_s": floor64["requests_per_s"],
        "floor_64_p99_s": floor64.get("get_p99_s"),
        "ratio_get_vs_floor": round(get_figures["requests_per_s"] / max(floor64["requests_per_s"], 1e-9), 3),
        "fairness_p99_ratio": round(beside_p99 / max(alone_p99, 1e-3), 2),
        "fairness_alone_p99_s": round(alone_p99, 3),
        "fairness_beside_p99_s": round(beside_p99, 3),
        "fairness_floor_p99_ratio": round(floor_ratio, 2),
        "fairness_floor_alone_p99_s": round(floor_alone_p99, 3),
        "fairness_floor_beside_p99_s": round(floor_beside_p99, 3),
        "fairness_vs_floor": round(beside_p99 / max(alone_p99, 1e-3) / max(floor_ratio, 1e-3), 2),
        # The least any process on this machine could reach: the floor app's client beside the
        # same load, over the API's probe alone (the target's own denominator); above 2, no
        # admission policy can bring `fairness_p99_ratio` to 2 in this run.
        "fairness_machine_p99_ratio": round(floor_beside_p99 / max(alone_p99, 1e-3), 2),
        "fairness_beside_vs_floor_beside": round(beside_p99 / max(floor_beside_p99, 1e-3), 2),
        **capacity_alone,
        **capacities,
    }


async def _goodput(api: str, keys: list[str], seconds: float, floor_url: str, ids: list[str]) -> dict:
    """2xx/s from impatient clients spread over the tenants' `keys`: at each of
    `GOODPUT_LEVELS`, then at 4x and 8x the level where it peaked; `goodput_ratio_4x` the 4x
    level's over the peak's. Each tenant's clients run in a process of their own (`apart`).

    The floor: the floor app's read from as many clients in as many processes, at the same
    three counts. On two cores the clients' own processes take CPU from the server as they grow,
    so the floor's ratio is what this machine allows any server; `goodput_ratio_4x_vs_floor` is
    the API's ratio over it (1.0: refusals cost the API nothing beyond what more clients cost)."""

    def spread(clients: int) -> list[int]:
        return [clients // len(keys) + (i < clients % len(keys)) for i in range(len(keys))]

    async def tallied(groups) -> Tally:
        tally = Tally()
        for group in await asyncio.gather(*groups):
            tally.status.update(group.status)
            for kind, samples in group.latency.items():
                tally.latency[kind] += samples
        return tally

    async def ok_per_s(clients: int) -> tuple[float, dict]:
        groups = [
            run_apart(api, key, n, seconds, impatient_client) for key, n in zip(keys, spread(clients), strict=True) if n
        ]
        tally = await tallied(groups)
        ok = sum(n for status, n in tally.status.items() if status.startswith("2"))
        figures = {"ok_per_s": round(ok / seconds, 1), **tally.figures(seconds)}
        log(f"  {clients:>4} impatient clients of {len(keys)} tenants: {figures}")
        return ok / seconds, figures

    async def floor_per_s(clients: int) -> float:
        tally = await tallied([run_apart(floor_url, None, n, seconds, get_client, ids) for n in spread(clients) if n])
        ok = sum(n for status, n in tally.status.items() if status.startswith("2")) / seconds
        log(f"  {clients:>4} floor clients in {len(keys)} processes: {ok:.1f} 2xx/s")
        return ok

    by_level = {n: await ok_per_s(n) for n in GOODPUT_LEVELS}
    peak = max(by_level, key=lambda n: by_level[n][0])
    overload = await ok_per_s(4 * peak)
    double = await ok_per_s(8 * peak)
    floor = {n: await floor_per_s(n) for n in (peak, 4 * peak, 8 * peak)}
    ratio_4x = overload[0] / max(by_level[peak][0], 1e-9)
    floor_4x = floor[4 * peak] / max(floor[peak], 1e-9)
    return {
        "goodput_peak_clients": peak,
        "goodput_peak_ok_per_s": round(by_level[peak][0], 1),
        "goodput_4x_ok_per_s": round(overload[0], 1),
        "goodput_ratio_4x": round(ratio_4x, 3),
        "goodput_8x_ok_per_s": round(double[0], 1),
        "goodput_ratio_8x": round(double[0] / max(by_level[peak][0], 1e-9), 3),
        "floor_goodput_ratio_4x": round(floor_4x, 3),
        "floor_goodput_ratio_8x": round(floor[8 * peak] / max(floor[peak], 1e-9), 3),
        "goodput_ratio_4x_vs_floor": round(ratio_4x / max(floor_4x, 1e-9), 3),
        "goodput": {
            **{str(n): f for n, (_, f) in by_level.items()},
            str(4 * peak): overload[1],
            str(8 * peak): double[1],
            "floor": {str(n): round(f, 1) for n, f in floor.items()},
        },
    }


async def _heartbeats_alone(api: str, floor_url: str, ids: list[str], nodes: dict[str, str], args) -> dict:
    """Heartbeats from 12 agents on an otherwise idle stack, and the floor app's read from as many
    clients, alternated twice: what one API process costs per report, with nothing beside it."""
    beats, reads = [], []
    for _ in range(2):
        beats.append((await run_apart(api, None, 12, args.seconds, heartbeat_client, nodes)).figures(args.seconds))
        reads.append((await run_apart(floor_url, None, 12, args.seconds, get_client, ids)).figures(args.seconds))
        log(f"  12 agents alone: {beats[-1]}  floor: {reads[-1]}")
    best, floor = max(b["requests_per_s"] for b in beats), max(r["requests_per_s"] for r in reads)
    return {
        "heartbeats_idle_per_s": best,
        "floor_idle_per_s": floor,
        "heartbeats_idle_vs_floor": round(best / max(floor, 1e-9), 3),
        "heartbeats": beats,
        "floor_reports": reads,
    }


async def _capacities_alone(ids: list[str], nodes: dict[str, str], args, agents_url: str, floor_url: str) -> dict:
    """Agents' heartbeats and the floor app's read with no tenant load (measured first, before
    any tenant load leaves the worker and the fleet busy): what one API process holds for agents
    (the figure that sizes the processes a 10,000-node fleet needs, docs/architecture.md) against
    what the machine gives the floor app."""
    fleet_alone, _ = await _capacity(args, agents_url, "heartbeat", nodes)
    floor_alone, _ = await _capacity(args, floor_url, "get", ids)
    log(f"  capacity alone: fleet {fleet_alone}  floor {floor_alone}")
    return {
        "fleet_alone_capacity_nodes": fleet_alone,
        "floor_alone_capacity_nodes": floor_alone,
        "fleet_alone_vs_floor_alone": round(fleet_alone / max(floor_alone, 1), 3),
    }


async def _capacities(
    api: str, tenant_key: str, ids: list[str], nodes: dict[str, str], args, agents_url: str, floor_url: str, tries: int
) -> dict:
    """`fleet_capacity_nodes` (agents' heartbeats beside 64 tenant clients) and the floor's (the
    minimal app's read, one request and one read as a heartbeat that changes nothing is, beside
    the same load), alternated `tries` times (the better of each: less of the noise two runs
    minutes apart carry)."""
    fleet, floor, figures = [], [], {}
    tenants = (api, tenant_key, ids)
    for _ in range(tries):
        capacity, figures["heartbeats"] = await _capacity(args, agents_url, "heartbeat", nodes, tenants)
        fleet.append(capacity)
        capacity, figures["floor_reports"] = await _capacity(args, floor_url, "get", ids, tenants)
        floor.append(capacity)
        log(f"  capacity beside 64 tenant clients: fleet {fleet[-1]}  floor {floor[-1]}")
    return {
        **figures,
        "fleet_capacity_nodes": max(fleet, default=0),
        "floor_capacity_nodes": max(floor, default=0),
        "fleet_capacity_vs_floor": round(max(fleet, default=0) / max(max(floor, default=0), 1), 3),
        "fleet_capacity_tries": fleet,
        "floor_capacity_tries": floor,
    }


async def _capacity(args, url: str, kind: str, targets, tenants: tuple | None = None) -> tuple[int, dict]:
    """The largest fleet (nodes reporting every 10 s, open loop) whose reports `url` answers
    with p99 <= 1 s and nothing but 2xx, while 64 tenant clients run the mix on the API where
    `tenants` is given (the API's URL, the tenant's key, the allocations to read); and the
    figures at each fleet size tried. Sizes double from 1,000 until one fails, then halve the
    gap three times (to within an eighth of the last step)."""
    by_size: dict[int, dict] = {}

    async def holds(fleet: int) -> bool:
        paced = apart(_paced_group, url, fleet, args.seconds, kind, targets)
        if tenants is not None:
            api, tenant_key, ids = tenants
            _, reports = await asyncio.gather(run_apart(api, tenant_key, 64, args.seconds, mixed_client, ids), paced)
        else:
            reports = await paced
        figures = by_size[fleet] = reports.figures(args.seconds)
        p99 = max((v for k, v in figures.items() if k.endswith("_p99_s")), default=99)
        bad = sum(n for status, n in reports.status.items() if not status.startswith("2"))
        ok = p99 <= 1.0 and bad == 0
        verdict = "holds" if ok else "fails"
        load = "beside 64 tenant clients" if tenants else "alone"
        log(f"  {kind} from a fleet of {fleet} on {url} {load}: {figures} {verdict}")
        return ok

    good, fleet = 0, 1000
    while fleet <= 64_000 and await holds(fleet):
        good, fleet = fleet, fleet * 2
    bad = fleet
    for _ in range(3):
        middle = (good + bad) // 2
        if await holds(middle):
            good = middle
        else:
            bad = middle
    return good, {str(size): figures for size, figures in sorted(by_size.items())}


async def paced_reports(url: str, fleet: int, seconds: float, kind: str, targets) -> Tally:
    """`fleet` nodes reporting every 10 s for `seconds`, open loop, as a real fleet does: a report
    goes out when it is due whether or not earlier ones were answered, and its latency counts from
    when it was due (a server or sender that falls behind shows as latency, not as fewer reports).
    `kind` "heartbeat": each node's own heartbeat with its own credential (`targets`: node ->
    credential); "get": the floor app's read of an allocation (`targets`: allocation ids)."""
    tally = Tally()
    rate = fleet / HEARTBEAT_S
    keys = sorted(targets)
    start = time.monotonic() + 0.05
    async with _client(url, None, 512) as http:

        async def report(i: int, due: float) -> None:
            key = keys[i % len(keys)]
            if kind == "heartbeat":
                call = ReportClient(http).heartbeats([Heartbeat(node_id=key)], credential=targets[key])
            else:
                call = http.get(f"/v1/allocations/{key}")
            await _timed(tally, kind, call, began=due)

        pending: list[asyncio.Task] = []
        unanswered: set[asyncio.Task] = set()
        for i in range(int(rate * seconds)):
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if time.monotonic() - due > BEHIND_S or len(unanswered) >= MAX_UNANSWERED:
                # Too far behind to catch up: the fleet size fails, without minutes of backlog.
                tally.add(kind, "behind", time.monotonic() - due)
                break
            task = asyncio.create_task(report(i, due))
            unanswered.add(task)
            task.add_done_callback(unanswered.discard)
            pending.append(task)
        if pending:
            # Reports still unanswered this long after the last was sent are timeouts.
            _, late = await asyncio.wait(pending, timeout=TIMEOUT_S)
            for task in late:
                task.cancel()
                tally.add(kind, "timeout", TIMEOUT_S)
    return tally


def _paced_group(url: str, fleet: int, seconds: float, kind: str, targets) -> Tally:
    return asyncio.run(paced_reports(url, fleet, seconds, kind, targets))


def run_on(database: str, args) -> dict:
    overrides: dict = {} if database == "sqlite" else {"database": {"url": args.postgres_url}}
    if args.tenant_slots:
        overrides.setdefault("api", {})["tenant_slots"] = args.tenant_slots
    if args.api_workers:
        overrides.setdefault("api", {})["workers"] = args.api_workers
    if database != "sqlite":
        reset_postgres(args.postgres_url)
    settings, stack, data_dir = bench_stack(args.nodes, "memory", **overrides)
    log(f"{database}: starting a stack with {args.nodes} simulated nodes")
    try:
        stack.start()
        with httpx.Client(
            base_url=settings.api_url, headers={"Authorization": f"Bearer {settings.operator_token}"}, timeout=60
        ) as op:
            with SimFleetClient(settings.sim_url, token=settings.operator_token, timeout_s=30) as sim:
                inventory = sim.inventory()
            op.post("/v1/nodes:enroll", json={"nodes": inventory}).raise_for_status()
            nodes = [n["id"] for n in inventory]
            deadline = time.monotonic() + 600
            while sum(1 for _ in _pages(op, "/v1/nodes", state="available")) < len(nodes):
                if time.monotonic() > deadline:
                    raise SystemExit("the fleet did not come up")
                time.sleep(1)
            # Each reporting agent its own credential, as `gpucloud agent --token` runs. Their
            # nodes are cordoned: a wipe (after a tenant's create and cancel) replaces a credential.
            # At most half the fleet: the rest takes the tenants' allocations.
            reporters = nodes[: min(64, len(nodes) // 2)]
            for node_id in reporters:
                op.post(f"/v1/nodes/{node_id}/cordon").raise_for_status()
            credentials = {
                node_id: op.post(f"/v1/nodes/{node_id}/agent-credential").json()["token"] for node_id in reporters
            }
            tenant_key = onboard_tenant(op, f"load-{uuid.uuid4().hex[:6]}")
            other_key = onboard_tenant(op, f"probe-{uuid.uuid4().hex[:6]}")
            more = GOODPUT_TENANTS - 2 if args.goodput_only else 0
            args.goodput_keys = [tenant_key, other_key] + [
                onboard_tenant(op, f"impatient-{uuid.uuid4().hex[:6]}") for _ in range(more)
            ]
        with httpx.Client(base_url=settings.api_url, headers={"Authorization": f"Bearer {tenant_key}"}) as tenant:
            ids = []
            for _ in range(20):
                body = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}
                created = tenant.post("/v1/allocations", json=body, timeout=60)
                created.raise_for_status()
                ids.append(created.json()["allocation"]["id"])
        log(f"{database}: fleet of {len(nodes)} available, 2 tenants, {len(ids)} allocations to read")
        servers: list[subprocess.Popen] = []
        try:
            floor_port = free_port()
            floor_cmd = [sys.executable, str(Path(__file__).parent / "api_floor.py"), settings.database_url]
            floor_url = _serve(servers, "the floor app", [*floor_cmd, str(floor_port)], floor_port)
            agents_url = settings.api_url
            if args.agents_api:
                # An API process of the agents' own: the same code and settings on another port,
                # as docs/architecture.md proposes for large fleets.
                port = free_port()
                env = {**stack.env(), "GPUCLOUD_API__PORT": str(port), "GPUCLOUD_API__WORKERS": "1"}
                agents_url = _serve(
                    servers, "the agents' API", [sys.executable, "-m", "gpucloud.cli.main", "api"], port, env=env
                )
            keys = (tenant_key, other_key)
            return asyncio.run(measure(settings, floor_url, keys, ids, credentials, args, agents_url))
        finally:
            for proc in servers:
                proc.terminate()
                proc.wait(10)
    finally:
        stack.stop()
        if args.keep_logs:
            log(f"{database}: logs kept in {data_dir / 'logs'}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)


def _serve(servers: list[subprocess.Popen], what: str, cmd: list[str], port: int, env=None) -> str:
    """Start a server process of the benchmark's own (kept in `servers`, to stop) and wait, at
    most a minute, until it answers /healthz on `port`; its URL."""
    servers.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                log(f"{what} at {url}")
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not answer on {url} within a minute")


def _pages(client: httpx.Client, path: str, **params):
    token = ""
    while True:
        page = client.get(path, params={**params, "page_size": 1000, **({"page_token": token} if token else {})}).json()
        yield from page["items"]
        if not (token := page["next_page_token"]):
            return


def _postgres_up(url: str) -> bool:
    import sqlalchemy as sa

    try:
        engine = sa.create_engine(url)
        with engine.connect():
            return True
    except sa.exc.OperationalError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--postgres-url", default=POSTGRES)
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    parser.add_argument("--quick", action="store_true", help="64 nodes, levels 1,16,64, 4 s each")
    parser.add_argument("--keep-logs", action="store_true", help="keep the stack's data dir and logs")
    parser.add_argument("--tenant-slots", type=int, default=0, help="the API's tenant lane (default: its setting)")
    parser.add_argument(
        "--agents-api",
        action="store_true",
        help="agents' reports go to an API process of their own (the same code on another port)",
    )
    parser.add_argument(
        "--heartbeats-only",
        action="store_true",
        help="only 12 agents' heartbeats on an idle stack against the floor app's read (no tenant load)",
    )
    parser.add_argument(
        "--capacity-only",
        action="store_true",
        help="only fleet_capacity_nodes and the floor's, alternated twice (no levels, no fairness)",
    )
    parser.add_argument(
        "--goodput-only",
        action="store_true",
        help="only goodput_ratio_4x: 2xx/s of clients that ignore Retry-After, at their peak and at 4x it",
    )
    parser.add_argument("--tries", type=int, default=2, help="with --capacity-only: searches beside the tenant load")
    parser.add_argument("--api-workers", type=int, default=0, help="API processes (default: what `up` runs)")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.levels, args.seconds = 64, [1, 16, 64], 4.0
    databases = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    if "postgres" in databases and not _postgres_up(args.postgres_url):
        log(f"Postgres does not answer at {args.postgres_url}: SQLite only")
        databases.remove("postgres")
    results = {db: run_on(db, args) for db in databases}
    summary = {
        "benchmark": "api_load",
        "nodes": args.nodes,
        "seconds_per_level": args.seconds,
        "agents_api_process": args.agents_api,
        **{f"{db}_{key}": value for db, r in results.items() for key, value in r.items() if key not in DETAIL},
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
