"""Gang reservation under concurrent requests: no node is ever in two allocations, and no
allocation is ever partial (SQLite, and Postgres when reachable)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from sqlmodel import select

from gpucloud.api.routers.allocations import AllocationRequest, _create_in_db
from gpucloud.config import Settings
from gpucloud.db import session_scope
from gpucloud.models.tables import Allocation, Node, NodeEnroll, Tenant, TenantQuota, TenantStatus
from gpucloud.services import nodes as node_service
from gpucloud.web.problems import Problem

pytestmark = pytest.mark.integration


def _fleet(db_url: str, *, pods: int, per_pod: int) -> None:
    with session_scope(db_url) as session:
        node_service.enroll_nodes(
            session,
            [
                NodeEnroll(
                    id=f"n-{p}-{i:02d}",
                    hostname=f"h{p}{i}",
                    region="r1",
                    pod=f"pod{p}",
                    rack=f"pod{p}-r{i // 4}",
                    gpu_type="H100",
                    gpu_count=8,
                    agent_url="http://unused",
                )
                for p in range(pods)
                for i in range(per_pod)
            ],
        )
        for node in session.exec(select(Node)).all():
            node.state = "available"
            session.add(node)
        # Three active tenants (admission refuses a tenant that is not active), each granted
        # any H100 in the region (a tenant holds only what is granted).
        for t in range(3):
            session.add(Tenant(id=f"ten_{t}", name=f"tenant-{t}", status=TenantStatus.ACTIVE))
            session.add(TenantQuota(tenant_id=f"ten_{t}", gpu_type="H100", region="r1", max_gpus=8192))


def _race(db_url: str, tmp_path, *, requests: int, node_count: int) -> Counter:
    """`requests` creates released at once, from three tenants in turn: their outcomes."""
    settings = Settings(data_dir=tmp_path, database={"url": db_url})
    outcomes: list[str] = []
    barrier = threading.Barrier(requests)

    def request(i: int) -> None:
        barrier.wait()
        try:
            req = AllocationRequest(gpu_type="H100", node_count=node_count, region="r1")
            _create_in_db(settings, f"ten_{i % 3}", req, actor="tenant:t")
            outcomes.append("ok")
        except Problem as problem:
            outcomes.append(problem.type)

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
