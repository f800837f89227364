"""Drain-and-replace (`workflows/drain_replace.py`) inside a ready allocation, its activities stood
in for: a pulled node leaves the allocation and its fabric and drains into quarantine while a node
of the same domain is provisioned in its place; no capacity leaves the allocation `degraded`
until a node frees up; a grace period comes first when the job still runs; a burst is pulled at
once, not behind the first replacement."""

from __future__ import annotations

import pytest

from gpucloud.models.messages import AllocationInput, CancelRequest, ReplaceNodeRequest
from gpucloud.models.node_states import NodeState
from gpucloud.workflows.allocation import AllocationWorkflow
from support.workflow_mocks import StandIns, until

pytestmark = pytest.mark.workflow

S = NodeState
PROVISIONED = ["get_node", "transition_node:provision", "provision_node", "transition_node:ok"]
DRAINED = ["get_node", "transition_node:drain", "release_node", "transition_node:ok"]
READY = ["load_allocation", "apply_allocation_fabric", "set_allocation_status:ready"]
RELEASE = ["load_allocation", "release_allocation_fabric", "set_allocation_status:released"]


async def _ready(workflows, stand_ins: StandIns, uid: str, *spares: str):
    """A ready allocation of nodes a and b; `spares` available for replacements."""
    alloc_id, nodes = f"al-{uid}", [f"a-{uid}", f"b-{uid}"]
    for node in nodes:
        stand_ins.add_node(node, S.RESERVED)
    stand_ins.add_allocation(alloc_id, nodes)
    for spare in spares:
        stand_ins.add_node(f"{spare}-{uid}", S.AVAILABLE)
        stand_ins.spares.append(f"{spare}-{uid}")
    handle = await workflows.start(
        AllocationWorkflow.run,
        AllocationInput(allocation_id=alloc_id, replacement_recheck_s=0.2),
        id=f"alloc-{alloc_id}",
    )
    await until(lambda: stand_ins.allocations[alloc_id].status == "ready", what="ready")
    return handle, alloc_id, nodes


def _report(node_id: str, **fields) -> ReplaceNodeRequest:
    return ReplaceNodeRequest(node_id=node_id, reason="XID 79: GPU fell off the bus", **{"immediate": True, **fields})


async def _cancelled(handle, stand_ins: StandIns) -> str:
    await handle.signal(AllocationWorkflow.request_cancel, CancelRequest())
    return (await handle.result()).status


async def test_a_pulled_node_drains_and_a_replacement_takes_its_place(workflows, stand_ins: StandIns, uid) -> None:
    handle, alloc_id, (a, b) = await _ready(workflows, stand_ins, uid, "c")
    c = f"c-{uid}"
    await handle.signal(AllocationWorkflow.replace_node, _report(a))
    await until(lambda: stand_ins.allocations[alloc_id].node_ids == [b, c], what="c attached")
    assert await _cancelled(handle, stand_ins) == "released"

    assert stand_ins.steps() == [
        *READY,
        f"detach_nodes:{a}",
        f"remove_allocation_fabric_nodes:{a}",  # off the tenant's fabric before anything else
        f"reserve_replacement:{c}",
        "record_allocation_event:replacement_started",
        f"apply_allocation_fabric:{c}",
        f"attach_node:{c} for {a}",
        *RELEASE,  # the release reads the nodes the allocation has now: b and c
    ]
    assert stand_ins.steps(a) == [*PROVISIONED, *DRAINED]  # drained, never released by the allocation
    assert stand_ins.nodes[a].state == S.QUARANTINED
    assert stand_ins.steps(c)[:4] == PROVISIONED
    assert stand_ins.requests("attach_node")[0].ready is True
    assert [f"node_removed:{a}"] in stand_ins.ledger and [f"node_added:{c}"] in stand_ins.ledger
    assert [f"node_removed:{b}", f"node_removed:{c}", "end"] in stand_ins.ledger


async def test_without_capacity_the_allocation_is_degraded_until_a_node_frees_up(
    workflows, stand_ins: StandIns, uid
) -> None:
    handle, alloc_id, (a, b) = await _ready(workflows, stand_ins, uid)
    await handle.signal(AllocationWorkflow.replace_node, _report(a, recheck_s=0.1))
    await until(lambda: stand_ins.steps().count("reserve_replacement:none") >= 2, what="rechecks")
    assert stand_ins.allocations[alloc_id].status == "degraded"
    (degraded,) = [r for r in stand_ins.requests("set_allocation_status") if r.status == "degraded"]
    assert degraded.failure_reason == (
        f"node {a} pulled: XID 79: GPU fell off the bus; no available node in fabric domain pod-1; waiting for capacity"
    )

    c = f"c-{uid}"
    stand_ins.add_node(c, S.AVAILABLE)
    stand_ins.spares.append(c)
    await until(lambda: stand_ins.allocations[alloc_id].status == "ready", what="ready again")
    assert stand_ins.allocations[alloc_id].node_ids == [b, c]
    # Noted once however often it looked again.
    assert stand_ins.steps().count("record_allocation_event:waiting_for_capacity") == 1
    assert await _cancelled(handle, stand_ins) == "released"


async def test_a_grace_period_comes_before_the_pull(workflows, stand_ins: StandIns, uid) -> None:
    handle, alloc_id, (a, b) = await _ready(workflows, stand_ins, uid, "c")
    await handle.signal(AllocationWorkflow.replace_node, _report(a, immediate=False, grace_s=0.3))
    await until(lambda: stand_ins.allocations[alloc_id].node_ids == [b, f"c-{uid}"], what="replaced")
    steps = stand_ins.steps()
    assert steps[len(READY) : len(READY) + 2] == ["record_allocation_event:fault_notice", f"detach_nodes:{a}"]
    (notice,) = [r for r in stand_ins.requests("record_allocation_event") if r.kind == "fault_notice"]
    assert notice.reason == f"XID 79: GPU fell off the bus; node {a} will be pulled in 0.3 s: checkpoint now"
    assert await _cancelled(handle, stand_ins) == "released"


async def test_a_cancel_during_the_grace_period_leaves_the_node_to_the_release(
    workflows, stand_ins: StandIns, uid
) -> None:
    handle, _, (a, _) = await _ready(workflows, stand_ins, uid, "c")
    await handle.signal(AllocationWorkflow.replace_node, _report(a, immediate=False, grace_s=60))
    await until(lambda: "record_allocation_event:fault_notice" in stand_ins.steps(), what="the fault notice")
    assert await _cancelled(handle, stand_ins) == "released"
    # Not pulled, not replaced: released with the allocation like its other node.
    assert stand_ins.steps() == [*READY, "record_allocation_event:fault_notice", *RELEASE[1:]]
    assert "transition_node:release" in stand_ins.steps(a)
    assert "transition_node:drain" not in stand_ins.steps(a)


async def test_a_node_reported_while_a_replacement_provisions_is_pulled_at_once(
    workflows, stand_ins: StandIns, uid
) -> None:
    handle, alloc_id, (a, b) = await _ready(workflows, stand_ins, uid, "c", "d")
    c, d = f"c-{uid}", f"d-{uid}"
    stand_ins.hold("provision_node", c)
    await handle.signal(AllocationWorkflow.replace_node, _report(a))
    await until(lambda: stand_ins.held("provision_node", c), what="c provisioning")
    await handle.signal(AllocationWorkflow.replace_node, _report(b))
    await until(lambda: f"remove_allocation_fabric_nodes:{b}" in stand_ins.steps(), what="b pulled")
    assert f"attach_node:{c} for {a}" not in stand_ins.steps()  # c still provisioning
    stand_ins.let_go()
    await until(lambda: stand_ins.allocations[alloc_id].status == "ready", what="ready again")
    assert await _cancelled(handle, stand_ins) == "released"

    assert stand_ins.steps()[len(READY) : -len(RELEASE)] == [
        f"detach_nodes:{a}",
        f"remove_allocation_fabric_nodes:{a}",
        f"reserve_replacement:{c}",
        "record_allocation_event:replacement_started",
        f"apply_allocation_fabric:{c}",
        f"detach_nodes:{b}",  # while c provisions
        f"remove_allocation_fabric_nodes:{b}",
        f"attach_node:{c} for {a}",
        f"reserve_replacement:{d}",
        "record_allocation_event:replacement_started",
        f"apply_allocation_fabric:{d}",
        f"attach_node:{d} for {b}",
    ]
    # Ready again only with the last replacement attached.
    assert [r.ready for r in stand_ins.requests("attach_node")] == [False, True]
    assert {stand_ins.nodes[a].state, stand_ins.nodes[b].state} == {S.QUARANTINED}


async def test_a_node_reported_while_the_allocation_provisions_is_replaced_before_ready(
    workflows, stand_ins: StandIns, uid
) -> None:
    alloc_id, (a, b), c = f"al-{uid}", [f"a-{uid}", f"b-{uid}"], f"c-{uid}"
    for node in (a, b):
        stand_ins.add_node(node, S.RESERVED)
    stand_ins.add_allocation(alloc_id, [a, b])
    stand_ins.add_node(c, S.AVAILABLE)
    stand_ins.spares.append(c)
    stand_ins.hold("provision_node", b)
    handle = await workflows.start(
        AllocationWorkflow.run, AllocationInput(allocation_id=alloc_id), id=f"alloc-{alloc_id}"
    )
    await until(lambda: stand_ins.held("provision_node", b) and stand_ins.nodes[a].state == S.ACTIVE, what="a active")
    await handle.signal(AllocationWorkflow.replace_node, _report(a))
    stand_ins.let_go()
    await until(lambda: stand_ins.allocations[alloc_id].status == "ready", what="ready")
    assert await _cancelled(handle, stand_ins) == "released"

    # The tenant is never handed a node known to be bad: the attach of its replacement is the
    # allocation's first ready, and billing starts with b alone (a was pulled before it).
    assert "set_allocation_status:ready" not in stand_ins.steps()
    assert stand_ins.steps()[2:8] == [
        f"detach_nodes:{a}",
        f"remove_allocation_fabric_nodes:{a}",
        f"reserve_replacement:{c}",
        "record_allocation_event:replacement_started",
        f"apply_allocation_fabric:{c}",
        f"attach_node:{c} for {a}",
    ]
    assert ["start", f"node_added:{b}"] in stand_ins.ledger
    assert [f"node_removed:{a}"] in stand_ins.ledger


async def test_a_report_repeated_for_a_node_already_pulled_pulls_nothing(workflows, stand_ins: StandIns, uid) -> None:
    handle, alloc_id, (a, b) = await _ready(workflows, stand_ins, uid, "c", "d")
    c, d = f"c-{uid}", f"d-{uid}"
    await handle.signal(AllocationWorkflow.replace_node, _report(a))
    await until(lambda: stand_ins.allocations[alloc_id].node_ids == [b, c], what="c attached")
    await handle.signal(AllocationWorkflow.replace_node, _report(a))  # the health loop says it again
    await handle.signal(AllocationWorkflow.replace_node, _report(b))  # handled after it: b's pull shows it was
    await until(lambda: stand_ins.allocations[alloc_id].node_ids == [c, d], what="d attached")
    assert await _cancelled(handle, stand_ins) == "released"
    detached = [step for step in stand_ins.steps() if step.startswith("detach_nodes")]
    assert detached == [f"detach_nodes:{a}", f"detach_nodes:{b}"]
    assert stand_ins.steps(a).count("transition_node:drain") == 1
    assert [r.replaces for r in stand_ins.requests("attach_node")] == [a, b]
