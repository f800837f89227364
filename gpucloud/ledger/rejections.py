"""Usage samples the ledger rejects, made visible to an operator: counted by reason in
`/metrics` (`gpucloud_ledger_usage_rejected_total{reason}`) and logged at WARNING with the node,
the allocation and why.

A reason is one of a fixed set of labels (`REASONS`, one per problem type a sample can be
rejected with), never the problem's text, so the metric's label set stays small. Rejection is
per sample and a fleet ships thousands of samples a minute: a price missing from the price book
rejects every sample of that GPU type. So the log says the first rejection of each reason in a
minute (`LOG_EVERY_S`) and, with the next line of that reason, how many it left unsaid; the
counter counts every one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from gpucloud.ledger import problems
from gpucloud.ledger.schemas import SampleRejection, UsageSampleIn
from gpucloud.web.metrics import LEDGER_REJECTED

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0

REASONS: dict[str, str] = {
    problems.UNPRICED_USAGE.slug: "no_price",
    problems.UNKNOWN_ALLOCATION.slug: "unknown_allocation",
    problems.NODE_NOT_YET_IN_ALLOCATION.slug: "node_not_yet_in_allocation",
    problems.NODE_NOT_IN_ALLOCATION.slug: "node_not_in_allocation",
    problems.ALLOCATION_MISMATCH.slug: "allocation_mismatch",
    problems.SAMPLE_CONFLICT.slug: "conflict",
    problems.USAGE_OVERLAP.slug: "overlap",
    problems.TIMESTAMP_IN_FUTURE.slug: "in_future",
    problems.INVALID_INTERVAL.slug: "invalid_interval",
    problems.NEGATIVE_VALUE.slug: "negative_value",
    problems.INVALID_FIELD.slug: "invalid_field",
}
OTHER = "other"  # a problem type added to ingest without a label here


def reason_of(problem: problems.Problem) -> str:
    return REASONS.get(problem.type.removeprefix(problems.PROBLEM_BASE), OTHER)


class RejectionLog:
    """Counts every rejected sample by reason; logs the first of each reason per `every_s`."""

    def __init__(self, *, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s, self._clock = every_s, clock
        self._logged_at: dict[str, float] = {}
        self._unsaid: Counter[str] = Counter()
        self._lock = threading.Lock()
        for reason in (*REASONS.values(), OTHER):
            LEDGER_REJECTED.labels(reason)  # every reason scraped from the start, at 0

    def record(self, samples: Sequence[UsageSampleIn], rejections: Sequence[SampleRejection]) -> None:
        """The rejections of one batch (`samples`: the batch, for what each rejected one named)."""
        counts: Counter[str] = Counter()
        first: dict[str, SampleRejection] = {}
        for rejection in rejections:
            reason = reason_of(rejection.problem)
            counts[reason] += 1
            first.setdefault(reason, rejection)
        for reason, count in counts.items():
            LEDGER_REJECTED.labels(reason).inc(count)
            self._log(reason, first[reason], samples[first[reason].index], count)

    def _log(self, reason: str, rejection: SampleRejection, sample: UsageSampleIn, count: int) -> None:
        with self._lock:
            now = self._clock()
            logged_at = self._logged_at.get(reason)
            if logged_at is not None and now - logged_at < self._every_s:
                self._unsaid[reason] += count
                return
            self._logged_at[reason] = now
            unsaid = self._unsaid.pop(reason, 0)
        also = [f"{count - 1} more in this batch"] if count > 1 else []
        if unsaid:
            also.append(f"{unsaid} more since the last line of this reason")
        allocation = sample["allocation_id"]
        log.warning(
            "usage sample rejected (%s): node %s, allocation %s, seq %s: %s%s",
            reason,
            rejection.node_id,
            allocation,
            rejection.seq,
            rejection.problem.detail,
            f" ({'; '.join(also)})" if also else "",
            extra={"node_id": rejection.node_id, "allocation_id": allocation, "reason": reason},
        )
