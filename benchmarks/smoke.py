"""Smoke run of every benchmark: each one's `--quick`, one after the other, each bounded by a
timeout, checked only for what keeps a benchmark usable: it exits 0 and the last line of its
stdout is one JSON object of figures. The figures themselves are not judged (on a shared CI
machine they are noise); the point is that a benchmark broken by a change elsewhere (a new
token, a new admission limit, a schema the process no longer migrates itself) is found the
day it breaks, not the day someone wants its figures.

    python benchmarks/smoke.py [--only NAME ...] [--postgres-url URL] [--logs-dir DIR]

Postgres: each benchmark that can run on it gets a scratch database of its own on the server
of `--postgres-url` (default: GPUCLOUD_TEST_POSTGRES_URL), dropped afterwards, so no run
touches the tests' database. Without a reachable server those benchmarks run on SQLite, and
those that need Postgres are skipped (and said to be).

Prints a table (name, seconds, ok) and exits 1 naming the benchmarks that failed, with the end
of each one's stderr; every benchmark's full output is kept under `--logs-dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent


class Postgres(Enum):
    """What a benchmark does with Postgres."""

    NONE = "none"  # never uses it
    OPTIONAL = "optional"  # runs on it too when given `--postgres-url` of a reachable server
    REQUIRED = "required"  # runs only on it


@dataclass(frozen=True)
class Benchmark:
    name: str  # benchmarks/<name>.py
    timeout_s: float  # its `--quick` took a third to a half of this on the 2-core CI machine
    postgres: Postgres = Postgres.NONE
    # Its arguments beside `--postgres-url` when there is a Postgres server to give it, and when
    # there is none (so that it cannot pick one by itself).
    with_postgres: tuple[str, ...] = ()
    without_postgres: tuple[str, ...] = ()
    # After its timeout: how long its SIGINT may take before its process group is killed.
    stop_grace_s: float = 45.0


# Every benchmark, in the order they run (`tests/platform/test_benchmark_smoke.py` checks that each
# benchmarks/*.py is here or in HELPERS). A new benchmark needs a `--quick` of a minute or two.
BENCHMARKS = (
    Benchmark("fanout", 120),
    Benchmark("chunking", 180),
    Benchmark("sanity", 120),
    Benchmark("ledger", 180, Postgres.OPTIONAL),
    Benchmark("bmc_bringup", 180),
    Benchmark("provision", 240),
    Benchmark("onboarding", 240),
    Benchmark("reconcile", 240),
    Benchmark("health", 300),
    # One database, not both: each run of it is 4 to 5 minutes here.
    Benchmark(
        "api_load", 480, Postgres.OPTIONAL, with_postgres=("--db", "postgres"), without_postgres=("--db", "sqlite")
    ),
    Benchmark("scale_out", 360, Postgres.REQUIRED),
    Benchmark("llama3_replay", 300),
    Benchmark("console", 180),
    # The replay in process, then 48 requests through a stack of its own (`--stack`).
    Benchmark("scheduling", 360),
)

# benchmarks/*.py that are no benchmark: shared code, the floor app `api_load` starts, this run.
HELPERS = frozenset({"common", "api_floor", "smoke", "scheduling_stack"})


@dataclass
class Outcome:
    name: str
    seconds: float
    ok: bool
    note: str = ""


def last_json_object(stdout: str) -> dict | None:
    """The benchmark's figures: its last non-empty stdout line, if that is a JSON object."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        figures = json.loads(lines[-1])
    except ValueError:
        return None
    return figures if isinstance(figures, dict) else None


def postgres_reachable(url: str) -> bool:
    from sqlalchemy import create_engine, text

    engine = create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
    finally:
        engine.dispose()


def run_one(bench: Benchmark, args: list[str], logs_dir: Path, *, scripts: Path = HERE) -> Outcome:
    """Run `bench --quick` with `args` from `scripts`; its stdout and stderr go to files under
    `logs_dir`."""
    out_path, err_path = logs_dir / f"{bench.name}.out", logs_dir / f"{bench.name}.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    with out_path.open("wb") as out, err_path.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, str(scripts / f"{bench.name}.py"), "--quick", *args],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=bench.timeout_s)
        except subprocess.TimeoutExpired:
            stop(process, bench.stop_grace_s)
            return Outcome(bench.name, time.monotonic() - started, False, f"timed out after {bench.timeout_s:g} s")
    seconds = time.monotonic() - started
    if code != 0:
        return Outcome(bench.name, seconds, False, f"exit status {code}")
    if last_json_object(out_path.read_text(errors="replace")) is None:
        return Outcome(bench.name, seconds, False, "the last line of stdout is not a JSON object")
    return Outcome(bench.name, seconds, True)


def stop(process: subprocess.Popen, grace_s: float) -> None:
    """SIGINT first, so the benchmark's `finally` stops the stack it started (whose processes run
    in sessions of their own), then SIGKILL to its process group after `grace_s`."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run(bench: Benchmark, postgres_url: str | None, logs_dir: Path, *, scripts: Path = HERE) -> Outcome:
    """One try of `bench`, on Postgres (a scratch database) where it can and there is one."""
    if bench.postgres is Postgres.NONE:
        return run_one(bench, [], logs_dir, scripts=scripts)
    if postgres_url is None and bench.postgres is Postgres.OPTIONAL:
        return run_one(bench, list(bench.without_postgres), logs_dir, scripts=scripts)
    if postgres_url is None:
        return Outcome(bench.name, 0.0, True, "skipped: needs Postgres")
    from gpucloud.db import scratch_postgres  # the run's own imports stay light until a database is needed

    with scratch_postgres(postgres_url, f"gpucloud_smoke_{bench.name}") as url:
        return run_one(bench, ["--postgres-url", url, *bench.with_postgres], logs_dir, scripts=scripts)


def run_twice_if_failed(bench: Benchmark, postgres_url: str | None, logs_dir: Path, *, scripts: Path = HERE) -> Outcome:
    """`bench`, and once more if it fails: a benchmark that rotted fails both times, while a
    machine too busy for one try (a stack whose API takes over its 60 s to start beside other
    work) should not fail CI. A pass on the second try says so; the first try's output is kept
    as <name>.1.out and <name>.1.err."""
    first = run(bench, postgres_url, logs_dir, scripts=scripts)
    if first.ok:
        return first
    for suffix in ("out", "err"):
        (logs_dir / f"{bench.name}.{suffix}").replace(logs_dir / f"{bench.name}.1.{suffix}")
    second = run(bench, postgres_url, logs_dir, scripts=scripts)
    verdict = "passed on the second try" if second.ok else f"again: {second.note}"
    return Outcome(bench.name, first.seconds + second.seconds, second.ok, f"{first.note}; {verdict}")


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [b.name for b in BENCHMARKS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"some of: {', '.join(names)}")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("GPUCLOUD_TEST_POSTGRES_URL"),
        help="a server to make scratch databases on (default: GPUCLOUD_TEST_POSTGRES_URL; none: SQLite only)",
    )
    parser.add_argument("--logs-dir", type=Path, help="where each benchmark's stdout and stderr go (default: temp)")
    options = parser.parse_args()
    console = Console()
    logs_dir = options.logs_dir or Path(tempfile.mkdtemp(prefix="gpucloud-bench-smoke-"))
    logs_dir.mkdir(parents=True, exist_ok=True)
    postgres_url = options.postgres_url
    if postgres_url and not postgres_reachable(postgres_url):
        console.print(f"Postgres does not answer at {postgres_url}: SQLite only")
        postgres_url = None
    chosen = [b for b in BENCHMARKS if not options.only or b.name in options.only]
    outcomes = []
    for bench in chosen:
        console.print(f"{bench.name}: --quick (timeout {bench.timeout_s:g} s)", highlight=False)
        outcome = run_twice_if_failed(bench, postgres_url, logs_dir)
        verdict = "ok" if outcome.ok else "FAILED"
        console.print(f"  {verdict} in {outcome.seconds:.1f} s {outcome.note}", highlight=False)
        outcomes.append(outcome)

    console.print(f"each benchmark's stdout and stderr: {logs_dir}", highlight=False)
    table = Table(title="benchmark smoke run")
    for column in ("name", "seconds", "ok", "note"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    for o in outcomes:
        table.add_row(o.name, f"{o.seconds:.1f}", "ok" if o.ok else "FAILED", o.note)
    table.add_row("total", f"{sum(o.seconds for o in outcomes):.1f}", "", "")
    console.print(table)
    failed = [o for o in outcomes if not o.ok]
    for o in failed:
        console.rule(f"{o.name}: {o.note}; the end of {logs_dir / (o.name + '.err')}")
        console.print(tail(logs_dir / f"{o.name}.err"), markup=False, highlight=False)
    if failed:
        console.print(f"benchmarks failed: {', '.join(o.name for o in failed)}", highlight=False)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
