"""Gang reservation under concurrent requests: no node is ever in two allocations, and no
allocation is ever partial (SQLite, and Postgres when reachable)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from sqlmodel import select

from gpucloud.config import Settings
from gpucloud.db import Database, session_scope
from gpucloud.models.api_schemas import AllocationRequest
from gpucloud.models.tables import Allocation, Node
from gpucloud.services.allocation_requests import reserve_and_record
from gpucloud.services.errors import DomainError
from support.pools import seed_pool

pytestmark = pytest.mark.integration


def _fleet(db_url: str, *, pods: int, per_pod: int) -> None:
    seed_pool(db_url, pods=pods, per_pod=per_pod, tenants=3, max_gpus=8192, rack_size=4)


def _race(db_url: str, tmp_path, *, requests: int, node_count: int) -> Counter:
    """`requests` creates released at once, from three tenants in turn: their outcomes."""
    settings = Settings(data_dir=tmp_path, database={"url": db_url})
    db, scale = Database(db_url), settings.reconciler.deadline_scale
    outcomes: list[str] = []
    barrier = threading.Barrier(requests)

    def request(i: int) -> None:
        barrier.wait()
        try:
            req = AllocationRequest(gpu_type="H100", node_count=node_count, region="r1")
            reserve_and_record(db, f"ten_{i % 3}", req, actor="tenant:t", deadline_scale=scale)
            outcomes.append("ok")
        except DomainError as refused:
            outcomes.append(refused.type_)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return Counter(outcomes)


def test_concurrent_gang_reservations_never_share_a_node(db_url, tmp_path):
    _fleet(db_url, pods=3, per_pod=16)  # 48 nodes; gangs of 6 -> at most 2 per pod
    outcomes = _race(db_url, tmp_path, requests=12, node_count=6)

    with session_scope(db_url) as session:
        allocations = session.exec(select(Allocation)).all()
        nodes = session.exec(select(Node)).all()
    assert outcomes == {"ok": 6, "insufficient-capacity": 6}
    members = [n for a in allocations for n in a.node_ids]
    assert len(members) == len(set(members)) == 36  # nobody shares, nobody is partial
    by_node = {n.id: n for n in nodes}
    for alloc in allocations:
        assert len(alloc.node_ids) == 6
        assert {by_node[n].pod for n in alloc.node_ids} == {alloc.fabric_domain}
        assert all(by_node[n].allocation_id == alloc.id and by_node[n].state == "reserved" for n in alloc.node_ids)
    assert sum(1 for n in nodes if n.state == "available") == 12


def test_many_concurrent_creates_all_reserve_disjoint_nodes_and_none_gives_up(db_url, tmp_path):
    """Creates from one pool take turns instead of racing for the same free nodes: none is refused
    as `busy` while nodes are free."""
    _fleet(db_url, pods=4, per_pod=16)
    outcomes = _race(db_url, tmp_path, requests=32, node_count=1)

    assert outcomes == {"ok": 32}
    with session_scope(db_url) as session:
        members = [n for a in session.exec(select(Allocation)).all() for n in a.node_ids]
    assert len(members) == len(set(members)) == 32
