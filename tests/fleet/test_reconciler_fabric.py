"""A deadline that takes a node out of its allocation takes the node's fabric membership away
first (`ReconcilerActivities`): a node reserved for an allocation whose workflow is stuck (on the
fabric manager outage itself, say) reaches the pool only once it is off the allocation's pkey and
the tenant's VPC. While a manager is down the node stays where it is and the sweep says why."""

from __future__ import annotations

from datetime import timedelta

import pytest

from gpucloud.activities.fabric import fabric_node
from gpucloud.activities.reconciler import ReconcilerActivities
from gpucloud.config import Settings
from gpucloud.db import Database, session_scope
from gpucloud.fabric.membership import apply_and_verify
from gpucloud.models.messages import SweepInput, SweepResult
from gpucloud.models.tables import Allocation, Node, utcnow
from support.fabric import FabricManagers
from support.nodes import enroll

pytestmark = pytest.mark.integration

TENANT = "ten_overdue"


@pytest.fixture
def managers():
    managers = FabricManagers()
    try:
        yield managers
    finally:
        managers.stop()


def _reserved_past_its_deadline(db_url: str, managers: FabricManagers) -> tuple[str, str]:
    [node_id] = enroll(db_url, ["overdue-0"], ib_port_guids=["0x0000000000a0b001", "0x0000000000a0b002"])
    with session_scope(db_url) as session:
        alloc = Allocation(tenant_id=TENANT, gpu_type="H100", node_count=1, region="r1", node_ids=[node_id])
        session.add(alloc)
        session.flush()
        node = session.get(Node, node_id)
        assert node is not None
        node.state, node.allocation_id, node.deadline_at = "reserved", alloc.id, utcnow() - timedelta(minutes=1)
        session.add(node)
        alloc_id, fabric = alloc.id, fabric_node(node)
    with managers.controller() as controller:  # what the allocation's workflow applied
        apply_and_verify(controller, alloc_id, TENANT, [fabric])
    return node_id, alloc_id


def test_an_overdue_reservation_leaves_the_fabric_before_it_reaches_the_pool(db_url, tmp_path, managers) -> None:
    node_id, alloc_id = _reserved_past_its_deadline(db_url, managers)
    assert managers.full_members(alloc_id) and node_id in managers.vpc_of(TENANT).nodes
    activities = ReconcilerActivities(
        client=None,  # type: ignore[arg-type] - a targeted sweep starts no workflow
        db=Database(db_url),
        settings=Settings(data_dir=tmp_path),
        fabric=managers.controller,
    )

    def sweep() -> SweepResult:
        result = SweepResult()
        activities._plan_and_apply(SweepInput(node_ids=[node_id]), result)
        return result

    def node() -> Node:
        with session_scope(db_url) as session:
            found = session.get(Node, node_id)
            assert found is not None
            session.expunge(found)
            return found

    managers.set_fault("unavailable")
    try:
        held = sweep()
    finally:
        managers.set_fault(None)
    # The manager is down: the node stays reserved, on the fabric, and the sweep says why.
    assert (node().state, node().allocation_id) == ("reserved", alloc_id)
    assert held.deadlines_applied == 0 and any(f"membership of {alloc_id}" in e for e in held.errors), held.errors
    assert managers.full_members(alloc_id)

    done = sweep()
    assert done.deadlines_applied == 1 and done.errors == []
    assert (node().state, node().allocation_id) == ("available", None)
    assert managers.full_members(alloc_id) == set() and node_id not in managers.vpc_of(TENANT).nodes
