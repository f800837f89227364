"""RFC 9457 problem details for the ledger: one stable ``type`` per kind of bad input.

A rejected usage sample carries one of these in the batch response (the batch itself is
a 2xx: the other samples were processed). Request-level failures are raised as
:class:`LedgerProblem` and answered by the ledger's app through ``gpucloud.web.problems``.
``retryable`` tells the agent's shipper whether sending the same sample later can succeed
(an allocation event or a price not known yet) or never will (a conflict).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucloud.web.problems import TYPE_BASE, ProblemDocument

PROBLEM_BASE = TYPE_BASE + "ledger/"


class Problem(ProblemDocument):
    """The API's problem document with the ledger's members: the bad field, whether sending the
    sample again can succeed, and the sample it conflicts with."""

    field: str | None = None
    retryable: bool = False
    conflict_id: int | None = None


@dataclass(frozen=True)
class ProblemType:
    slug: str
    title: str
    status: int
    retryable: bool = False

    def __call__(self, detail: str, *, field: str | None = None, conflict_id: int | None = None) -> Problem:
        return Problem(
            type=PROBLEM_BASE + self.slug,
            title=self.title,
            status=self.status,
            detail=detail,
            field=field,
            retryable=self.retryable,
            conflict_id=conflict_id,
        )


INVALID_FIELD = ProblemType("invalid-field", "A field has an invalid value", 422)
NEGATIVE_VALUE = ProblemType("negative-value", "A count or timestamp is negative", 422)
INVALID_INTERVAL = ProblemType("invalid-interval", "The usage interval is empty or too long", 422)
TIMESTAMP_IN_FUTURE = ProblemType(
    "timestamp-in-future", "The usage ends more than 5 minutes in the future", 422, retryable=True
)
SAMPLE_CONFLICT = ProblemType(
    "sample-conflict", "A different sample was already recorded under this (node_id, seq)", 409
)
USAGE_OVERLAP = ProblemType("usage-overlap", "The interval overlaps usage already recorded for this node", 422)
UNKNOWN_ALLOCATION = ProblemType(
    "unknown-allocation", "The tenant has allocation events, none for this allocation", 422, retryable=True
)
NODE_NOT_YET_IN_ALLOCATION = ProblemType(
    "node-not-yet-in-allocation", "No allocation event has added this node to the allocation yet", 422, retryable=True
)
NODE_NOT_IN_ALLOCATION = ProblemType(
    "node-not-in-allocation", "The allocation did not hold this node over the sample's interval", 422
)
ALLOCATION_MISMATCH = ProblemType(
    "allocation-mismatch", "The sample's tenant or GPU type differs from the allocation's", 422
)
UNPRICED_USAGE = ProblemType(
    "unpriced-usage", "No price book version prices this GPU type at the sample's start", 422, retryable=True
)
REQUEST_INVALID = ProblemType("request-invalid", "The request body or parameters are invalid", 422)
NOT_FOUND = ProblemType("not-found", "No such resource", 404)
FORBIDDEN = ProblemType("forbidden", "The caller may not do this", 403)
STATE_CONFLICT = ProblemType("state-conflict", "The request conflicts with the ledger's state", 409)
INTERNAL_ERROR = ProblemType(
    "internal-error", "The ledger failed; nothing of the request was recorded", 500, retryable=True
)
INTEGRITY_FAILURE = ProblemType("integrity-failure", "The ledger found an inconsistency in its own data", 500)


class LedgerProblem(Exception):
    """A request the ledger refuses, with the problem document to answer it with."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.detail)
        self.problem = problem
