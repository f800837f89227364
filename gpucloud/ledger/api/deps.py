"""What every ledger handler gets: the database, the clock, the ingest pipeline."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from gpucloud.ledger.db import LedgerDatabase
from gpucloud.ledger.ingest import UsageIngest
from gpucloud.ledger.pricebook import PriceBookCache
from gpucloud.ledger.rejections import RejectionLog


@dataclass
class LedgerContext:
    database: LedgerDatabase
    clock_ms: Callable[[], int]
    ingest: UsageIngest = field(init=False)
    prices: PriceBookCache = field(default_factory=PriceBookCache)
    rejections: RejectionLog = field(default_factory=RejectionLog)
    ingest_worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-ingest")
    )

    def __post_init__(self) -> None:
        self.ingest = UsageIngest(self.database, clock_ms=self.clock_ms)

    def close(self) -> None:
        self.ingest_worker.shutdown(wait=True)
        self.database.dispose()


async def _context(request: Request) -> LedgerContext:
    return request.app.state.ledger


LedgerDep = Annotated[LedgerContext, Depends(_context)]
