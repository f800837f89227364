"""`AllocationWorkflow` with its activities stood in for, its node operations run as the real
child workflows: fabric first, the gang provisioned, `ready`; cancel as intent (a signal, or the
record read at start); a failed provision replaced, or the allocation failed closed."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gpucloud.models.messages import AllocationInput, AllocationResult, CancelRequest
from gpucloud.models.node_states import NodeState
from gpucloud.protocol.actions import Workload
from gpucloud.workflows.allocation import AllocationWorkflow
from support.workflow_mocks import StandIns, until

pytestmark = pytest.mark.workflow

S = NodeState
PROVISIONED = ["get_node", "transition_node:provision", "provision_node", "transition_node:ok"]
RELEASED = ["get_node", "transition_node:release", "release_node", "transition_node:ok"]
RECYCLED = [
    "get_node",
    "release_node",
    "bmc_boot_image:no BMC",
    "wipe_node",
    "transition_node:ok",
    "burn_in_node",
    "transition_node:ok",
]


def _gang(stand_ins: StandIns, uid: str, *names: str, **alloc) -> tuple[str, list[str]]:
    alloc_id, nodes = f"a-{uid}", [f"{name}-{uid}" for name in names]
    for node in nodes:
        stand_ins.add_node(node, S.RESERVED)
    stand_ins.add_allocation(alloc_id, nodes, **alloc)
    return alloc_id, nodes


async def _start(workflows, alloc_id: str, **inp):
    return await workflows.start(
        AllocationWorkflow.run, AllocationInput(allocation_id=alloc_id, **inp), id=f"alloc-{alloc_id}"
    )


async def _progress_once(handle, holds, timeout_s: float = 10.0):
    """The workflow's progress once `holds(progress)` is true (queried again until then, bounded)."""
    async with asyncio.timeout(timeout_s):
        while True:
            progress = await handle.query(AllocationWorkflow.progress)
            if holds(progress):
                return progress
            await asyncio.sleep(0.05)


async def _all_back_in_the_pool(stand_ins: StandIns, nodes: list[str]) -> None:
    """The recycles run on after the allocation ends (abandoned children): wait for them."""
    await until(lambda: all(stand_ins.nodes[n].state == S.AVAILABLE for n in nodes), what=f"{nodes} available")


async def test_ready_then_cancelled_releases_and_recycles_every_node(workflows, stand_ins: StandIns, uid) -> None:
    workload = Workload(command=["sleep", "infinity"])
    alloc_id, (a, b) = _gang(stand_ins, uid, "a", "b", workload=workload)
    handle = await _start(workflows, alloc_id)
    await until(lambda: stand_ins.allocations[alloc_id].status == "ready", what="ready")
    # The status activity has returned; the workflow marks its phase on its next task.
    progress = await _progress_once(handle, lambda p: p.phase == "ready")
    assert (progress.phase, progress.nodes_total, progress.nodes_done) == ("ready", 2, 2)

    await handle.signal(AllocationWorkflow.request_cancel, CancelRequest())
    result: AllocationResult = await handle.result()
    assert (result.status, result.failure_reason) == ("released", None)
    assert stand_ins.steps() == [
        "load_allocation",
        "apply_allocation_fabric",  # the fabric before any node
        "set_allocation_status:ready",
        "release_allocation_fabric",  # off the fabric before the nodes are released
        "set_allocation_status:released",
    ]
    await _all_back_in_the_pool(stand_ins, [a, b])
    for node in (a, b):
        assert stand_ins.steps(node) == [*PROVISIONED, *RELEASED, *RECYCLED]
        assert stand_ins.requests("provision_node", node)[0].workload == workload
    assert Counter(map(tuple, stand_ins.ledger)) == Counter(
        [("start", f"node_added:{a}", f"node_added:{b}"), (f"node_removed:{a}", f"node_removed:{b}", "end")]
    )


async def test_a_cancel_recorded_before_the_run_provisions_nothing(workflows, stand_ins: StandIns, uid) -> None:
    alloc_id, (a, b) = _gang(stand_ins, uid, "a", "b", desired="cancelled")
    result = await (await _start(workflows, alloc_id)).result()
    assert result.status == "released"
    assert stand_ins.steps() == ["load_allocation", "release_allocation_fabric", "set_allocation_status:released"]
    for node in (a, b):  # a reservation never touched the node: straight back to the pool
        assert stand_ins.steps(node) == ["get_node", "transition_node:unreserve"]
        assert stand_ins.nodes[node].state == S.AVAILABLE


async def test_a_cancel_during_provisioning_stops_every_provision(workflows, stand_ins: StandIns, uid) -> None:
    alloc_id, (a, b) = _gang(stand_ins, uid, "a", "b")
    for node in (a, b):
        stand_ins.hold("provision_node", node)
    handle = await _start(workflows, alloc_id)
    await until(lambda: stand_ins.held("provision_node", a) and stand_ins.held("provision_node", b), what="provisions")
    await handle.signal(AllocationWorkflow.request_cancel, CancelRequest())
    result = await handle.result()
    assert result.status == "released"
    # Never ready: the tenant held nothing, so nothing was billed.
    assert "set_allocation_status:ready" not in stand_ins.steps()
    assert ["start"] in stand_ins.ledger
    await _all_back_in_the_pool(stand_ins, [a, b])
    for node in (a, b):
        # Each provision failed to wiping; the release finds it there and recycles it.
        assert stand_ins.steps(node) == [
            "get_node",
            "transition_node:provision",
            "provision_node",
            "get_node",
            "transition_node:fail",
            "get_node",
            *RECYCLED,
        ]


async def test_a_node_still_reserved_at_the_cancel_leaves_the_fabric_before_the_pool(
    workflows, stand_ins: StandIns, uid
) -> None:
    """The allocation's membership is applied before any node provisions: a node whose provision
    had not started when the cancel came stays reserved until the release took the membership
    away, so no other allocation can take it while it is still on this tenant's pkey and VPC."""
    alloc_id, (a, b) = _gang(stand_ins, uid, "a", "b")
    stand_ins.hold("provision_node", a)
    stand_ins.hold("get_node", b)  # b's provision has not moved it out of reserved yet
    handle = await _start(workflows, alloc_id)
    await until(lambda: stand_ins.held("provision_node", a) and stand_ins.held("get_node", b), what="provisions")
    await handle.signal(AllocationWorkflow.request_cancel, CancelRequest())
    await until(lambda: stand_ins.steps(b).count("get_node") == 2, what="b's provision stopped")
    stand_ins.let_go()
    assert (await handle.result()).status == "released"
    await _all_back_in_the_pool(stand_ins, [a, b])
    order = [(c.step, c.node_id) for c in stand_ins.calls]
    unreserved = order.index(("transition_node:unreserve", b))
    assert order.index(("release_allocation_fabric", None)) < unreserved
    assert stand_ins.steps(b) == ["get_node", "get_node", "get_node", "transition_node:unreserve"]


async def test_a_failed_provision_is_replaced_before_ready(workflows, stand_ins: StandIns, uid) -> None:
    alloc_id, (a, b) = _gang(stand_ins, uid, "a", "b")
    c = f"c-{uid}"
    stand_ins.add_node(c, S.AVAILABLE)
    stand_ins.spares.append(c)
    stand_ins.fail("provision_node", b, message="image pull failed", type="AgentActionFailed")
    handle = await _start(workflows, alloc_id)
    await until(lambda: stand_ins.allocations[alloc_id].status == "ready", what="ready")
    assert stand_ins.allocations[alloc_id].node_ids == [a, c]
    await handle.signal(AllocationWorkflow.request_cancel, CancelRequest())
    result = await handle.result()
    assert result.status == "released"
    assert stand_ins.steps() == [
        "load_allocation",
        "apply_allocation_fabric",
        f"detach_nodes:{b}",
        f"remove_allocation_fabric_nodes:{b}",
        f"reserve_replacement:{c}",
        "record_allocation_event:replacement_started",
        f"apply_allocation_fabric:{c}",  # the replacement joins the fabric before it is provisioned
        f"attach_node:{c} for {b}",  # the last attach marks the allocation ready
        "load_allocation",
        "load_allocation",  # the release takes the nodes the allocation has now
        "release_allocation_fabric",
        "set_allocation_status:released",
    ]
    assert stand_ins.requests("reserve_replacement")[0].exclude == [b]
    assert stand_ins.requests("attach_node")[0].ready is True
    await _all_back_in_the_pool(stand_ins, [a, b, c])
    assert stand_ins.steps(c) == [*PROVISIONED, *RELEASED, *RECYCLED]
    # b went back through wipe and burn-in on its own; the allocation never released it.
    assert "transition_node:release" not in stand_ins.steps(b)
    # Billing counts a from ready and c from its attach; b never.
    assert Counter(map(tuple, stand_ins.ledger)) == Counter(
        [
            (f"node_added:{c}",),
            ("start", f"node_added:{a}"),
            (f"node_removed:{a}", f"node_removed:{c}", "end"),
        ]
    )


async def test_more_failed_provisions_than_retries_fail_the_allocation(workflows, stand_ins: StandIns, uid) -> None:
    alloc_id, (a, b) = _gang(stand_ins, uid, "a", "b")
    stand_ins.fail("provision_node", b, message="image pull failed", type="AgentActionFailed")
    result = await (await _start(workflows, alloc_id, provision_retries=0)).result()
    assert result.status == "failed"
    assert result.failure_reason == f"provisioning failed ({b}: provision failed: image pull failed)"
    assert stand_ins.steps() == [
        "load_allocation",
        "apply_allocation_fabric",
        "load_allocation",
        "release_allocation_fabric",
        "set_allocation_status:failed",
    ]
    assert stand_ins.allocations[alloc_id].failure_reason == result.failure_reason
    await _all_back_in_the_pool(stand_ins, [a, b])
    assert stand_ins.steps(a) == [*PROVISIONED, *RELEASED, *RECYCLED]
    assert "reserve_replacement" not in stand_ins.steps()


async def test_no_capacity_for_a_replacement_fails_the_first_provisioning(workflows, stand_ins: StandIns, uid) -> None:
    alloc_id, (a, b) = _gang(stand_ins, uid, "a", "b")
    stand_ins.fail("provision_node", b, message="image pull failed", type="AgentActionFailed")
    result = await (await _start(workflows, alloc_id)).result()
    # The tenant never had it: failed rather than held (and billed) while waiting for capacity.
    assert result.status == "failed"
    assert result.failure_reason == (
        f"provisioning failed ({b}: provision failed: image pull failed; "
        "no replacement: no available node in fabric domain pod-1)"
    )
    assert stand_ins.steps()[-4:] == [
        "reserve_replacement:none",
        "load_allocation",
        "release_allocation_fabric",
        "set_allocation_status:failed",
    ]
    await _all_back_in_the_pool(stand_ins, [a, b])


async def test_a_fabric_that_cannot_be_applied_fails_the_allocation_closed(workflows, stand_ins: StandIns, uid) -> None:
    alloc_id, (a, b) = _gang(stand_ins, uid, "a", "b")
    stand_ins.fail("apply_allocation_fabric", message="pkey 0x12 in use", type="FabricRefused")
    result = await (await _start(workflows, alloc_id)).result()
    assert result.status == "failed"
    # The tenant sees what kind of failure it was, not the manager's words (other tenants' pkeys).
    assert result.failure_reason == (
        "fabric isolation could not be applied and verified (a fabric manager refused); nothing was kept"
    )
    assert stand_ins.steps() == [
        "load_allocation",
        "apply_allocation_fabric",
        "load_allocation",
        "release_allocation_fabric",
        "set_allocation_status:failed",
    ]
    for node in (a, b):  # never provisioned: unreserved, untouched
        assert stand_ins.steps(node) == ["get_node", "transition_node:unreserve"]
    assert stand_ins.ledger.count(["start"]) == 1
