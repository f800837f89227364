"""Usage metering on the node: a durable local spool and the meter that fills it (the shipper that
drains it is `gpucloud.agent.shipper`).

Usage is written down where it happens before anything else can fail:

- :class:`Spool` is a SQLite file in WAL mode with ``synchronous=FULL``: a sample counts as
  written only once it is fsynced. ``append`` gives every sample the node's next sequence
  number (``AUTOINCREMENT``: never reused, even after acknowledged samples are pruned), so
  (node_id, seq) names a sample forever and the ledger can take it exactly once.
- :class:`Meter` turns the node's current allocation into samples, one per interval
  (default 60 s), cut at multiples of the interval since the epoch. It meters only whole
  intervals, plus the last partial one once the allocation has ended, and it resumes from
  the last durable end of each allocation: across restarts (``kill -9`` included) the
  samples of an allocation cover [started, ended) with no gap and no overlap. A sample and
  the meter's cursor are written in one transaction, so a crash leaves both or neither.
- The shipper sends pending samples to the ledger and settles them from its answer
  (:meth:`Spool.settle`); while the ledger is down the spool grows, and :meth:`Spool.lag`
  reports how far behind it is.

The spool belongs to one node: it records the node id at creation and refuses to open
under another, since two nodes sharing one sequence would make (node_id, seq) ambiguous.

A spool's sequence starts at its epoch: the second it was created, shifted left by
``EPOCH_SHIFT`` bits (``seq = created_s << 31 | n``). A node that is re-imaged starts a new spool
whose every seq lies above any its old spool could have assigned, so its samples never collide
with the ones the ledger already holds for that node (which would reject them for good).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_MS = 60_000
DEFAULT_BATCH_SIZE = 8_000
_SCHEMA_VERSION = 1
# A spool's seqs start at (the second it was created) << EPOCH_SHIFT: see the module doc.
EPOCH_SHIFT = 31
_SCHEMA = """
CREATE TABLE spool_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE samples (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    allocation_id TEXT NOT NULL,
    tenant_id TEXT NOT NULL,
    gpu_type TEXT NOT NULL,
    gpu_count INTEGER NOT NULL,
    start_ms INTEGER NOT NULL,
    end_ms INTEGER NOT NULL,
    appended_ms INTEGER NOT NULL,
    state INTEGER NOT NULL DEFAULT 0,  -- 0 pending, 1 acknowledged by the ledger, 2 rejected for good
    not_before_ms INTEGER NOT NULL DEFAULT 0,
    problem TEXT
);
CREATE INDEX samples_pending ON samples (seq) WHERE state = 0;
CREATE INDEX samples_rejected ON samples (seq) WHERE state = 2;
CREATE TABLE meter_cursors (allocation_id TEXT PRIMARY KEY, end_ms INTEGER NOT NULL);
CREATE TABLE meter_open (slot INTEGER PRIMARY KEY CHECK (slot = 1), allocation TEXT NOT NULL);
"""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class NodeAllocation:
    """What the node is allocated to, as the host agent knows it."""

    allocation_id: str
    tenant_id: str
    gpu_type: str
    gpu_count: int
    started_ms: int
    """When the node was handed to the allocation: metering starts here."""
    ended_ms: int | None = None
    """When the node was released; None while it still runs."""


@dataclass(frozen=True, slots=True)
class Usage:
    """GPU time of one allocation on this node over [start_ms, end_ms), before it has a seq."""

    allocation_id: str
    tenant_id: str
    gpu_type: str
    gpu_count: int
    start_ms: int
    end_ms: int


@dataclass(frozen=True, slots=True)
class UsageSample(Usage):
    """A spooled sample: usage plus the identity the ledger deduplicates on, (node_id, seq)."""

    node_id: str
    seq: int

    def to_wire(self) -> dict:
        """The JSON object ``POST /v1/usage:batch`` takes."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SpoolLag:
    pending: int
    """Samples not acknowledged by the ledger yet (deferred ones included)."""
    oldest_pending_age_ms: int
    """How long the oldest of them has waited since it was appended; 0 when none."""
    deferred: int
    """Pending samples the ledger asked to send again later."""
    rejected: int
    """Samples the ledger refused for good, kept for an operator."""


class _Unchanged:
    pass


_UNCHANGED = _Unchanged()


class Spool:
    """The node's durable usage spool (one SQLite file, one node)."""

    def __init__(self, path: str | Path, node_id: str, *, clock_ms: Callable[[], int] = wall_clock_ms) -> None:
        self.path = Path(path)
        self.node_id = node_id
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: the WAL is fsynced at every commit, so an appended sample survives power loss.
        self._db.execute("PRAGMA synchronous=FULL")
        self._initialise()

    def _initialise(self) -> None:
        with self._transaction() as db:
            if db.execute("PRAGMA user_version").fetchone()[0] == 0:
                # Statement by statement: executescript() would commit our transaction first.
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO spool_meta VALUES ('node_id', ?)", (self.node_id,))
                epoch = self._clock_ms() // 1000
                db.execute("INSERT INTO spool_meta VALUES ('epoch_s', ?)", (str(epoch),))
                # AUTOINCREMENT continues from here: the first sample is epoch_base + 1.
                db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('samples', ?)", (epoch << EPOCH_SHIFT,))
                db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
            owner = db.execute("SELECT value FROM spool_meta WHERE key = 'node_id'").fetchone()[0]
            epoch_row = db.execute("SELECT value FROM spool_meta WHERE key = 'epoch_s'").fetchone()
        self.epoch_base = int(epoch_row[0]) << EPOCH_SHIFT if epoch_row else 0
        if owner != self.node_id:
            self._db.close()
            raise ValueError(f"spool {self.path} belongs to node {owner}, not {self.node_id}")

    def _transaction(self, *, write: bool = True) -> _Transaction:
        return _Transaction(self._db, self._lock, write=write)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def append(self, usage: Usage) -> UsageSample:
        """Write one sample durably and return it with its sequence number."""
        return self.append_many([usage])[0]

    def append_many(
        self, usages: Sequence[Usage], *, open_allocation: NodeAllocation | _Unchanged | None = _UNCHANGED
    ) -> list[UsageSample]:
        """Write samples in one fsynced transaction; each advances its allocation's meter cursor.

        ``open_allocation`` records, in the same transaction, which allocation the meter is
        in the middle of (None: none).
        """
        now_ms = self._clock_ms()
        samples = []
        with self._transaction() as db:
            for usage in usages:
                cursor = db.execute(
                    "INSERT INTO samples (allocation_id, tenant_id, gpu_type, gpu_count, start_ms, end_ms, appended_ms)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        usage.allocation_id,
                        usage.tenant_id,
                        usage.gpu_type,
                        usage.gpu_count,
                        usage.start_ms,
                        usage.end_ms,
                        now_ms,
                    ),
                )
                assert cursor.lastrowid is not None  # an INSERT into a rowid table
                samples.append(UsageSample(node_id=self.node_id, seq=cursor.lastrowid, **asdict(usage)))
            db.executemany(
                "INSERT INTO meter_cursors VALUES (?, ?)"
                " ON CONFLICT (allocation_id) DO UPDATE SET end_ms = max(end_ms, excluded.end_ms)",
                [(usage.allocation_id, usage.end_ms) for usage in usages],
            )
            if open_allocation is None:
                db.execute("DELETE FROM meter_open")
            elif isinstance(open_allocation, NodeAllocation):
                db.execute(
                    "INSERT INTO meter_open VALUES (1, ?)"
                    " ON CONFLICT (slot) DO UPDATE SET allocation = excluded.allocation",
                    (json.dumps(asdict(open_allocation)),),
                )
        return samples

    def last_seq(self) -> int:
        """The highest sequence number this spool assigned (its epoch base before the first sample)."""
        with self._transaction(write=False) as db:
            row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'samples'").fetchone()
        return self.epoch_base if row is None else row[0]

    def appended(self) -> int:
        """How many samples this spool ever assigned a seq to."""
        return self.last_seq() - self.epoch_base

    def meter_cursor(self, allocation_id: str) -> int | None:
        """Where the allocation's last durable sample ends (None: nothing metered yet)."""
        with self._transaction(write=False) as db:
            row = db.execute("SELECT end_ms FROM meter_cursors WHERE allocation_id = ?", (allocation_id,)).fetchone()
        return None if row is None else row[0]

    def open_allocation(self) -> NodeAllocation | None:
        with self._transaction(write=False) as db:
            row = db.execute("SELECT allocation FROM meter_open").fetchone()
        return None if row is None else NodeAllocation(**json.loads(row[0]))

    def pending(self, *, limit: int, now_ms: int | None = None) -> list[UsageSample]:
        """The oldest samples still to ship (not acknowledged, not waiting to be retried)."""
        now_ms = self._clock_ms() if now_ms is None else now_ms
        with self._transaction(write=False) as db:
            rows = db.execute(
                "SELECT seq, allocation_id, tenant_id, gpu_type, gpu_count, start_ms, end_ms FROM samples"
                " WHERE state = 0 AND not_before_ms <= ? ORDER BY seq LIMIT ?",
                (now_ms, limit),
            ).fetchall()
        return [
            UsageSample(allocation_id, tenant_id, gpu_type, gpu_count, start_ms, end_ms, self.node_id, seq)
            for seq, allocation_id, tenant_id, gpu_type, gpu_count, start_ms, end_ms in rows
        ]

    def settle(
        self,
        *,
        acked: Iterable[int] = (),
        rejected: dict[int, dict] | None = None,
        deferred: Iterable[int] = (),
        retry_at_ms: int = 0,
    ) -> None:
        """Record the ledger's answer for a batch, in one transaction."""
        with self._transaction() as db:
            db.executemany("UPDATE samples SET state = 1 WHERE seq = ? AND state = 0", [(seq,) for seq in acked])
            db.executemany(
                "UPDATE samples SET state = 2, problem = ? WHERE seq = ? AND state = 0",
                [(json.dumps(problem), seq) for seq, problem in (rejected or {}).items()],
            )
            db.executemany(
                "UPDATE samples SET not_before_ms = ? WHERE seq = ? AND state = 0",
                [(retry_at_ms, seq) for seq in deferred],
            )

    def lag(self, now_ms: int | None = None) -> SpoolLag:
        now_ms = self._clock_ms() if now_ms is None else now_ms
        with self._transaction(write=False) as db:
            pending, oldest, deferred = db.execute(
                "SELECT count(*), min(appended_ms), coalesce(sum(not_before_ms > ?), 0) FROM samples WHERE state = 0",
                (now_ms,),
            ).fetchone()
            rejected = db.execute("SELECT count(*) FROM samples WHERE state = 2").fetchone()[0]
        return SpoolLag(
            pending=pending,
            oldest_pending_age_ms=0 if oldest is None else max(0, now_ms - oldest),
            deferred=deferred,
            rejected=rejected,
        )

    def rejected(self) -> list[tuple[UsageSample, dict]]:
        """Samples the ledger refused for good, with its problem document."""
        with self._transaction(write=False) as db:
            rows = db.execute(
                "SELECT seq, allocation_id, tenant_id, gpu_type, gpu_count, start_ms, end_ms, problem"
                " FROM samples WHERE state = 2 ORDER BY seq"
            ).fetchall()
        return [
            (UsageSample(a, t, g, c, s, e, self.node_id, seq), json.loads(problem))
            for seq, a, t, g, c, s, e, problem in rows
        ]

    def prune_acked(self, *, older_than_ms: int) -> int:
        """Drop acknowledged samples appended before ``older_than_ms``; seqs are never reused."""
        with self._transaction() as db:
            return db.execute("DELETE FROM samples WHERE state = 1 AND appended_ms < ?", (older_than_ms,)).rowcount


class _Transaction:
    """``BEGIN`` ... ``COMMIT`` under the spool's lock; rolls back on error.

    Writes begin IMMEDIATE (take SQLite's write lock up front, so they never fail half-way on
    a busy database); reads take no write lock, so a process inspecting the spool (an
    operator, a test) does not hold up the meter.
    """

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock, *, write: bool) -> None:
        self._db = db
        self._lock = lock
        self._begin = "BEGIN IMMEDIATE" if write else "BEGIN"

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._db.execute(self._begin)
        except BaseException:
            self._lock.release()
            raise
        return self._db

    def __exit__(self, error_type, _error, _traceback) -> None:
        try:
            self._db.execute("ROLLBACK" if error_type else "COMMIT")
        finally:
            self._lock.release()


class Meter:
    """Turns the node's allocation into contiguous, interval-aligned usage samples."""

    def __init__(
        self,
        spool: Spool,
        current_allocation: Callable[[], NodeAllocation | None],
        *,
        interval_ms: int = DEFAULT_INTERVAL_MS,
        clock_ms: Callable[[], int] = wall_clock_ms,
        lock: threading.Lock | None = None,
    ) -> None:
        if interval_ms <= 0:
            raise ValueError("interval_ms must be positive")
        self._spool = spool
        self._current_allocation = current_allocation
        self.interval_ms = interval_ms
        self._clock_ms = clock_ms
        # Whoever ends the allocation takes its end under this lock, so no tick meters past it.
        self._lock = lock or threading.Lock()

    def tick(self) -> list[UsageSample]:
        """Meter everything that is due now; returns the samples written."""
        with self._lock:
            return self._tick()

    def _tick(self) -> list[UsageSample]:
        now_ms = self._clock_ms()
        current = self._current_allocation()
        opened = self._spool.open_allocation()
        usages: list[Usage] = []
        # The open allocation's end was never seen. If another one started, the previous one
        # ended by then; if the agent lost track of it (no current allocation), bill nothing more.
        if opened is not None and current is not None and current.allocation_id != opened.allocation_id:
            usages += self._cut(opened, until_ms=min(now_ms, current.started_ms), final=True)
        still_open = None
        if current is not None:
            ended = current.ended_ms is not None and current.ended_ms <= now_ms
            until_ms = current.ended_ms if ended and current.ended_ms is not None else now_ms
            usages += self._cut(current, until_ms=until_ms, final=ended)
            still_open = None if ended else current
        if not usages and still_open == opened:
            return []
        return self._spool.append_many(usages, open_allocation=still_open)

    def _cut(self, allocation: NodeAllocation, *, until_ms: int, final: bool) -> list[Usage]:
        """Whole intervals from the allocation's cursor up to ``until_ms`` (and the rest, if final)."""
        cursor = self._spool.meter_cursor(allocation.allocation_id)
        start_ms = allocation.started_ms if cursor is None else max(cursor, allocation.started_ms)
        usages = []
        while start_ms < until_ms:
            boundary = (start_ms // self.interval_ms + 1) * self.interval_ms
            if boundary <= until_ms:
                end_ms = boundary
            elif final:
                end_ms = until_ms
            else:
                break
            usages.append(
                Usage(
                    allocation.allocation_id,
                    allocation.tenant_id,
                    allocation.gpu_type,
                    allocation.gpu_count,
                    start_ms,
                    end_ms,
                )
            )
            start_ms = end_ms
        return usages

    def run(self, stop: threading.Event) -> None:
        """Tick just after every interval boundary until ``stop`` is set."""
        while not stop.is_set():
            try:
                self.tick()
            except sqlite3.Error:
                log.exception("metering failed; retrying at the next interval")
            wait_ms = self.interval_ms - self._clock_ms() % self.interval_ms
            stop.wait(wait_ms / 1000)
