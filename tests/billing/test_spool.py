"""The node's usage spool, meter and shipper: durability, contiguity across restarts, lag, shipping."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from gpucloud.agent.shipper import Shipper
from gpucloud.agent.spool import EPOCH_SHIFT, Meter, NodeAllocation, Spool, Usage, UsageSample
from gpucloud.ledger.client import LedgerUnavailable, UsageLedger

pytestmark = pytest.mark.unit

INTERVAL = 60_000
T0 = 1_704_067_200_000  # 2024-01-01T00:00Z, a multiple of the interval


class FakeClock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def allocation(allocation_id: str = "a1", *, started_ms: int, ended_ms: int | None = None) -> NodeAllocation:
    return NodeAllocation(allocation_id, "t1", "h100", 8, started_ms=started_ms, ended_ms=ended_ms)


def usage(start_ms: int, end_ms: int) -> Usage:
    return Usage("a1", "t1", "h100", 8, start_ms, end_ms)


def all_samples(path: Path, node_id: str = "n1") -> list[UsageSample]:
    spool = Spool(path, node_id)
    try:
        return spool.pending(limit=1_000_000, now_ms=2**62)
    finally:
        spool.close()


def assert_contiguous(samples: list[UsageSample], start_ms: int, end_ms: int) -> None:
    spans = sorted((s.start_ms, s.end_ms) for s in samples)
    assert spans[0][0] == start_ms
    assert spans[-1][1] == end_ms
    for (_, previous_end), (start, _) in itertools.pairwise(spans):
        assert start == previous_end


def epoch_base_of(path: Path) -> int:
    """Where the spool at `path` started its sequence (see `spool.EPOCH_SHIFT`)."""
    with sqlite3.connect(path) as db:
        (epoch_s,) = db.execute("SELECT value FROM spool_meta WHERE key = 'epoch_s'").fetchone()
    return int(epoch_s) << EPOCH_SHIFT


def test_sequence_numbers_are_monotonic_and_never_reused(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    first = [spool.append(usage(T0 + i, T0 + i + 1)).seq for i in range(3)]
    base = spool.epoch_base
    assert base == (T0 // 1000) << EPOCH_SHIFT and first == [base + 1, base + 2, base + 3]
    spool.settle(acked=first)
    clock.now_ms += 10
    assert spool.prune_acked(older_than_ms=clock.now_ms) == 3
    spool.close()
    reopened = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    assert reopened.last_seq() == base + 3 and reopened.appended() == 3
    assert reopened.append(usage(T0 + 5, T0 + 6)).seq == base + 4


def test_a_spool_belongs_to_one_node(tmp_path: Path) -> None:
    Spool(tmp_path / "spool.db", "n1").close()
    with pytest.raises(ValueError, match="belongs to node n1"):
        Spool(tmp_path / "spool.db", "n2")


def test_the_spool_is_fsynced_wal(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", "n1")
    assert spool._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert spool._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_an_acknowledged_append_survives_kill_9(tmp_path: Path) -> None:
    """A child appends and reports each seq once append() returned; SIGKILL lands mid-stream."""
    script = textwrap.dedent(
        f"""
        import sys
        from gpucloud.agent.spool import Spool, Usage
        spool = Spool({str(tmp_path / "spool.db")!r}, "n1")
        i = 0
        while True:
            sample = spool.append(Usage("a1", "t1", "h100", 8, i, i + 1))
            print(sample.seq, flush=True)
            i += 1
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    reported = []
    deadline = time.monotonic() + 20
    while len(reported) < 200 and time.monotonic() < deadline:
        reported.append(int(child.stdout.readline()))
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    stored = {sample.seq for sample in all_samples(tmp_path / "spool.db")}
    assert len(reported) == 200
    assert set(reported) <= stored
    base = epoch_base_of(tmp_path / "spool.db")
    assert sorted(stored) == list(range(base + 1, max(stored) + 1))


def test_meter_cuts_whole_intervals_aligned_to_the_epoch(tmp_path: Path) -> None:
    clock = FakeClock(T0 + 3 * INTERVAL + 5_000)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    meter = Meter(spool, lambda: allocation(started_ms=T0 + 20_000), interval_ms=INTERVAL, clock_ms=clock)
    samples = meter.tick()
    assert [(s.start_ms - T0, s.end_ms - T0) for s in samples] == [
        (20_000, 60_000),
        (60_000, 120_000),
        (120_000, 180_000),
    ]
    assert meter.tick() == []  # nothing new is due before the next boundary
    assert samples[0].gpu_count == 8 and samples[0].node_id == "n1"


def test_meter_is_contiguous_across_restarts_and_ends_exactly(tmp_path: Path) -> None:
    started, ended = T0 + 7_000, T0 + 10 * INTERVAL + 1_234
    clock = FakeClock(started)
    current = {"allocation": allocation(started_ms=started)}
    for step in range(1, 14):
        # A fresh Spool and Meter each time: the process restarted between ticks.
        clock.now_ms = started + step * 47_000
        if clock.now_ms >= ended:
            current["allocation"] = allocation(started_ms=started, ended_ms=ended)
        spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
        Meter(spool, lambda: current["allocation"], interval_ms=INTERVAL, clock_ms=clock).tick()
        spool.close()
    samples = all_samples(tmp_path / "spool.db")
    assert_contiguous(samples, started, ended)
    base = epoch_base_of(tmp_path / "spool.db")
    assert [s.seq - base for s in samples] == list(range(1, len(samples) + 1))
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    assert spool.open_allocation() is None


def test_meter_catches_up_after_downtime(tmp_path: Path) -> None:
    clock = FakeClock(T0 + INTERVAL)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    meter = Meter(spool, lambda: allocation(started_ms=T0), interval_ms=INTERVAL, clock_ms=clock)
    meter.tick()
    clock.now_ms = T0 + 240 * INTERVAL + 59_999  # down for four hours
    caught_up = meter.tick()
    assert len(caught_up) == 239
    assert_contiguous(spool.pending(limit=10_000), T0, T0 + 240 * INTERVAL)


def test_an_unseen_end_is_closed_at_the_next_allocation_start(tmp_path: Path) -> None:
    clock = FakeClock(T0 + 2 * INTERVAL + 10)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    current = {"allocation": allocation("a1", started_ms=T0)}
    meter = Meter(spool, lambda: current["allocation"], interval_ms=INTERVAL, clock_ms=clock)
    meter.tick()
    current["allocation"] = allocation("a2", started_ms=T0 + 3 * INTERVAL + 30_000)
    clock.now_ms = T0 + 5 * INTERVAL
    samples = spool.pending(limit=100) + meter.tick()
    a1 = [s for s in samples if s.allocation_id == "a1"]
    a2 = [s for s in samples if s.allocation_id == "a2"]
    assert_contiguous(a1, T0, T0 + 3 * INTERVAL + 30_000)
    assert_contiguous(a2, T0 + 3 * INTERVAL + 30_000, T0 + 5 * INTERVAL)


def test_a_lost_allocation_stops_metering_without_guessing(tmp_path: Path) -> None:
    clock = FakeClock(T0 + INTERVAL)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    current: dict[str, NodeAllocation | None] = {"allocation": allocation(started_ms=T0)}
    meter = Meter(spool, lambda: current["allocation"], interval_ms=INTERVAL, clock_ms=clock)
    meter.tick()
    current["allocation"] = None
    clock.now_ms += 10 * INTERVAL
    assert meter.tick() == []
    assert spool.open_allocation() is None
    assert len(spool.pending(limit=100)) == 1


def test_lag_reports_count_and_age_of_unacknowledged_samples(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    assert spool.lag().pending == 0 and spool.lag().oldest_pending_age_ms == 0
    seqs = [spool.append(usage(T0 + i, T0 + i + 1)).seq for i in range(5)]
    clock.now_ms += 90_000
    spool.append(usage(T0 + 10, T0 + 11))
    lag = spool.lag()
    assert (lag.pending, lag.oldest_pending_age_ms) == (6, 90_000)
    spool.settle(acked=seqs[:3], rejected={seqs[3]: {"detail": "no"}}, deferred=[seqs[4]], retry_at_ms=clock.now_ms + 1)
    lag = spool.lag()
    assert (lag.pending, lag.deferred, lag.rejected) == (2, 1, 1)
    assert [s.seq - spool.epoch_base for s in spool.pending(limit=10)] == [6]
    clock.now_ms += 1
    assert [s.seq - spool.epoch_base for s in spool.pending(limit=10)] == [5, 6]
    assert spool.rejected()[0][1] == {"detail": "no"}


class FakeLedger:
    """An httpx transport answering like the ledger; can be down, and rejects what it is told to."""

    def __init__(self) -> None:
        self.down = False
        self.received: list[dict] = []
        self.problems: dict[int, dict] = {}
        self.requests = 0
        self.lose_next_answer = False

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.down:
            return httpx.Response(503, json={"title": "down"})
        samples = json.loads(request.content)["samples"]
        seen = {(s["node_id"], s["seq"]) for s in self.received}
        rejections = [
            {"index": i, "node_id": s["node_id"], "seq": s["seq"], "problem": self.problems[s["seq"]]}
            for i, s in enumerate(samples)
            if s["seq"] in self.problems
        ]
        fresh = [s for s in samples if (s["node_id"], s["seq"]) not in seen and s["seq"] not in self.problems]
        self.received += fresh
        duplicates = len(samples) - len(fresh) - len(rejections)
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise httpx.ReadError("connection reset after the ledger committed", request=request)
        return httpx.Response(
            200,
            json={
                "accepted": len(fresh),
                "duplicates": duplicates,
                "rejected": len(rejections),
                "rejections": rejections,
            },
        )


def shipper_for(spool: Spool, ledger: FakeLedger, clock: FakeClock, **options) -> Shipper:
    client = httpx.Client(transport=httpx.MockTransport(ledger.handle))
    return Shipper(spool, UsageLedger("http://ledger", http=client), clock_ms=clock, **options)


def test_shipper_acks_only_after_a_2xx(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    for i in range(25):
        spool.append(usage(T0 + i, T0 + i + 1))
    ledger = FakeLedger()
    shipper = shipper_for(spool, ledger, clock, batch_size=10)
    ledger.down = True
    with pytest.raises(LedgerUnavailable):
        shipper.ship_once()
    assert spool.lag().pending == 25
    ledger.down = False
    results = [shipper.ship_once() for _ in range(4)]
    assert [r.sent for r in results] == [10, 10, 5, 0]
    assert spool.lag().pending == 0
    # The agent's /metrics shows the spool after each batch: the last one left nothing pending.
    assert REGISTRY.get_sample_value("gpucloud_agent_spool_pending_samples") == 0
    assert REGISTRY.get_sample_value("gpucloud_agent_spool_lag_seconds") == 0
    assert sorted(s["seq"] - spool.epoch_base for s in ledger.received) == list(range(1, 26))


def test_a_lost_acknowledgement_is_resent_and_counted_once(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    for i in range(5):
        spool.append(usage(T0 + i, T0 + i + 1))
    ledger = FakeLedger()
    ledger.lose_next_answer = True
    shipper = shipper_for(spool, ledger, clock)
    with pytest.raises(LedgerUnavailable):
        shipper.ship_once()
    assert spool.lag().pending == 5
    result = shipper.ship_once()
    assert (result.acked, result.duplicates) == (5, 5)
    assert len(ledger.received) == 5 and spool.lag().pending == 0


def test_shipper_keeps_samples_when_the_answer_is_unreadable(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    spool.append(usage(T0, T0 + 1))
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, text="<html>")))
    with pytest.raises(LedgerUnavailable):
        Shipper(spool, UsageLedger("http://ledger", http=client), clock_ms=clock).ship_once()
    assert spool.lag().pending == 1


def test_shipper_dead_letters_final_rejections_and_retries_retryable_ones(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    spool = Spool(tmp_path / "spool.db", "n1", clock_ms=clock)
    for i in range(4):
        spool.append(usage(T0 + i, T0 + i + 1))
    ledger = FakeLedger()
    ledger.problems = {
        spool.epoch_base + 2: {"type": "x/sample-conflict", "retryable": False},
        spool.epoch_base + 3: {"type": "x/unknown-allocation", "retryable": True},
    }
    shipper = shipper_for(spool, ledger, clock, retry_rejected_after_ms=5_000)
    result = shipper.ship_once()
    assert (result.acked, result.rejected, result.deferred) == (2, 1, 1)
    assert shipper.ship_once().sent == 0  # the deferred one waits
    del ledger.problems[spool.epoch_base + 3]
    clock.now_ms += 5_000
    assert shipper.ship_once().acked == 1
    lag = spool.lag()
    assert (lag.pending, lag.rejected) == (0, 1)


def test_shipper_backs_off_while_the_ledger_is_down_then_drains(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", "n1")
    for i in range(30):
        spool.append(usage(T0 + i, T0 + i + 1))
    ledger = FakeLedger()
    ledger.down = True
    client = httpx.Client(transport=httpx.MockTransport(ledger.handle))
    shipper = Shipper(
        spool,
        UsageLedger("http://ledger", http=client),
        batch_size=7,
        backoff_initial_s=0.01,
        backoff_max_s=0.08,
        idle_poll_s=0.01,
    )
    stop = threading.Event()
    runner = threading.Thread(target=shipper.run, args=(stop,))
    runner.start()
    time.sleep(0.5)
    attempts_while_down = ledger.requests
    assert 3 <= attempts_while_down <= 50  # retried, but backing off rather than spinning
    assert spool.lag().pending == 30
    ledger.down = False
    deadline = time.monotonic() + 5
    while spool.lag().pending and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    runner.join(timeout=5)
    assert spool.lag().pending == 0
    assert len(ledger.received) == 30
