"""The ledger's log of rejected samples (`ledger/rejections.py`): the first of each reason in a
minute is a line, the rest are counted into the next line of that reason; every rejection is
counted under a reason from a fixed set, never the problem's text. Through the ledger's HTTP API
and `/metrics`: `tests/billing/test_ledger_service.py`."""

from __future__ import annotations

import logging

import pytest

from gpucloud.ledger import problems
from gpucloud.ledger.rejections import OTHER, REASONS, RejectionLog, reason_of
from gpucloud.ledger.schemas import SampleRejection
from gpucloud.web.metrics import LEDGER_REJECTED

pytestmark = pytest.mark.unit


def _batch(problem: problems.Problem, count: int) -> tuple[list[dict], list[SampleRejection]]:
    samples = [{"node_id": f"n{i}", "allocation_id": f"a{i}", "seq": i} for i in range(count)]
    return samples, [SampleRejection(index=i, node_id=f"n{i}", seq=i, problem=problem) for i in range(count)]


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpucloud.ledger.rejections"]


def test_one_line_per_reason_a_minute_says_how_many_it_left_unsaid(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="gpucloud.ledger")
    now = [1000.0]
    rejections = RejectionLog(clock=lambda: now[0])
    unpriced = problems.UNPRICED_USAGE("no price for mi300x at 0", field="gpu_type")
    overlap = problems.USAGE_OVERLAP("overlaps seq 1")
    counted = LEDGER_REJECTED.labels("no_price")._value.get()

    rejections.record(*_batch(unpriced, 1))
    rejections.record(*_batch(overlap, 1))  # another reason has a minute of its own
    now[0] += 30
    rejections.record(*_batch(unpriced, 500))
    assert _lines(caplog) == [
        "usage sample rejected (no_price): node n0, allocation a0, seq 0: no price for mi300x at 0",
        "usage sample rejected (overlap): node n0, allocation a0, seq 0: overlaps seq 1",
    ]
    now[0] += 31
    rejections.record(*_batch(unpriced, 2))
    assert _lines(caplog)[-1] == (
        "usage sample rejected (no_price): node n0, allocation a0, seq 0: no price for mi300x at 0 "
        "(1 more in this batch; 500 more since the last line of this reason)"
    )
    assert LEDGER_REJECTED.labels("no_price")._value.get() == counted + 503


def test_every_rejection_has_a_label_from_a_fixed_set() -> None:
    kinds = [value for value in vars(problems).values() if isinstance(value, problems.ProblemType)]
    per_sample = [kind for kind in kinds if kind.slug in REASONS]
    assert len(set(REASONS.values())) == len(REASONS) and all(label.isidentifier() for label in REASONS.values())
    assert {reason_of(kind("anything at all")) for kind in per_sample} == set(REASONS.values())
    assert reason_of(problems.STATE_CONFLICT("a text that must never become a label")) == OTHER
