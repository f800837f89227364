"""Per-node operations: one workflow at a time per node (id `node-<id>`), driving the node
through the state machine with its agent.

The workflow is level-triggered: it reads the node's current state and takes the step that
state calls for under its operation, until the node is in one of the operation's stop states.
So a workflow restarted after a crash (or started twice) continues from wherever the node is,
and every step is a compare-and-swap transition or an idempotent agent action.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.bmc import BmcActivities
    from gpucloud.activities.control_db import ControlDbActivities
    from gpucloud.activities.host_agent import HostAgentActivities
    from gpucloud.activities.reconciler import ReconcilerActivities
    from gpucloud.models import search_attributes as sa
    from gpucloud.models.messages import (
        AgentActionInput,
        BmcPowerInput,
        DiagnosisInput,
        EnrollmentInput,
        ImageCheckInput,
        NodeOperationInput,
        NodeOperationKind,
        NodeOperationResult,
        NodeRef,
        NodeTransitionInput,
    )
    from gpucloud.models.node_states import NodeEvent, NodeState
    from gpucloud.protocol.actions import AgentAction
    from gpucloud.workflows.db_steps import db_step
    from gpucloud.workflows.node_steps import AGENT_ACTIONS, STEPS, SUCCESS, WIPE, Move

Op, S, E, A = NodeOperationKind, NodeState, NodeEvent, AgentAction


# After a re-image's power cycle, the agent's answers are read this often for its new boot.
_BOOT_REPORTS, _BOOT_REPORT_EVERY_S = 10, 3.0


@workflow.defn
class NodeOperationWorkflow:
    def __init__(self) -> None:
        self._steps_taken = 0
        self._state: str = ""
        self._agent_url = ""
        self._has_bmc = False
        self._agent_reachable = True
        self._answer: dict = {}  # the agent's answer to the last action (a re-image reads its boot)
        self._enrolled_out_of_band = False  # a re-image's config drive handed the next credential

    @workflow.query
    def state(self) -> str:
        return self._state

    @workflow.run
    async def run(self, inp: NodeOperationInput) -> NodeOperationResult:
        self._inp = inp
        try:
            return await self._operate(inp)
        except (asyncio.CancelledError, ActivityError) as err:
            # The allocation was cancelled (Temporal cancels this workflow and its activity).
            if inp.operation != Op.PROVISION or not is_cancelled_exception(err):
                raise
            return await self._provision_cancelled()

    async def _operate(self, inp: NodeOperationInput) -> NodeOperationResult:
        node = await db_step(ControlDbActivities.get_node, NodeRef(node_id=inp.node_id))
        self._set_state(node.state)
        self._agent_url = node.agent_url
        self._has_bmc, self._agent_reachable = node.has_bmc, node.agent_reachable
        if inp.operation in (Op.PROVISION, Op.RELEASE, Op.RESTORE) and node.allocation_id not in (
            None,
            inp.allocation_id,
        ):
            return self._result(False, f"node belongs to allocation {node.allocation_id}, not {inp.allocation_id}")
        if inp.operation == Op.RESTORE:
            return await self._restore()
        if inp.operation == Op.DIAGNOSE:
            return await self._diagnose()
        error: str | None = None
        if inp.operation == Op.BRINGUP and self._state == S.ENROLLED and self._has_bmc:
            # Out of band first: what the BMC says the system is, and its power on.
            try:
                await workflow.execute_activity_method(
                    BmcActivities.bmc_discover, NodeRef(node_id=inp.node_id), **options.BMC
                )
                failure = await self._power("on", cause="bring-up")
            except ActivityError as err:
                failure = f"discovery through the BMC failed: {failure_message(err)}"
            if failure is not None:
                # Its inspection fails with the BMC's cause: quarantined, named why.
                if await self._move(E.INSPECT, cause="bring-up"):
                    await self._move(E.FAIL, cause=failure)
                return self._result(False, failure)
        if inp.operation == Op.REPAIR:
            error = await self._repair_rung()
            if self._state not in (S.WIPING, S.BURN_IN, S.AVAILABLE):
                return self._result(False, error or f"node is {self._state}; repair cannot proceed")
        return await self._drive(inp.operation, error)

    async def _drive(self, operation: NodeOperationKind, error: str | None = None) -> NodeOperationResult:
        """Take the step each state calls for under `operation` until a stop state."""
        while NodeState(self._state) not in SUCCESS[operation]:
            step = STEPS[operation].get(NodeState(self._state))
            if step is None:
                return self._result(False, error or f"node is {self._state}; {operation.value} cannot proceed")
            if isinstance(step, Move):
                if not await self._move(step.event, cause=operation.value):
                    return self._result(False, f"node moved under us from {self._state}")
                continue
            failure = None
            if operation == Op.DRAIN and self._has_bmc and not self._agent_reachable:
                # A host that is down runs nothing to release: quarantine it at once, and the
                # repair ladder power-cycles it through its BMC.
                failure = "the host is down (its agent is silent): to be power-cycled through its BMC"
            for action in (*step.before, step.action) if failure is None else ():
                if step is WIPE and action == A.WIPE:  # the tenant left: re-image before the wipe
                    failure = await self._reimage()
                failure = failure or await self._act(action)
                if failure:
                    break
            event = E.FAIL if failure else E.OK
            error = error or failure
            if not await self._move(event, cause=failure or f"{step.action} ok"):
                return self._result(False, f"node moved under us from {self._state}")
        return self._result(error is None, error)

    async def _provision_cancelled(self) -> NodeOperationResult:
        """The allocation was cancelled while this node was being provisioned: stop there. A
        node still reserved stays so, and one being provisioned goes to wiping, as after a failed
        provision: either way it stays the allocation's, whose release takes its fabric membership
        away first and then lets it go (unreserve; or release whatever started, wipe, burn-in).
        Unreserved here, it would be in the pool while still on the tenant's pkey and VPC, and the
        next allocation could take it before the release ran. One whose provision had completed
        stays active for that release."""
        node = await db_step(ControlDbActivities.get_node, NodeRef(node_id=self._inp.node_id))
        self._set_state(node.state)
        if node.allocation_id not in (None, self._inp.allocation_id):
            return self._result(False, f"node belongs to allocation {node.allocation_id}")
        if self._state == S.ACTIVE:
            return self._result(True, None)
        cause = "allocation cancelled during provisioning"
        if self._state == S.PROVISIONING:
            await self._move(E.FAIL, cause=cause)
        return self._result(False, cause)

    async def _restore(self) -> NodeOperationResult:
        """The node is active in the record but its agent lost the workload: provision again
        (idempotent on the agent); the state does not change."""
        if self._state != S.ACTIVE:
            return self._result(False, f"node is {self._state}; only an active node is restored")
        failure = await self._act(A.PROVISION)
        return self._result(failure is None, failure)

    async def _diagnose(self) -> NodeOperationResult:
        """A scheduled diagnostic of an idle node the reconciler leased (`services/diagnostics.py`):
        the agent's diagnose, then its findings recorded and judged and the lease released,
        whatever the agent answered. Findings that pull the node (a failed diag) drain it here,
        under the node's single-flight id this workflow holds; otherwise the state is unchanged."""
        lease = self._inp.lease or ""
        failure: str | None = None
        answer: dict | None = None
        if self._state != S.AVAILABLE:
            failure = f"node is {self._state}; only an available node is diagnosed"
        else:
            self._steps_taken += 1
            info = workflow.info()
            req = AgentActionInput(
                node_id=self._inp.node_id,
                agent_url=self._agent_url,
                request_id=f"{info.workflow_id}/{info.run_id}/{self._steps_taken}",
            )
            try:
                done = await workflow.execute_activity_method(
                    HostAgentActivities.diagnose_node, req, **options.DIAGNOSE
                )
                answer = done.details
            except ActivityError as err:
                if is_cancelled_exception(err):
                    raise
                failure = f"diagnose failed: {failure_message(err)}"
        record = DiagnosisInput(node_id=self._inp.node_id, lease=lease, answer=answer, failure=failure)
        drain = await db_step(ReconcilerActivities.record_diagnosis, record)
        if drain:  # the findings pull the node: drain it under this same id, before anyone takes it
            return await self._drive(Op.DRAIN)
        return self._result(failure is None, failure)

    async def _repair_rung(self) -> str | None:
        """quarantined -> repairing -> the ladder's next rung -> wiping; then, like every way back
        to the pool, wipe and burn-in, which decides. None when the rung held, else why not.

        A burn-in failure sends the node back to quarantine; the reconciler starts the next
        repair, whose plan climbs one rung (reset, reboot, reflash). A lemon, or a ladder that
        is used up, goes to RMA without another reset.
        """
        if self._state == S.QUARANTINED and not await self._move(E.REPAIR, cause="repair"):
            return f"node moved under us from {self._state}"
        if self._state != S.REPAIRING:
            return None
        plan = await db_step(ControlDbActivities.plan_repair, NodeRef(node_id=self._inp.node_id))
        actions: list[AgentAction | Literal["power_cycle"]] = list(plan.actions)
        if self._has_bmc and not self._agent_reachable and actions:
            # The host is down (hung, or off): only its BMC can act, and a power cycle stops
            # whatever ran. Then wipe and burn-in decide, as after any rung.
            actions, failure = ["power_cycle"], None
        else:
            # Whatever still runs on a node pulled from an allocation stops before the rung.
            failure = (await self._act(A.RELEASE)) if actions else plan.reason
        for action in actions if failure is None else ():
            failure = await self._act(action)
            if failure is None:
                break
        if not await self._move(E.FAIL if failure else E.OK, cause=failure or plan.reason):
            return f"node moved under us from {self._state}"
        return failure

    async def _move(self, event: NodeEvent, *, cause: str) -> bool:
        self._steps_taken += 1
        info = workflow.info()
        req = NodeTransitionInput(
            node_id=self._inp.node_id,
            event=event.value,
            from_state=self._state,
            op_id=f"{info.workflow_id}/{info.run_id}/{self._steps_taken}",
            cause=cause[:500],
            actor=f"workflow:{info.workflow_id}",
            tenant_id=self._inp.tenant_id if event == E.PROVISION else None,
        )
        try:
            result = await db_step(ControlDbActivities.transition_node, req)
        except ActivityError as err:
            if isinstance(err.cause, ApplicationError) and err.cause.non_retryable:
                return False
            raise
        self._set_state(result.state)
        return True

    async def _reimage(self) -> str | None:
        """Boot the node from the clean image through its BMC and check what booted
        (`activities/bmc.py`); None when it did, or when the node cannot be re-imaged (the
        in-band wipe alone cleans it, recorded as weaker), else why the node fails closed."""
        boot_id_before = self._answer.get("boot_id")  # the release just before this
        ref = NodeRef(node_id=self._inp.node_id)
        try:
            booted = await workflow.execute_activity_method(BmcActivities.bmc_boot_image, ref, **options.BMC)
        except ActivityError as err:
            if is_cancelled_exception(err):
                raise
            return f"re-image through the BMC failed: {failure_message(err)}"
        if not booted.done:
            return None
        for _ in range(_BOOT_REPORTS):  # the agent answers from the new boot once its host is up
            failure = await self._act(A.RELEASE)
            if failure:
                return f"no report after the re-image: {failure}"
            if self._answer.get("boot_id") != boot_id_before:
                break
            await workflow.sleep(_BOOT_REPORT_EVERY_S)
        check = ImageCheckInput(
            node_id=self._inp.node_id,
            boot_id_before=boot_id_before,
            boot_id=self._answer.get("boot_id"),
            image_digest=self._answer.get("image_digest"),
            actor=f"workflow:{workflow.info().workflow_id}",
        )
        result = await workflow.execute_activity_method(BmcActivities.bmc_check_image, check, **options.BMC)
        if not result.ok:
            return f"re-image check failed: {result.answer}"
        # Only the checked boot gets the node's next credential: through the image's config
        # drive, never through the agent that answered before (nor the wipe that follows).
        self._steps_taken += 1
        info = workflow.info()
        enroll = EnrollmentInput(
            node_id=self._inp.node_id,
            request_id=f"{info.workflow_id}/{info.run_id}/{self._steps_taken}",
            actor=f"workflow:{info.workflow_id}",
        )
        try:
            enrolled = await workflow.execute_activity_method(
                BmcActivities.bmc_hand_enrollment, enroll, **options.BMC_ENROLLMENT
            )
        except ActivityError as err:
            if is_cancelled_exception(err):
                raise
            return f"enrollment of the re-imaged node failed: {failure_message(err)}"
        self._enrolled_out_of_band = enrolled.done
        return None

    async def _power(self, action: str, *, cause: str) -> str | None:
        """A power action through the node's BMC, waiting for its agent after an on or a cycle;
        None on success, the BMC's (or the boot's) failure otherwise."""
        req = BmcPowerInput(
            node_id=self._inp.node_id,
            action=action,
            cause=cause,
            actor=f"workflow:{workflow.info().workflow_id}",
            wait_for_agent=action in ("on", "cycle"),
        )
        try:
            await workflow.execute_activity_method(BmcActivities.bmc_power, req, **options.BMC)
        except ActivityError as err:
            if is_cancelled_exception(err):
                raise
            return f"power {action} through the BMC failed: {failure_message(err)}"
        return None

    async def _act(self, action: AgentAction | Literal["power_cycle"]) -> str | None:
        """Run one agent action; None on success, the reason on failure. With a BMC, the repair
        ladder's reboot is a power cycle through it (the agent's own reboot needs a live host)."""
        if action == "power_cycle" or (action == A.REBOOT and self._has_bmc):
            return await self._power("cycle", cause=f"repair: {action}")
        if action == A.REFLASH and self._has_bmc:
            ref = NodeRef(node_id=self._inp.node_id)
            try:
                update = await workflow.execute_activity_method(BmcActivities.bmc_firmware_update, ref, **options.BMC)
            except ActivityError as err:
                if is_cancelled_exception(err):
                    raise
                return f"reflash through the BMC failed: {failure_message(err)}"
            if update.done:  # the new firmware takes effect at the next power-on
                return await self._power("cycle", cause="repair: reflash through the BMC")
        self._steps_taken += 1
        info = workflow.info()
        req = AgentActionInput(
            node_id=self._inp.node_id,
            agent_url=self._agent_url,
            request_id=f"{info.workflow_id}/{info.run_id}/{self._steps_taken}",
            tenant_id=self._inp.tenant_id,
            allocation_id=self._inp.allocation_id if action == A.PROVISION else None,
            workload=self._inp.workload if action == A.PROVISION else None,
            hand_credential=not (action == A.WIPE and self._enrolled_out_of_band),
        )
        try:
            done = await workflow.execute_activity_method(AGENT_ACTIONS[action], req, **options.AGENT)
        except ActivityError as err:
            if is_cancelled_exception(err):
                raise  # stopped, not failed: the caller decides what a cancel means
            return f"{action} failed: {failure_message(err)}"
        self._answer = done.details
        return None

    def _set_state(self, state: str) -> None:
        self._state = state
        workflow.upsert_search_attributes([sa.NODE_STATE.value_set(state)])

    def _result(self, ok: bool, error: str | None) -> NodeOperationResult:
        return NodeOperationResult(node_id=self._inp.node_id, ok=ok, state=self._state, error=None if ok else error)


def failure_message(err: ActivityError) -> str:
    """What an activity failure says: its cause's message (an application error's), else its own."""
    cause = err.cause
    return str(getattr(cause, "message", None) or cause or err.message)
