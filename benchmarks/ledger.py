"""Ledger benchmark: usage ingest throughput over HTTP, and the close of a large period.

    python benchmarks/ledger.py [--quick]

1. Ingest: the ledger runs as its own process (``service.main``, uvicorn) on a fresh SQLite
   file, then on a fresh Postgres database when one answers at 127.0.0.1:5432 (override with
   ``--postgres-url``). Shipper-like clients POST batches of 8,000 samples, each batch one
   node's contiguous backlog, four clients at a time (``--clients``) as many nodes would.
   Bodies are encoded before the clock starts; the rate counts samples the ledger accepted
   per second of wall time. Target: >= 50,000 events/s on SQLite. The ledger process's CPU
   time per event is reported too: on a shared machine it moves much less than the rate.
2. Close: one period holding 10 million usage samples (``--quick``: 200,000), bulk-loaded
   with SQL straight into a migrated SQLite ledger (ingest is measured above; loading 10M
   through it would only repeat that at length), with the postings and running totals
   ingest would have written, so the close's cross-checks hold. The clock covers
   ``invoicing.close_period``, the function ``POST /v1/periods/{id}:close`` runs: freeze,
   GROUP BY aggregation in SQL, pure invoice build, cross-checks, store. Target: <= 120 s.

The machine is reported (CPU count, load average) because the figures are wall-clock ones.
The last stdout line is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from sqlalchemy import create_engine, text

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from gpucloud.db import scratch_postgres  # noqa: E402
from gpucloud.devstack.stack import free_port  # noqa: E402
from gpucloud.ledger.db import LedgerDatabase, open_ledger_database  # noqa: E402
from gpucloud.ledger.invoicing import close_period  # noqa: E402
from gpucloud.ledger.periods import period_bounds  # noqa: E402
from gpucloud.ledger.pricing import Rate  # noqa: E402
from gpucloud.web.service_tokens import LEDGER_AUDIENCE, load_or_create_issuer, public_key_path  # noqa: E402

console = Console(stderr=True)
BATCH = 8_000
PRICE = 2_490_000  # 8 GPU-minutes cost exactly 332,000 micro-units at this price
MINUTE = 60_000
PERIOD = "2024-01"
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextmanager
def ledger_process(database_url: str, log_path: Path):
    """The ledger in its own process, trusting an issuer key beside its log; yields its URL, its
    pid and that issuer (to sign calls as the control plane, an operator or a node's agent).

    Its schema is migrated first, as the deployment step does (`gpucloud prepare`, `gpucloud
    up`): the ledger migrates a SQLite file itself at start, but on Postgres it only checks
    that the schema is current and refuses to start on a fresh database."""
    database = LedgerDatabase(database_url)
    try:
        database.migrate()
    finally:
        database.dispose()
    port = free_port()
    issuer = load_or_create_issuer(log_path.parent / "issuer_key.pem")
    key = public_key_path(log_path.parent / "issuer_key.pem")
    code = (
        "from pathlib import Path; from gpucloud.entrypoints.ledger import main; "
        f"main('127.0.0.1', {port}, {database_url!r}, control_plane_key=Path({str(key)!r}))"
    )
    with log_path.open("ab") as log:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"ledger did not start; {log_path} ends with:\n{tail}") from None
                time.sleep(0.1)
        yield url, process.pid, issuer
    finally:
        process.terminate()
        process.wait(timeout=30)


def postgres_reachable(url: str) -> bool:
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        engine.dispose()
        return True
    except Exception:
        return False


def batch_bodies(batches: int) -> list[bytes]:
    start = period_bounds(PERIOD)[0]
    bodies = []
    for number in range(batches):
        node, allocation, tenant = f"node-{number:05d}", f"alloc-{number % 50:03d}", f"tenant-{number % 10:02d}"
        samples = [
            {
                "node_id": node,
                "seq": seq + 1,
                "allocation_id": allocation,
                "tenant_id": tenant,
                "gpu_type": "h100",
                "gpu_count": 8,
                "start_ms": start + seq * MINUTE,
                "end_ms": start + (seq + 1) * MINUTE,
            }
            for seq in range(BATCH)
        ]
        bodies.append(json.dumps({"samples": samples}, separators=(",", ":")).encode())
    return bodies


def _bearer(issuer, role: str, subject: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {issuer.mint(LEDGER_AUDIENCE, subject=subject or role, role=role)}"}


def seed_ledger(client: httpx.Client, issuer, batches: int) -> None:
    """The price book (as the operator), and each allocation's start and each batch's node in
    its allocation (as the control plane): the ingest checks every sample against them."""
    price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "h100", "price_per_hour_micro": PRICE}]}
    client.post("/v1/price-book/versions", json=price_book, headers=_bearer(issuer, "operator")).raise_for_status()
    control_plane = _bearer(issuer, "control-plane")
    events = [
        {
            "event_id": f"start-{n}",
            "allocation_id": f"alloc-{n:03d}",
            "tenant_id": f"tenant-{n % 10:02d}",
            "kind": "start",
        }
        for n in range(50)
    ] + [
        {
            "event_id": f"node-{n}",
            "allocation_id": f"alloc-{n % 50:03d}",
            "tenant_id": f"tenant-{n % 10:02d}",
            "kind": "node_added",
            "node_id": f"node-{n:05d}",
        }
        for n in range(batches)
    ]
    for event in events:
        event |= {"at_ms": 0, "gpu_type": "h100"}
        client.post("/v1/allocation-events", json=event, headers=control_plane).raise_for_status()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_ingest(
    label: str, database_url: str, bodies: list[bytes], clients: int, log_path: Path
) -> tuple[float, float]:
    """Accepted events per second of wall time, and the ledger's CPU microseconds per event."""
    with (
        ledger_process(database_url, log_path) as (url, pid, issuer),
        httpx.Client(base_url=url, timeout=120, headers=_bearer(issuer, "operator")) as setup,
    ):
        seed_ledger(setup, issuer, len(bodies))
        tokens = [_bearer(issuer, "agent", f"node:node-{n:05d}") for n in range(len(bodies))]
        queue = list(enumerate(bodies))
        lock = threading.Lock()
        accepted = [0]
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"ingest on {label}", total=len(bodies) * BATCH)

            def shipper() -> None:
                # Each batch is one node's, posted with that node's own agent token.
                with httpx.Client(base_url=url, timeout=120) as client:
                    while True:
                        with lock:
                            if not queue:
                                return
                            number, body = queue.pop(0)
                        headers = {"content-type": "application/json", **tokens[number]}
                        response = client.post("/v1/usage:batch", content=body, headers=headers)
                        response.raise_for_status()
                        with lock:
                            accepted[0] += response.json()["accepted"]
                        progress.advance(task, BATCH)

            failures: list[BaseException] = []

            def guarded_shipper() -> None:
                try:
                    shipper()
                except BaseException as error:
                    failures.append(error)

            threads = [threading.Thread(target=guarded_shipper) for _ in range(clients)]
            started, started_cpu = time.perf_counter(), cpu_seconds(pid)
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed, ledger_cpu = time.perf_counter() - started, cpu_seconds(pid) - started_cpu
        if failures:
            log_tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{label}: {failures[0]!r}; ledger log ends with:\n{log_tail}")
        if accepted[0] != len(bodies) * BATCH:
            raise RuntimeError(f"{label}: accepted {accepted[0]} of {len(bodies) * BATCH}")
        usage = setup.get("/v1/usage", params={"tenant_id": "tenant-00"}).json()
        expected = sum(1 for number in range(len(bodies)) if number % 10 == 0) * BATCH
        if usage["sample_count"] != expected:
            raise RuntimeError(f"{label}: tenant-00 has {usage['sample_count']} samples, expected {expected}")
    return accepted[0] / elapsed, ledger_cpu / accepted[0] * 1e6


def bulk_load_period(database_url: str, events: int) -> dict:
    """Fill one period with ``events`` samples (node-major, like shipped backlogs) plus their books."""
    nodes = max(1, events // 5_000)
    per_node = events // nodes
    events = nodes * per_node
    nodes_per_allocation, tenants = 4, 100
    allocations = (nodes + nodes_per_allocation - 1) // nodes_per_allocation
    start = period_bounds(PERIOD)[0]
    database = open_ledger_database(database_url)
    with database.write() as connection:
        connection.execute(text("INSERT INTO price_book_versions VALUES (1, 0, '', 0)"))
        connection.execute(text(f"INSERT INTO price_book_prices VALUES (1, 'h100', {PRICE})"))
        for allocation in range(allocations):
            allocation_nodes = min(nodes_per_allocation, nodes - allocation * nodes_per_allocation)
            samples = allocation_nodes * per_node
            gpu_ms, amount = samples * 8 * MINUTE, samples * 332_000
            tenant = f"tenant-{allocation % tenants:03d}"
            values = {
                "id": allocation + 1,
                "tenant": tenant,
                "allocation": f"alloc-{allocation:05d}",
                "gpu_ms": gpu_ms,
                "amount": amount,
                "count": samples,
                "max_start": start + (per_node - 1) * MINUTE,
                "receivable": f"tenant:{tenant}:receivable",
            }
            connection.execute(
                text(
                    "INSERT INTO postings (id, kind, billing_period, usage_period, tenant_id, allocation_id, gpu_type,"
                    " price_version_id, gpu_ms, amount_micro, sample_count, created_ms) VALUES"
                    " (:id, 'usage', '2024-01', '2024-01', :tenant, :allocation, 'h100', 1,"
                    " :gpu_ms, :amount, :count, 0)"
                ),
                values,
            )
            connection.execute(
                text(
                    "INSERT INTO entry_lines (posting_id, account, side, amount_micro) VALUES"
                    " (:id, :receivable, 'debit', :amount),"
                    " (:id, 'revenue:gpu:h100', 'credit', :amount)"
                ),
                values,
            )
            connection.execute(
                text(
                    "INSERT INTO rating_accumulators VALUES ('2024-01', '2024-01', :tenant, :allocation, 'h100', 1,"
                    " :gpu_ms, :amount, :max_start)"
                ),
                values,
            )
    chunk = 500_000 // per_node * per_node or per_node
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"bulk-loading {events:,} samples", total=events)
        for first in range(0, events, chunk):
            count = min(chunk, events - first)
            with database.write() as connection:
                connection.execute(
                    text(f"""
                    WITH RECURSIVE s(i) AS (SELECT {first} UNION ALL SELECT i + 1 FROM s WHERE i < {first + count - 1})
                    INSERT INTO usage_samples (node_id, seq, allocation_id, tenant_id, gpu_type, gpu_count, start_ms,
                        end_ms, gpu_ms, amount_micro, price_version_id, usage_period, billing_period, posting_id,
                        ingested_ms)
                    SELECT printf('node-%06d', i / {per_node}), i % {per_node} + 1,
                        printf('alloc-%05d', i / {per_node} / {nodes_per_allocation}),
                        printf('tenant-%03d', i / {per_node} / {nodes_per_allocation} % {tenants}), 'h100', 8,
                        {start} + (i % {per_node}) * {MINUTE}, {start} + (i % {per_node} + 1) * {MINUTE},
                        {8 * MINUTE}, 332000, 1, '2024-01', '2024-01',
                        i / {per_node} / {nodes_per_allocation} + 1, 0
                    FROM s""")
                )
            progress.advance(task, count)
    database.dispose()
    return {"events": events, "tenants": min(tenants, allocations), "expected_total": events * 332_000}


def measure_close(database_url: str, events: int) -> tuple[int, float]:
    loaded = bulk_load_period(database_url, events)
    database = open_ledger_database(database_url)
    try:
        with console.status(f"closing {PERIOD} ({loaded['events']:,} samples)"):
            started = time.perf_counter()
            result = close_period(database, PERIOD, now_ms=period_bounds(PERIOD)[1])
            elapsed = time.perf_counter() - started
    finally:
        database.dispose()
    total = sum(invoice.total_micro for invoice in result.invoices)
    if len(result.invoices) != loaded["tenants"] or total != loaded["expected_total"]:
        raise RuntimeError(f"close produced {len(result.invoices)} invoices totalling {total}, expected {loaded}")
    assert Rate(PRICE).amount_for(8 * MINUTE) == 332_000
    return loaded["events"], elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run: 10 ingest batches, close of 200k events")
    parser.add_argument("--clients", type=int, default=4, help="concurrent shippers posting batches")
    parser.add_argument("--postgres-url", default=os.environ.get("GPUCLOUD_TEST_POSTGRES_URL", DEFAULT_POSTGRES))
    args = parser.parse_args()
    batches = 10 if args.quick else 40
    close_events = 200_000 if args.quick else 10_000_000
    results: dict[str, object] = {
        "quick": args.quick,
        "batch_size": BATCH,
        "ingest_batches": batches,
        "clients": args.clients,
        "cpus": os.cpu_count(),
        "load_average_before": round(os.getloadavg()[0], 2),
    }
    bodies = batch_bodies(batches)
    with tempfile.TemporaryDirectory(prefix="ledger-bench-") as scratch:
        scratch_dir = Path(scratch)
        rate, cpu = measure_ingest(
            "SQLite", f"sqlite:///{scratch_dir / 'ingest.db'}", bodies, args.clients, scratch_dir / "sqlite.log"
        )
        results["ingest_events_per_s_sqlite"] = round(rate)
        # The wall-clock rate depends on what else the machine runs; CPU per event much less.
        results["ingest_ledger_cpu_us_per_event_sqlite"] = round(cpu, 2)
        results["ingest_events_per_s_postgres"] = None
        if postgres_reachable(args.postgres_url):
            with scratch_postgres(args.postgres_url, "gpucloud_ledger_bench") as url:
                rate, cpu = measure_ingest("Postgres", url, bodies, args.clients, scratch_dir / "postgres.log")
            results["ingest_events_per_s_postgres"] = round(rate)
            # The ledger process only: Postgres's own backends are not counted.
            results["ingest_ledger_cpu_us_per_event_postgres"] = round(cpu, 2)
        else:
            console.print(f"[yellow]no Postgres at {args.postgres_url}: skipping it")
        events, elapsed = measure_close(f"sqlite:///{scratch_dir / 'close.db'}", close_events)
        results["close_events"] = events
        results["close_s"] = round(elapsed, 2)
    results["load_average_after"] = round(os.getloadavg()[0], 2)
    table = Table(title="ledger benchmark")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    targets = {"ingest_events_per_s_sqlite": ">= 50,000", "close_s": "<= 120 (10M events)"}
    for key, value in results.items():
        table.add_row(
            key,
            f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value),
            targets.get(key, ""),
        )
    console.print(table)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
