"""Issue 37, item 10: the strings of a usage sample are bounded in its schema. A node's agent
(a tenant has root on the node) sent megabytes in a sample's ids, which ingest held and echoed
back in its rejection; now the batch is refused (422, naming the field) before ingest sees it."""

from __future__ import annotations

import json

import pytest

from gpucloud.ledger.api.usage import _validate_and_ingest
from gpucloud.ledger.problems import LedgerProblem

pytestmark = pytest.mark.unit


def _sample(**overrides) -> dict:
    sample = {
        "node_id": "n1",
        "seq": 1,
        "tenant_id": "t1",
        "allocation_id": "a1",
        "gpu_type": "H100",
        "gpu_count": 8,
        "start_ms": 0,
        "end_ms": 1000,
    }
    return sample | overrides


@pytest.mark.parametrize("field", ["node_id", "tenant_id", "allocation_id", "gpu_type"])
def test_an_oversize_string_in_a_usage_sample_is_refused_before_ingest(field: str) -> None:
    body = json.dumps({"samples": [_sample(), _sample(**{field: "x" * (7 << 20)})]}).encode()
    with pytest.raises(LedgerProblem) as refused:
        _validate_and_ingest(None, body, "n1")  # type: ignore[arg-type]  # refused before the ledger is used
    assert refused.value.problem.status == 422
    assert refused.value.problem.field == f"samples.1.{field}"
    assert len(refused.value.problem.detail or "") < 200  # the value is not echoed
