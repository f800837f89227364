"""Pure API helpers: cursor tokens, idempotency body hashing, gang placement, admission lanes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpucloud.api import pagination
from gpucloud.api.admission import CREDENTIAL_LOOKUPS, THREADS, Admission
from gpucloud.api.idempotency import body_hash
from gpucloud.config import ApiSettings
from gpucloud.services.allocations import pick_gang
from gpucloud.web.problems import Problem

pytestmark = pytest.mark.unit


def test_admission_lanes_come_from_the_api_settings_and_stay_below_the_worker_threads():
    admission = Admission(None, settings=ApiSettings(tenant_slots=5, agent_slots=3))  # type: ignore[arg-type]
    assert {name: lane.slots for name, lane in admission.lanes.items()} == {"tenants": 5, "operator": 8, "agents": 3}
    with pytest.raises(ValueError, match="worker threads"):
        Admission(None, settings=ApiSettings(tenant_slots=THREADS - 8 - 12 - CREDENTIAL_LOOKUPS))  # type: ignore[arg-type]


def test_cursor_round_trip_and_filter_binding():
    token = pagination.encode(42, {"state": "available"})
    assert pagination.decode(token, {"state": "available"}).after == 42
    assert pagination.decode("", {}).after is None
    with pytest.raises(Problem) as err:
        pagination.decode(token, {"state": "active"})
    assert err.value.status == 400 and "different query" in err.value.detail
    for garbage in ("x", "!!!", pagination.encode(1, {})[:-3] + "zzz", "eyJhIjp0cnVlLCJmIjoiMCJ9"):
        with pytest.raises(Problem):
            pagination.decode(garbage, {})


def test_a_string_key_column_pages_with_str_tokens():
    """`Node.id` is a string column whose SQLAlchemy type names no Python type (`object`): its
    tokens carry str keys and are read back, so `GET /v1/nodes` pages past the first."""
    from gpucloud.models.tables import Allocation, Node

    assert pagination.key_type(Node.id) is str and pagination.key_type(Allocation.seq) is int
    filters = {"state": None, "gpu_type": None, "region": None}
    token = pagination.encode("n00999", filters)
    assert pagination.decode(token, filters, pagination.key_type(Node.id)).after == "n00999"


@given(
    st.lists(st.integers(min_value=1, max_value=10_000), unique=True, max_size=200),
    st.integers(min_value=1, max_value=50),
)
def test_keyset_pages_cover_every_key_once(keys, page_size):
    keys = sorted(keys)
    seen, after = [], None
    while True:
        rows = [k for k in keys if after is None or k > after][: page_size + 1]
        page, token = pagination.page_of(rows, page_size, lambda k: k, {})
        seen += page
        if not token:
            break
        after = pagination.decode(token, {}).after
    assert seen == keys


def test_body_hash_ignores_key_order_and_whitespace():
    assert body_hash(b'{"a": 1, "b": [1,2]}') == body_hash(b'{"b":[1, 2],"a":1}')
    assert body_hash(b'{"a": 1}') != body_hash(b'{"a": 2}')
    assert body_hash(b"not json") == body_hash(b"not json") != body_hash(b"not json!")


def _node(i: int, pod: str, rack: str):
    return SimpleNamespace(id=f"n{i:03d}", pod=pod, rack=rack)


def test_pick_gang_tightest_pod_one_domain():
    nodes = [_node(i, "big", f"r{i // 4}") for i in range(16)] + [_node(100 + i, "small", "s0") for i in range(5)]
    gang = pick_gang(nodes, 4)
    assert {n.pod for n in gang} == {"small"}  # the tightest fit keeps the big pod whole
    gang = pick_gang(nodes, 8)
    assert {n.pod for n in gang} == {"big"} and [n.rack for n in gang] == ["r0"] * 4 + ["r1"] * 4
    assert pick_gang(nodes, 17) is None  # 21 nodes in total, but no one domain has 17
