"""`NodeOperationWorkflow` with its activities stood in for: each operation's steps in order
(state moves through the real transition table, agent actions, the BMC's out-of-band steps),
and where each failure leaves the node."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowHandle

from gpucloud.models.messages import NodeOperationInput, NodeOperationKind, NodeOperationResult
from gpucloud.models.node_states import NodeState
from gpucloud.models.workflow_ids import node_workflow_id
from gpucloud.protocol.actions import Workload
from gpucloud.workflows.node_lifecycle import NodeOperationWorkflow
from support.workflow_mocks import StandIns, until

pytestmark = pytest.mark.workflow

Op, S = NodeOperationKind, NodeState
# The clean way back to the pool from wiping, on a node without a BMC (no re-image).
WIPE_IN_BAND = [
    "release_node",
    "bmc_boot_image:no BMC",
    "wipe_node",
    "transition_node:ok",
    "burn_in_node",
    "transition_node:ok",
]
BURN_IN = ["burn_in_node", "transition_node:ok"]


async def _start(workflows, node_id: str, op: NodeOperationKind, **inp) -> WorkflowHandle:
    return await workflows.start(
        NodeOperationWorkflow.run,
        NodeOperationInput(node_id=node_id, operation=op, **inp),
        id=node_workflow_id(node_id),
    )


async def _operate(workflows, node_id: str, op: NodeOperationKind, **inp) -> NodeOperationResult:
    return await (await _start(workflows, node_id, op, **inp)).result()


# ---------------------------------------------------------------- bring-up


async def test_bringup_inspects_wipes_and_burns_in(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.ENROLLED)
    result = await _operate(workflows, node, Op.BRINGUP)
    assert (result.ok, result.state, result.error) == (True, "available", None)
    # A first wipe: nothing of a tenant ran there, so neither a release nor a re-image first.
    assert stand_ins.steps(node) == [
        "get_node",
        "transition_node:inspect",
        "inspect_node",
        "transition_node:ok",
        "wipe_node",
        "transition_node:ok",
        *BURN_IN,
    ]


async def test_bringup_with_a_bmc_discovers_and_powers_on_first(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.ENROLLED, has_bmc=True)
    result = await _operate(workflows, node, Op.BRINGUP)
    assert result.ok and result.state == "available"
    assert stand_ins.steps(node)[:4] == ["get_node", "bmc_discover", "bmc_power:on", "transition_node:inspect"]
    (power,) = stand_ins.requests("bmc_power", node)
    assert power.wait_for_agent and power.cause == "bring-up"


async def test_bringup_whose_bmc_fails_quarantines_the_node_naming_why(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.ENROLLED, has_bmc=True)
    stand_ins.fail("bmc_power", node, message="BMC unreachable")
    result = await _operate(workflows, node, Op.BRINGUP)
    assert (result.ok, result.state) == (False, "quarantined")
    assert result.error == "power on through the BMC failed: BMC unreachable"
    # No agent action: its inspection fails with the BMC's cause.
    assert stand_ins.steps(node) == [
        "get_node",
        "bmc_discover",
        "bmc_power:on",
        "transition_node:inspect",
        "transition_node:fail",
    ]
    assert stand_ins.requests("transition_node", node)[-1].cause == result.error


# ---------------------------------------------------------------- provision, restore, release


async def test_provision_hands_the_agent_the_workload(workflows, stand_ins: StandIns, uid) -> None:
    node, alloc = f"n-{uid}", f"a-{uid}"
    stand_ins.add_node(node, S.RESERVED, allocation_id=alloc)
    workload = Workload(command=["python", "train.py"])
    result = await _operate(workflows, node, Op.PROVISION, allocation_id=alloc, tenant_id="ten_a", workload=workload)
    assert (result.ok, result.state) == (True, "active")
    assert stand_ins.steps(node) == ["get_node", "transition_node:provision", "provision_node", "transition_node:ok"]
    assert stand_ins.requests("transition_node", node)[0].tenant_id == "ten_a"
    (provision,) = stand_ins.requests("provision_node", node)
    assert (provision.allocation_id, provision.tenant_id, provision.workload) == (alloc, "ten_a", workload)


async def test_a_failed_provision_fails_the_node_and_wipes_it_back_to_the_pool(
    workflows, stand_ins: StandIns, uid
) -> None:
    node, alloc = f"n-{uid}", f"a-{uid}"
    stand_ins.add_node(node, S.RESERVED, allocation_id=alloc)
    stand_ins.fail("provision_node", node, message="image pull failed", type="AgentActionFailed")
    result = await _operate(workflows, node, Op.PROVISION, allocation_id=alloc, tenant_id="ten_a")
    assert (result.ok, result.state, result.error) == (False, "available", "provision failed: image pull failed")
    # FAIL from provisioning leads to wiping: whatever started is released before the wipe.
    assert stand_ins.steps(node) == [
        "get_node",
        "transition_node:provision",
        "provision_node",
        "transition_node:fail",
        *WIPE_IN_BAND,
    ]


async def test_provision_of_another_allocations_node_is_refused_untouched(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.RESERVED, allocation_id="a-other")
    result = await _operate(workflows, node, Op.PROVISION, allocation_id=f"a-{uid}", tenant_id="ten_a")
    assert (result.ok, result.state) == (False, "reserved")
    assert result.error == f"node belongs to allocation a-other, not a-{uid}"
    assert stand_ins.steps(node) == ["get_node"]


async def test_a_node_moved_under_the_workflow_stops_it(workflows, stand_ins: StandIns, uid) -> None:
    node, alloc = f"n-{uid}", f"a-{uid}"
    stand_ins.add_node(node, S.RESERVED, allocation_id=alloc)
    stand_ins.fail("transition_node", node, message="node is available, not reserved", type="StaleNode")
    result = await _operate(workflows, node, Op.PROVISION, allocation_id=alloc)
    assert (result.ok, result.error) == (False, "node moved under us from reserved")
    assert stand_ins.steps(node) == ["get_node", "transition_node:provision"]


async def test_a_cancel_during_provisioning_fails_the_node_to_wiping(workflows, stand_ins: StandIns, uid) -> None:
    node, alloc = f"n-{uid}", f"a-{uid}"
    stand_ins.add_node(node, S.RESERVED, allocation_id=alloc)
    stand_ins.hold("provision_node", node)
    handle = await _start(workflows, node, Op.PROVISION, allocation_id=alloc)
    await until(lambda: stand_ins.held("provision_node", node))
    await handle.cancel()
    result: NodeOperationResult = await handle.result()
    # Left for the allocation's release to recycle: release, wipe, burn-in.
    assert (result.ok, result.state, result.error) == (False, "wiping", "allocation cancelled during provisioning")
    assert stand_ins.steps(node) == [
        "get_node",
        "transition_node:provision",
        "provision_node",
        "get_node",
        "transition_node:fail",
    ]


async def test_restore_provisions_an_active_node_again_without_a_move(workflows, stand_ins: StandIns, uid) -> None:
    node, alloc = f"n-{uid}", f"a-{uid}"
    stand_ins.add_node(node, S.ACTIVE, allocation_id=alloc)
    result = await _operate(workflows, node, Op.RESTORE, allocation_id=alloc)
    assert (result.ok, result.state) == (True, "active")
    assert stand_ins.steps(node) == ["get_node", "provision_node"]


async def test_release_ends_when_the_tenant_is_off_the_node(workflows, stand_ins: StandIns, uid) -> None:
    node, alloc = f"n-{uid}", f"a-{uid}"
    stand_ins.add_node(node, S.ACTIVE, allocation_id=alloc)
    result = await _operate(workflows, node, Op.RELEASE, allocation_id=alloc)
    # Wiping is the release's end: the recycle (its own workflow) wipes and burns in.
    assert (result.ok, result.state) == (True, "wiping")
    assert stand_ins.steps(node) == ["get_node", "transition_node:release", "release_node", "transition_node:ok"]


# ---------------------------------------------------------------- recycle: the re-image out of band


def _reimaged(enrollment: str) -> list[str]:
    return [
        "get_node",
        "release_node",
        "bmc_boot_image:done",
        "release_node",  # the agent's answer from its new boot
        "bmc_check_image:ok",
        f"bmc_hand_enrollment:{enrollment}",
        "wipe_node",
        "transition_node:ok",
        *BURN_IN,
    ]


async def test_recycle_reimages_and_enrolls_out_of_band_before_the_wipe(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.WIPING, has_bmc=True)
    result = await _operate(workflows, node, Op.RECYCLE)
    assert (result.ok, result.state) == (True, "available")
    assert stand_ins.steps(node) == _reimaged("done")
    (check,) = stand_ins.requests("bmc_check_image", node)
    assert (check.boot_id_before, check.boot_id) == ("boot-1", "boot-2")
    # The config drive handed the checked boot its credential: the wipe hands none in band.
    (wipe,) = stand_ins.requests("wipe_node", node)
    assert wipe.hand_credential is False


async def test_recycle_without_a_config_drive_hands_the_credential_with_the_wipe(
    workflows, stand_ins: StandIns, uid
) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.WIPING, has_bmc=True, config_drive=False)
    result = await _operate(workflows, node, Op.RECYCLE)
    assert (result.ok, result.state) == (True, "available")
    assert stand_ins.steps(node) == _reimaged("no drive")
    (wipe,) = stand_ins.requests("wipe_node", node)
    assert wipe.hand_credential is True


async def test_recycle_whose_booted_image_does_not_check_out_is_quarantined(
    workflows, stand_ins: StandIns, uid
) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.WIPING, has_bmc=True, image_ok=False)
    result = await _operate(workflows, node, Op.RECYCLE)
    assert (result.ok, result.state) == (False, "quarantined")
    assert result.error == "re-image check failed: the booted image is not the clean image"
    # Fails closed: neither a credential nor a wipe for a boot that did not check out.
    assert stand_ins.steps(node) == [
        "get_node",
        "release_node",
        "bmc_boot_image:done",
        "release_node",
        "bmc_check_image:mismatch",
        "transition_node:fail",
    ]


async def test_recycle_without_a_bmc_wipes_in_band_and_hands_the_credential(
    workflows, stand_ins: StandIns, uid
) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.WIPING)
    result = await _operate(workflows, node, Op.RECYCLE)
    assert (result.ok, result.state) == (True, "available")
    assert stand_ins.steps(node) == ["get_node", *WIPE_IN_BAND]
    assert stand_ins.requests("wipe_node", node)[0].hand_credential is True


async def test_a_failed_wipe_quarantines_the_node(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.WIPING)
    stand_ins.fail("wipe_node", node, message="secure erase failed", type="AgentActionFailed")
    result = await _operate(workflows, node, Op.RECYCLE)
    assert (result.ok, result.state, result.error) == (False, "quarantined", "wipe failed: secure erase failed")
    assert stand_ins.steps(node) == [
        "get_node",
        "release_node",
        "bmc_boot_image:no BMC",
        "wipe_node",
        "transition_node:fail",
    ]


# ---------------------------------------------------------------- drain and repair


async def test_drain_releases_the_node_into_quarantine(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.ACTIVE, allocation_id=f"a-{uid}")
    result = await _operate(workflows, node, Op.DRAIN)
    assert (result.ok, result.state) == (True, "quarantined")
    assert stand_ins.steps(node) == ["get_node", "transition_node:drain", "release_node", "transition_node:ok"]


async def test_drain_of_a_host_that_is_down_quarantines_it_at_once(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.ACTIVE, has_bmc=True, agent_reachable=False)
    result = await _operate(workflows, node, Op.DRAIN)
    assert (result.ok, result.state) == (False, "quarantined")
    assert result.error is not None and result.error.startswith("the host is down")
    assert stand_ins.steps(node) == ["get_node", "transition_node:drain", "transition_node:fail"]


async def test_repair_climbs_its_rung_then_wipes_and_burns_in(workflows, stand_ins: StandIns, uid) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.QUARANTINED)
    result = await _operate(workflows, node, Op.REPAIR)
    assert (result.ok, result.state) == (True, "available")
    assert stand_ins.steps(node) == [
        "get_node",
        "transition_node:repair",
        "plan_repair",
        "release_node",  # whatever still ran stops before the rung
        "reset_node",
        "transition_node:ok",
        *WIPE_IN_BAND,
    ]


async def test_repair_of_a_host_that_is_down_power_cycles_it_through_its_bmc(
    workflows, stand_ins: StandIns, uid
) -> None:
    node = f"n-{uid}"
    stand_ins.add_node(node, S.QUARANTINED, has_bmc=True, agent_reachable=False)
    result = await _operate(workflows, node, Op.REPAIR)
    assert (result.ok, result.state) == (True, "available")
    assert stand_ins.steps(node)[:5] == [
        "get_node",
        "transition_node:repair",
        "plan_repair",
        "bmc_power:cycle",
        "transition_node:ok",
    ]
    assert "reset_node" not in stand_ins.steps(node)
