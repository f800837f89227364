"""The shipper: drains a node's usage spool into the ledger, at-least-once.

It sends pending samples in batches (default 8,000); a sample is marked acknowledged only after
the ledger took its batch and did not reject it. Duplicates from a resend are harmless (the
ledger counts them as such). Samples the ledger rejects for good are kept, marked rejected, for
an operator; those it rejects as retryable (allocation or price not known yet) wait and are
sent again. While the ledger is down the shipper backs off exponentially with jitter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

from gpucloud.agent.spool import DEFAULT_BATCH_SIZE, Spool, SpoolLag, wall_clock_ms
from gpucloud.ledger.client import LedgerRefused, LedgerUnavailable, UsageLedger
from gpucloud.retry import Backoff
from gpucloud.web import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShipResult:
    sent: int
    acked: int
    duplicates: int
    rejected: int
    deferred: int


@dataclass
class Shipper:
    """Sends spooled samples to the ledger, at-least-once, and settles them from its answer."""

    spool: Spool
    ledger: UsageLedger
    _: KW_ONLY
    batch_size: int = DEFAULT_BATCH_SIZE
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    idle_poll_s: float = 1.0
    # A rejected sample is offered again after this long (its allocation may reach the ledger late).
    retry_rejected_after_ms: int = 60_000
    acked_retention_ms: int = 86_400_000
    clock_ms: Callable[[], int] = wall_clock_ms

    def lag(self) -> SpoolLag:
        lag = self.spool.lag()
        metrics.SPOOL_PENDING.set(lag.pending)
        metrics.SPOOL_LAG.set(lag.oldest_pending_age_ms / 1000)
        return lag

    def ship_once(self) -> ShipResult:
        """Send one batch of pending samples; raises :class:`LedgerUnavailable` if not taken."""
        now_ms = self.clock_ms()
        batch = self.spool.pending(limit=self.batch_size, now_ms=now_ms)
        if not batch:
            return ShipResult(0, 0, 0, 0, 0)
        try:
            answer = self.ledger.ingest([sample.to_wire() for sample in batch])
        except LedgerRefused as error:
            # A refusal of the whole batch (say, the node's credential) takes nothing: send it all again.
            raise LedgerUnavailable(f"ledger refused the batch ({error.status}): {error}") from error
        try:
            rejections = {r["seq"]: r["problem"] for r in answer["rejections"] if r["node_id"] == self.spool.node_id}
            duplicates = int(answer["duplicates"])
        except (ValueError, KeyError, TypeError) as error:
            # Without a readable answer nothing is known to be taken: send it all again.
            raise LedgerUnavailable(f"unreadable ledger answer: {error!r}") from error
        retryable = [seq for seq, problem in rejections.items() if problem.get("retryable")]
        final = {seq: problem for seq, problem in rejections.items() if not problem.get("retryable")}
        if duplicates:
            log.info(
                "the ledger already had %d of %d samples: a resend after a lost acknowledgement", duplicates, len(batch)
            )
        for seq, problem in final.items():
            log.error("ledger rejected sample %s/%s for good: %s", self.spool.node_id, seq, problem.get("detail"))
        self.spool.settle(
            acked=[sample.seq for sample in batch if sample.seq not in rejections],
            rejected=final,
            deferred=retryable,
            retry_at_ms=now_ms + self.retry_rejected_after_ms,
        )
        self.lag()  # the spool's gauges, after each batch
        return ShipResult(
            sent=len(batch),
            acked=len(batch) - len(rejections),
            duplicates=duplicates,
            rejected=len(final),
            deferred=len(retryable),
        )

    def run(self, stop: threading.Event) -> None:
        """Ship until ``stop`` is set: back to back while there is a backlog, backing off while the ledger is down."""
        backoff = Backoff(first_s=self.backoff_initial_s, cap_s=self.backoff_max_s, jitter=1.0)
        failures = 0
        while not stop.is_set():
            try:
                result = self.ship_once()
            except Exception as error:
                failures += 1
                level = logging.WARNING if isinstance(error, LedgerUnavailable) else logging.ERROR
                log.log(
                    level,
                    "shipping usage failed (%s); retrying in up to %.1f s",
                    error,
                    backoff.ceiling_s(failures),
                    exc_info=not isinstance(error, LedgerUnavailable),
                )
                stop.wait(backoff.delay_s(failures))
                continue
            failures = 0
            if result.sent < self.batch_size:
                self.spool.prune_acked(older_than_ms=self.clock_ms() - self.acked_retention_ms)
                stop.wait(self.idle_poll_s)

    def close(self) -> None:
        self.ledger.close()
