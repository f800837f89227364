"""Scale-out on the engine: the control plane as separate processes against one Temporal server
and one Postgres (two API processes, three workers, the simulated fabric managers and fleet),
bring-up throughput with one worker and then with three in the same run, then tenants' creates
and cancels through both API processes with a burst of faults while one worker and one API
process are killed with SIGKILL; afterwards every allocation and node is checked in the DB.

Prints (last line, JSON): bring-up nodes/s with 1 and 3 workers and `ratio_3_workers`;
allocations answered, completed, `lost` (answered 202 but not in the DB: target 0),
`double_allocated` (nodes in two live allocations: target 0), `stuck_nodes` (nodes still in a
transitional state, or allocations not ended, once everything was cancelled and given
`--settle` seconds: target 0), kills and faults injected. Temporal spreads the work over the
workers; nothing here schedules it.

    .venv/bin/python benchmarks/scale_out.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from common import log, onboard_tenant, reset_postgres

from gpucloud.config import Settings
from gpucloud.db import migrate
from gpucloud.devstack.stack import Stack, free_port
from gpucloud.ledger.db import LedgerDatabase
from gpucloud.sim.client import SimFleetClient

POSTGRES = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
TRANSITIONAL = ("enrolled", "inspecting", "burn_in", "reserved", "provisioning", "releasing", "wiping", "draining")


class Processes:
    """The control plane's processes, each its own OS process with the stack's environment."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.procs = stack, {}

    def spawn(self, name: str, *args: str, **env: str) -> None:
        log_path = self.stack.log_dir / f"{name}.log"
        with open(log_path, "ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "gpucloud.cli.main", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.stack.env(), "GPUCLOUD_LOG_LEVEL": "WARNING", **env},
                start_new_session=True,
            )

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer")


def count(engine: sa.Engine, sql: str, **params) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(sql), params).scalar() or 0)


def bring_up(op: httpx.Client, engine: sa.Engine, nodes: list[dict], timeout_s: float) -> float:
    """Enroll the nodes; nodes per second until every one is available."""
    ids = [n["id"] for n in nodes]
    started = time.monotonic()
    for i in range(0, len(nodes), 500):
        op.post("/v1/nodes:enroll", json={"nodes": nodes[i : i + 500]}).raise_for_status()
    while True:
        ready = count(engine, "SELECT count(*) FROM node WHERE state = 'available' AND id = ANY(:ids)", ids=ids)
        if ready == len(ids):
            return len(ids) / (time.monotonic() - started)
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"bring-up: {ready}/{len(ids)} available after {timeout_s:g} s")
        time.sleep(0.25)


class Clients:
    """Tenants' clients: create 1-node allocations (each under its own Idempotency-Key, retried
    with it against the other API process until answered) and cancel about half of them."""

    def __init__(self, urls: list[str], keys: list[str]) -> None:
        self.urls, self.keys = urls, keys
        self.answered: set[str] = set()
        self.unanswered = 0
        self.retries = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _send(
        self, rng: random.Random, key: str, method: str, path: str, *, headers: dict | None = None, **kwargs
    ) -> httpx.Response | None:
        deadline = time.monotonic() + 60
        attempt = 0
        while time.monotonic() < deadline:
            url = self.urls[(attempt + rng.randrange(2)) % len(self.urls)]
            attempt += 1
            try:
                answer = httpx.request(
                    method,
                    url + path,
                    headers={"Authorization": f"Bearer {key}", **(headers or {})},
                    timeout=15,
                    **kwargs,
                )
            except httpx.HTTPError:
                answer = None
            if answer is not None and answer.status_code < 500 and answer.status_code != 429:
                return answer
            with self.lock:
                self.retries += 1
            time.sleep(0.3)
        return None

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        key = self.keys[seed % len(self.keys)]
        while not self.stop.is_set():
            body = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}
            idem = {"Idempotency-Key": str(uuid.uuid4())}
            answer = self._send(rng, key, "POST", "/v1/allocations", json=body, headers=idem)
            if answer is None:
                with self.lock:
                    self.unanswered += 1
                continue
            if answer.status_code in (200, 202):
                allocation_id = answer.json()["allocation"]["id"]
                with self.lock:
                    self.answered.add(allocation_id)
                time.sleep(rng.uniform(0.5, 3))
                if rng.random() < 0.5:
                    self._send(rng, key, "POST", f"/v1/allocations/{allocation_id}/cancel")
            else:
                time.sleep(0.5)  # 409: no capacity now, quota: try again later


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres-url", default=POSTGRES)
    parser.add_argument("--nodes", type=int, default=200, help="nodes brought up in each phase (two phases)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0, help="the creates-and-cancels phase")
    parser.add_argument("--faults", type=float, default=0.05, help="share of active nodes given a fatal XID")
    parser.add_argument("--settle", type=float, default=240.0)
    parser.add_argument("--latency-scale", type=float, default=0.02, help="the simulated agents' action latency")
    parser.add_argument("--quick", action="store_true", help="60 nodes a phase, 4 clients, 25 s")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.clients, args.seconds = 60, 4, 25.0
    reset_postgres(args.postgres_url)
    data_dir = Path(tempfile.mkdtemp(prefix="gpucloud-scale-out-"))
    api_ports = [free_port(), free_port()]
    settings = Settings(
        data_dir=data_dir,
        database={"url": args.postgres_url, "migrate_on_start": False},
        temporal={"address": f"127.0.0.1:{free_port()}"},
        api={"port": api_ports[0], "operator_token": "bench-token"},
        agent={"sim_port": free_port()},
        reconciler={"sweep_interval_s": 2.0},
    )
    stack = Stack(
        settings,
        nodes=2 * args.nodes,
        ui_port=free_port(),
        sim_latency_scale=args.latency_scale,
        headless=True,
        register_fleet=False,
        temporal_persist=False,
        sim_heartbeat_s=0,
    )
    procs = Processes(stack)
    engine = sa.create_engine(args.postgres_url)
    result: dict = {"nodes_per_phase": args.nodes, "clients": args.clients, "seconds": args.seconds}
    try:
        migrate(settings.database_url)  # the deployment step; the processes only check
        LedgerDatabase(settings.ledger_database_url).migrate()
        stack.start(only=("temporal", "fabric", "sim"))
        urls = [f"http://127.0.0.1:{port}" for port in api_ports]
        for i, port in enumerate(api_ports, start=1):
            procs.spawn(f"api-{i}", "api", GPUCLOUD_API__PORT=str(port))
        for url in urls:
            wait_http(f"{url}/healthz")
        procs.spawn("worker-1", "worker")
        with SimFleetClient(settings.sim_url, token=settings.operator_token, timeout_s=60) as sim:
            inventory = sim.inventory()
        op = httpx.Client(base_url=urls[0], headers={"Authorization": "Bearer bench-token"}, timeout=60)

        log(f"bring-up of {args.nodes} nodes with 1 worker")
        result["bringup_nodes_per_s_1_worker"] = round(bring_up(op, engine, inventory[: args.nodes], 600), 2)
        procs.spawn("worker-2", "worker")
        procs.spawn("worker-3", "worker")
        time.sleep(3)  # the new workers poll
        log(f"bring-up of {args.nodes} more nodes with 3 workers")
        result["bringup_nodes_per_s_3_workers"] = round(bring_up(op, engine, inventory[args.nodes :], 600), 2)
        result["ratio_3_workers"] = round(
            result["bringup_nodes_per_s_3_workers"] / result["bringup_nodes_per_s_1_worker"], 3
        )

        keys = [onboard_tenant(op, f"scale-{i}-{uuid.uuid4().hex[:6]}") for i in range(2)]
        clients = Clients(urls, keys)
        threads = [threading.Thread(target=clients.run, args=(i,), daemon=True) for i in range(args.clients)]
        log(f"{args.clients} clients for {args.seconds:g} s through both API processes; kills and faults mid-run")
        for thread in threads:
            thread.start()
        started = time.monotonic()
        events = [
            (args.seconds * 0.25, "faults"),
            (args.seconds * 0.4, "kill worker-1"),
            (args.seconds * 0.55, "kill api-2"),
        ]
        faults = 0
        for at, what in events:
            time.sleep(max(0.0, started + at - time.monotonic()))
            log(f"  t={time.monotonic() - started:.0f}s: {what}")
            if what == "faults":
                with engine.connect() as conn:
                    active = [r[0] for r in conn.execute(sa.text("SELECT id FROM node WHERE state = 'active'"))]
                for node_id in (
                    random.Random(7).sample(active, max(1, int(len(active) * args.faults))) if active else []
                ):
                    if op.post(f"/v1/nodes/{node_id}/xid", json={"xid": 79}).status_code == 200:
                        faults += 1
            elif what.startswith("kill"):
                procs.kill(what.split()[1])
        time.sleep(max(0.0, started + args.seconds - time.monotonic()))
        clients.stop.set()
        for thread in threads:
            thread.join(90)
        result.update(faults_injected=faults, killed=["worker-1", "api-2"], client_retries=clients.retries)

        log("cancelling every allocation, then waiting for the fleet to settle")
        with engine.connect() as conn:
            live = [
                r[0]
                for r in conn.execute(sa.text("SELECT id FROM allocation WHERE status NOT IN ('released', 'failed')"))
            ]
        for allocation_id in live:
            op.post(f"/v1/allocations/{allocation_id}/cancel")
        deadline = time.monotonic() + args.settle
        while time.monotonic() < deadline:
            open_allocations = count(
                engine, "SELECT count(*) FROM allocation WHERE status NOT IN ('released', 'failed')"
            )
            busy = count(engine, "SELECT count(*) FROM node WHERE state = ANY(:s)", s=list(TRANSITIONAL))
            if open_allocations == 0 and busy == 0:
                break
            time.sleep(1)
        with engine.connect() as conn:
            known = {r[0] for r in conn.execute(sa.text("SELECT id FROM allocation"))}
            # An allocation that became ready settled its create operation as succeeded.
            completed = conn.execute(
                sa.text(
                    "SELECT count(*) FROM operation WHERE kind = 'create_allocation' AND status = 'succeeded' "
                    "AND resource_id = ANY(:ids)"
                ),
                {"ids": list(clients.answered)},
            ).scalar()
            holders = conn.execute(
                sa.text("SELECT node_ids FROM allocation WHERE status NOT IN ('released', 'failed')")
            ).all()
            states = dict(conn.execute(sa.text("SELECT state, count(*) FROM node GROUP BY state")).all())
        held = [n for (ids,) in holders for n in (ids if isinstance(ids, list) else json.loads(ids))]
        result.update(
            allocations_answered=len(clients.answered),
            allocations_unanswered=clients.unanswered,
            allocations_completed=int(completed or 0),
            lost=len(clients.answered - known),
            double_allocated=len(held) - len(set(held)),
            stuck_nodes=sum(states.get(s, 0) for s in TRANSITIONAL) + open_allocations,
            node_states=states,
        )
    finally:
        procs.stop()
        stack.stop()
        engine.dispose()
        shutil.rmtree(data_dir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
