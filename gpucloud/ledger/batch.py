"""A batch of usage samples as ingest's stages see it.

Each sample travels as a :class:`Candidate` (its index in the batch, the sample, and what the
stages learn about it) until it is rejected or booked. The accessors are C-level callables
(``attrgetter``/``itemgetter``) for ``map``, ``min``, ``max`` and ``set``: the stages run over
8,000 samples per batch, and a Python function call per sample and stage adds up to a good
part of SQLite's own insert time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter, itemgetter

from gpucloud.ledger import problems
from gpucloud.ledger.pricing import Rate
from gpucloud.ledger.schemas import UsageSampleIn

CONTENT_FIELDS = ("allocation_id", "tenant_id", "gpu_type", "gpu_count", "start_ms", "end_ms")
"""What must match for a resent (node_id, seq) to be the same sample."""
SAMPLE_FIELDS = ("node_id", "seq", *CONTENT_FIELDS)

LineKey = tuple[str, str, str, str, str, int]
"""One invoice line: (billing_period, usage_period, tenant_id, allocation_id, gpu_type, price_version_id)."""


@dataclass(slots=True)
class Candidate:
    index: int
    sample: UsageSampleIn
    start_ms: int
    end_ms: int
    gpu_count: int
    rate: Rate | None = None
    price_version_id: int = 0


Reject = Callable[[Candidate, problems.Problem], None]

# Getters bound once: the batch path calls them for every sample.
index_of, sample_of, start_of, end_of, gpu_count_of, version_of = map(
    attrgetter, ("index", "sample", "start_ms", "end_ms", "gpu_count", "price_version_id")
)
content_field = itemgetter(*CONTENT_FIELDS)
sample_fields = itemgetter(*SAMPLE_FIELDS)
line_fields = itemgetter("tenant_id", "allocation_id", "gpu_type")
rate_key_field = itemgetter("tenant_id", "gpu_type")
start_field, end_field, node_field, seq_field, gpu_count_field, tenant_field, allocation_field = map(
    itemgetter, ("start_ms", "end_ms", "node_id", "seq", "gpu_count", "tenant_id", "allocation_id")
)
