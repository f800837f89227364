"""Usage ingest: each sample exactly once per (node_id, seq), forever.

For every sample of a batch, in this order:

1. Field checks, no database: ids non-empty and short enough; no negative seq, count or
   timestamp; ``1 <= gpu_count <= 1024``; ``start_ms < end_ms`` at most an hour apart (a
   meter's interval is a minute; the bound keeps lookups around a time window short);
   ``end_ms`` at most 5 minutes past the ledger's clock (retryable: a node whose clock runs
   ahead is right again later).
2. Identity: a (node_id, seq) already recorded with the same content is a duplicate, which is
   acknowledged and counted, not written again. The same (node_id, seq) with different
   content is a conflict: rejected (409), recorded in ``usage_conflicts`` and returned.
3. Allocation: once the control plane has sent allocation events for a tenant, its samples
   must name one of its allocations. An allocation the ledger has not heard of is rejected as
   retryable: the control plane may be down and send the event hours later, and the agent
   keeps the sample in its spool until then. A sample whose tenant or GPU type differs from
   its allocation's events is rejected for good. Tenants without any events are not checked.
   The sample's node must have been in the allocation over the sample's interval, by its
   ``node_added`` / ``node_removed`` events (a minute's tolerance at the edges): a node not
   added yet is retryable, a node the allocation did not hold then is rejected for good.
4. Price: some price book version must price the GPU type at the sample's start
   (retryable: the operator can add it).
5. Overlap: the interval must not overlap any interval already recorded for the node (or,
   within the batch, one that starts earlier); a node is metered for one allocation at a time.

A rejected sample writes nothing of itself. Step 1 is here; 2 to 5 read the database in
bulk (``checks.py``), in the ledger's write transaction; accepted samples are then rated,
posted and written in that same transaction (``booking.py``), so a batch is all or nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter, lt, sub
from typing import Literal

from gpucloud.ledger import problems
from gpucloud.ledger.batch import Candidate, end_field, gpu_count_field, seq_field, start_field
from gpucloud.ledger.booking import book
from gpucloud.ledger.checks import check_allocations, check_nodes_held, drop_known, drop_overlaps, price
from gpucloud.ledger.db import LedgerDatabase
from gpucloud.ledger.pricebook import PriceBookCache
from gpucloud.ledger.schemas import SampleRejection, UsageBatchResult, UsageSampleIn

FUTURE_TOLERANCE_MS = 5 * 60 * 1000
MAX_SAMPLE_MS = 3_600_000
MAX_GPU_COUNT = 1024
_ID_LIMITS: dict[Literal["node_id", "allocation_id", "tenant_id", "gpu_type"], int] = {
    "node_id": 128,
    "allocation_id": 128,
    "tenant_id": 128,
    "gpu_type": 64,
}
_COUNTS: tuple[Literal["seq", "gpu_count", "start_ms", "end_ms"], ...] = ("seq", "gpu_count", "start_ms", "end_ms")


def check_fields(sample: UsageSampleIn, now_ms: int) -> problems.Problem | None:
    """The checks that need no database; None when the sample passes them."""
    start_ms, end_ms = sample["start_ms"], sample["end_ms"]
    # One expression decides the common case; the slow path below only explains a failure.
    if (
        sample["seq"] >= 0
        and 1 <= sample["gpu_count"] <= MAX_GPU_COUNT
        and 0 <= start_ms < end_ms <= start_ms + MAX_SAMPLE_MS
        and end_ms <= now_ms + FUTURE_TOLERANCE_MS
        and all(0 < len(sample[field]) <= limit for field, limit in _ID_LIMITS.items())
    ):
        return None
    return _explain_fields(sample, now_ms)


def _all_fields_valid(
    samples: Sequence[UsageSampleIn], starts: list[int], ends: list[int], counts: list[int], now_ms: int
) -> bool:
    """``check_fields`` for a whole batch at once, in a few C-level passes (the common case)."""
    if not samples:
        return True
    return (
        min(map(seq_field, samples)) >= 0
        and min(counts) >= 1
        and max(counts) <= MAX_GPU_COUNT
        and min(starts) >= 0
        and max(ends) <= now_ms + FUTURE_TOLERANCE_MS
        and all(map(lt, starts, ends))
        and max(map(sub, ends, starts)) <= MAX_SAMPLE_MS
        and all(
            min(lengths) > 0 and max(lengths) <= limit
            for lengths, limit in ((list(map(len, map(itemgetter(f), samples))), n) for f, n in _ID_LIMITS.items())
        )
    )


def _explain_fields(sample: UsageSampleIn, now_ms: int) -> problems.Problem:
    for field, limit in _ID_LIMITS.items():
        if not 0 < len(sample[field]) <= limit:
            return problems.INVALID_FIELD(f"{field} must be 1 to {limit} characters", field=field)
    for count in _COUNTS:
        if sample[count] < 0:
            return problems.NEGATIVE_VALUE(f"{count} is {sample[count]}", field=count)
    if not 1 <= sample["gpu_count"] <= MAX_GPU_COUNT:
        return problems.INVALID_FIELD(f"gpu_count must be within [1, {MAX_GPU_COUNT}]", field="gpu_count")
    start_ms, end_ms = sample["start_ms"], sample["end_ms"]
    if end_ms <= start_ms:
        return problems.INVALID_INTERVAL(f"end_ms {end_ms} is not after start_ms {start_ms}", field="end_ms")
    if end_ms - start_ms > MAX_SAMPLE_MS:
        return problems.INVALID_INTERVAL("a sample covers at most one hour", field="end_ms")
    return problems.TIMESTAMP_IN_FUTURE(
        f"end_ms {end_ms} is {end_ms - now_ms} ms ahead of the ledger's clock", field="end_ms"
    )


class UsageIngest:
    """Ingests batches of usage samples into the ledger database."""

    def __init__(self, database: LedgerDatabase, *, clock_ms: Callable[[], int]) -> None:
        self._database = database
        self._clock_ms = clock_ms
        self._prices = PriceBookCache()

    def ingest(self, samples: Sequence[UsageSampleIn]) -> UsageBatchResult:
        now_ms = self._clock_ms()
        rejections: list[SampleRejection] = []

        def reject(candidate: Candidate, problem: problems.Problem) -> None:
            sample = candidate.sample
            rejections.append(
                SampleRejection(index=candidate.index, node_id=sample["node_id"], seq=sample["seq"], problem=problem)
            )

        starts, ends = list(map(start_field, samples)), list(map(end_field, samples))
        counts = list(map(gpu_count_field, samples))
        everyone = map(Candidate, range(len(samples)), samples, starts, ends, counts)
        if _all_fields_valid(samples, starts, ends, counts, now_ms):
            candidates = list(everyone)
        else:
            candidates = []
            for candidate in everyone:
                problem = check_fields(candidate.sample, now_ms)
                if problem is None:
                    candidates.append(candidate)
                else:
                    reject(candidate, problem)
        duplicates = 0
        if candidates:
            with self._database.write() as connection:
                fresh, duplicates = drop_known(connection, candidates, reject, now_ms)
                fresh = check_allocations(connection, fresh, reject)
                fresh = check_nodes_held(connection, fresh, reject)
                fresh = price(self._prices.get(connection), fresh, reject)
                fresh = drop_overlaps(connection, fresh, reject)
                book(connection, fresh, now_ms)
        rejections.sort(key=attrgetter("index"))
        return UsageBatchResult(
            accepted=len(samples) - duplicates - len(rejections),
            duplicates=duplicates,
            rejected=len(rejections),
            rejections=rejections,
        )
