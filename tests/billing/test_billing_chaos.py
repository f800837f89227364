"""Seeded chaos: meter + spool + shipper and the ledger as real processes, SIGKILLed while usage flows.

After everything restarts and drains, the ledger's totals must equal the ground truth (what
the allocations ran for) exactly: no sample lost, none counted twice. Set
``GPUCLOUD_CHAOS_SEED`` to replay a run; the seed is printed on failure.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from gpucloud.agent.spool import Spool, wall_clock_ms
from gpucloud.devstack.stack import free_port
from gpucloud.ledger.periods import period_bounds, period_of
from gpucloud.ledger.pricing import Rate
from support.ledger_auth import auth_for
from support.ledger_harness import REPO_ROOT, LedgerProcess, wait_until_healthy

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("GPUCLOUD_CHAOS_SEED", "20240607"))
INTERVAL_MS = 10
PRICE = 2_490_000
NODES = {"n1": ("a1", "t1"), "n2": ("a1", "t1"), "n3": ("a2", "t1"), "n4": ("a3", "t2")}
AGENT_SCRIPT = Path(__file__).with_name("billing_chaos_agent.py")


@dataclass
class Cluster:
    """The two processes under test and the ground truth of what they metered."""

    tmp_path: Path
    ledger: LedgerProcess
    started_ms: int
    allocations_path: Path
    agent: subprocess.Popen | None = None
    kills: dict[str, int] = field(default_factory=lambda: {"agent": 0, "ledger": 0})

    def start_agent(self) -> None:
        log = (self.tmp_path / "agent.log").open("ab")
        self.agent = subprocess.Popen(
            [
                sys.executable,
                str(AGENT_SCRIPT),
                str(self.tmp_path / "spools"),
                self.ledger.url,
                str(self.allocations_path),
                str(INTERVAL_MS),
                "300",
                str(self.tmp_path),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )

    def kill_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait()
        self.kills["agent"] += 1

    def kill_ledger(self) -> None:
        self.ledger.kill()
        self.kills["ledger"] += 1

    def end_allocations(self) -> int:
        # The end lies a moment ahead: a meter tick between reading the clock and publishing the
        # file could otherwise have metered past it already (a real agent takes its end under
        # the meter's lock; this harness publishes through a file).
        ended_ms = wall_clock_ms() + 1_000
        allocations = json.loads(self.allocations_path.read_text())
        for fields in allocations.values():
            fields["ended_ms"] = ended_ms
        write_atomically(self.allocations_path, allocations)
        return ended_ms

    def spool_lag(self) -> dict[str, tuple[int, int]]:
        lags = {}
        for node_id in NODES:
            spool = Spool(self.tmp_path / "spools" / f"{node_id}.db", node_id)
            try:
                lag = spool.lag()
                lags[node_id] = (lag.pending, lag.oldest_pending_age_ms)
            finally:
                spool.close()
        return lags

    def wait_drained(self, ended_ms: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.metered_until(node_id) == ended_ms for node_id in NODES) and not any(
                pending for pending, _ in self.spool_lag().values()
            ):
                return
            time.sleep(0.1)
        raise AssertionError(f"spools did not drain: {self.spool_lag()} (seed {SEED})")

    def metered_until(self, node_id: str) -> int | None:
        spool = Spool(self.tmp_path / "spools" / f"{node_id}.db", node_id)
        try:
            return spool.meter_cursor(NODES[node_id][0])
        finally:
            spool.close()

    def samples(self, node_id: str) -> int:
        spool = Spool(self.tmp_path / "spools" / f"{node_id}.db", node_id)
        try:
            assert spool.rejected() == [], f"ledger rejected samples (seed {SEED})"
            return spool.appended()
        finally:
            spool.close()


def write_atomically(path: Path, value: object) -> None:
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(value))
    scratch.replace(path)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    port = free_port()
    ledger = LedgerProcess(f"sqlite:///{tmp_path / 'ledger.db'}", port, tmp_path / "ledger.log", issuer_dir=tmp_path)
    ledger.start()
    wait_until_healthy(ledger.url)
    started_ms = wall_clock_ms()
    price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "h100", "price_per_hour_micro": PRICE}]}
    assert (
        httpx.post(auth=auth_for(ledger.url), url=f"{ledger.url}/v1/price-book/versions", json=price_book).status_code
        == 201
    )
    allocations = {}
    for _number, (node_id, (allocation_id, tenant_id)) in enumerate(NODES.items()):
        allocations[node_id] = {
            "allocation_id": allocation_id,
            "tenant_id": tenant_id,
            "gpu_type": "h100",
            "gpu_count": 8,
            "started_ms": started_ms,
            "ended_ms": None,
        }
        for kind, node in (("start", None), ("node_added", node_id)):
            event = {
                "event_id": f"{allocation_id}-{kind}-{node}",
                "allocation_id": allocation_id,
                "tenant_id": tenant_id,
                "kind": kind,
                "at_ms": started_ms,
                "node_id": node,
                "gpu_type": "h100",
            }
            assert httpx.post(
                auth=auth_for(ledger.url), url=f"{ledger.url}/v1/allocation-events", json=event
            ).status_code in (200, 201)
    allocations_path = tmp_path / "allocations.json"
    write_atomically(allocations_path, allocations)
    (tmp_path / "spools").mkdir()
    cluster = Cluster(tmp_path, ledger, started_ms, allocations_path)
    cluster.start_agent()
    try:
        yield cluster
    finally:
        if cluster.agent is not None:
            cluster.agent.kill()
            cluster.agent.wait()
        ledger.kill()


def assert_totals_are_exact(cluster: Cluster, ended_ms: int) -> None:
    truth_by_allocation: dict[tuple[str, str], list[str]] = {}
    for node_id, key in NODES.items():
        truth_by_allocation.setdefault(key, []).append(node_id)
    for (allocation_id, tenant_id), node_ids in truth_by_allocation.items():
        params = {"tenant_id": tenant_id, "allocation_id": allocation_id}
        answer = httpx.get(
            auth=auth_for(cluster.ledger.url), url=f"{cluster.ledger.url}/v1/usage", params=params
        ).json()
        per_node_ms = ended_ms - cluster.started_ms
        assert answer["gpu_ms"] == len(node_ids) * 8 * per_node_ms, f"seed {SEED}"
        assert answer["sample_count"] == sum(cluster.samples(node_id) for node_id in node_ids), f"seed {SEED}"
        assert answer["amount_micro"] == expected_amount(cluster.started_ms, ended_ms, len(node_ids)), f"seed {SEED}"
    assert httpx.get(auth=auth_for(cluster.ledger.url), url=f"{cluster.ledger.url}/v1/usage/conflicts").json() == []


def expected_amount(started_ms: int, ended_ms: int, nodes: int) -> int:
    """One invoice line per usage period; each is rated on its own cumulative total."""
    total = 0
    cursor = started_ms
    while cursor < ended_ms:
        period_end = min(period_bounds(period_of(cursor))[1], ended_ms)
        total += Rate(PRICE).amount_for(nodes * 8 * (period_end - cursor))
        cursor = period_end
    return total


def test_sigkill_at_random_points_loses_and_duplicates_nothing(cluster: Cluster) -> None:
    rng = random.Random(SEED)
    chaos_until = time.monotonic() + 9
    while time.monotonic() < chaos_until:
        time.sleep(rng.uniform(0.3, 1.5))
        victims = rng.choice([("agent",), ("ledger",), ("agent", "ledger")])
        if "agent" in victims:
            cluster.kill_agent()
        if "ledger" in victims:
            cluster.kill_ledger()
        time.sleep(rng.uniform(0.0, 0.4))
        if "ledger" in victims:
            cluster.ledger.start()
        if "agent" in victims:
            cluster.start_agent()
    wait_until_healthy(cluster.ledger.url)
    ended_ms = cluster.end_allocations()
    cluster.wait_drained(ended_ms, timeout_s=30)
    assert cluster.kills["agent"] >= 2 and cluster.kills["ledger"] >= 2, cluster.kills
    assert_totals_are_exact(cluster, ended_ms)


def wait_for(condition, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what} (seed {SEED})"
        time.sleep(0.1)


def test_a_ledger_outage_grows_the_spool_which_then_drains(cluster: Cluster) -> None:
    def ledger_has_usage_of_every_allocation() -> bool:
        usage_url = f"{cluster.ledger.url}/v1/usage"
        return all(
            httpx.get(
                usage_url, params={"tenant_id": tenant, "allocation_id": allocation}, auth=auth_for(cluster.ledger.url)
            ).json()["sample_count"]
            for allocation, tenant in set(NODES.values())
        )

    wait_for(ledger_has_usage_of_every_allocation, timeout_s=20, what="usage flows to the ledger")
    cluster.kill_ledger()
    early = cluster.spool_lag()
    # While the ledger is down every node's spool keeps growing, and its oldest sample ages.
    wait_for(
        lambda: all(
            pending >= early[node][0] + 100 and age >= early[node][1] + 1_000
            for node, (pending, age) in cluster.spool_lag().items()
        ),
        timeout_s=15,
        what="every spool grew while the ledger was down",
    )
    cluster.ledger.start()
    wait_until_healthy(cluster.ledger.url)
    wait_for(
        lambda: all(pending < 100 for pending, _ in cluster.spool_lag().values()),
        timeout_s=20,
        what="the backlog drained",
    )
    ended_ms = cluster.end_allocations()
    cluster.wait_drained(ended_ms, timeout_s=20)
    assert_totals_are_exact(cluster, ended_ms)
