"""Fleet bring-up in batches: enrolled -> inspecting -> wiping -> burn_in -> available, many nodes at once.

A rack of new nodes arrives together; bringing each up in its own workflow costs the engine
some twenty tasks per node and caps a 2-core control plane at a few nodes a second. A batch
takes the same steps as `NodeOperationWorkflow`'s bring-up (the same step table, the same
compare-and-swap transitions, the same idempotent agent actions), but each step is one activity
for the whole batch: a transaction of CAS transitions, or concurrent calls to the agents.

Level-triggered, per node: each round reads where every node is and takes the step its state
calls for. A node that fails goes to its failure target like it would alone; a node someone
else moved (or whose agent stays silent) leaves the batch and is the reconciler's again.

Single flight: the starter first holds the nodes (`nodes.lease_for_bringup`, a conditional
update of `next_reconcile_at`, so of two racing starters only one gets a node) and the batch
renews the hold to each state's deadline as it goes; the reconciler leaves held nodes alone.
The hold runs out on its own if the batch dies; nodes the batch gives up on are handed back
with the reconciler's growing per-node backoff.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    import gpucloud.workflows.options as options
    from gpucloud.activities.bmc import BmcActivities
    from gpucloud.activities.control_db import ControlDbActivities
    from gpucloud.activities.host_agent import HostAgentActivities
    from gpucloud.models.messages import (
        AgentActionInput,
        AgentBatchInput,
        AgentBatchResult,
        BmcPowerInput,
        BringupInput,
        BringupResult,
        NodeOperationKind,
        NodeRef,
        NodeRefs,
        NodeTransitionBatch,
        NodeTransitionInput,
        NodeView,
        SweepResult,
    )
    from gpucloud.models.node_states import NodeEvent, NodeState
    from gpucloud.protocol.actions import AgentAction
    from gpucloud.workflows.db_steps import db_step
    from gpucloud.workflows.node_lifecycle import failure_message
    from gpucloud.workflows.node_steps import STEPS as NODE_STEPS
    from gpucloud.workflows.node_steps import SUCCESS, Act, Move

STEPS = NODE_STEPS[NodeOperationKind.BRINGUP]
DONE = SUCCESS[NodeOperationKind.BRINGUP]
# Each round moves every node one step; bring-up has four (inspect, and three agent actions).
MAX_ROUNDS = 10


@workflow.defn
class BringupBatchWorkflow:
    def __init__(self) -> None:
        self._nodes: dict[str, NodeView] = {}
        self._result = BringupResult()
        self._round = 0
        # Nodes left mid-way (agent silent): their hold is released for the reconciler.
        self._unfinished: set[str] = set()
        # Nodes whose BMC failed at power-on: their inspection fails with this cause.
        self._bmc_failed: dict[str, str] = {}

    @workflow.query
    def progress(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self._nodes.values():
            counts[node.state] = counts.get(node.state, 0) + 1
        counts["stopped"] = len(self._result.stopped)
        return counts

    @workflow.run
    async def run(self, inp: BringupInput) -> BringupResult:
        found = await db_step(ControlDbActivities.get_nodes, NodeRefs(node_ids=inp.node_ids))
        self._nodes = {n.node_id: n for n in found.nodes}
        for node_id in set(inp.node_ids) - set(self._nodes):
            self._result.stopped[node_id] = "node does not exist"
        await self._power_on([n for n in self._nodes.values() if n.has_bmc and n.state == NodeState.ENROLLED])

        while self._round < MAX_ROUNDS:
            self._round += 1
            working = {i: n for i, n in self._nodes.items() if NodeState(n.state) not in DONE}
            if not working:
                break
            moves: list[tuple[str, NodeEvent, str]] = []  # node id, event, cause
            acts: dict[AgentAction, list[str]] = {}  # action -> node ids
            for node_id, node in working.items():
                step = STEPS.get(NodeState(node.state))
                if step is None:
                    self._stop(node_id, f"node is {node.state}; bring-up cannot proceed")
                elif isinstance(step, Move):
                    moves.append((node_id, step.event, "bringup"))
                elif isinstance(step, Act):
                    acts.setdefault(step.action, []).append(node_id)
            for node_id, cause in list(self._bmc_failed.items()):
                if node_id in acts.get(AgentAction.INSPECT, []):
                    acts[AgentAction.INSPECT].remove(node_id)
                    moves.append((node_id, NodeEvent.FAIL, cause))
                    del self._bmc_failed[node_id]
            for action, node_ids in acts.items():
                if not node_ids:
                    continue
                outcome = await self._act(action, node_ids)
                for node_id in node_ids:
                    if node_id in outcome.unreachable:
                        self._stop(node_id, outcome.unreachable[node_id])
                        self._unfinished.add(node_id)
                    elif node_id in outcome.failed:
                        moves.append((node_id, NodeEvent.FAIL, f"{action} failed: {outcome.failed[node_id]}"))
                    else:
                        moves.append((node_id, NodeEvent.OK, f"{action} ok"))
            if moves:
                await self._move(moves)

        if self._unfinished:
            await db_step(ControlDbActivities.release_bringup_holds, NodeRefs(node_ids=sorted(self._unfinished)))
        for node_id, node in self._nodes.items():
            if NodeState(node.state) in DONE:
                self._result.available.append(node_id)
            elif node_id not in self._result.stopped:
                self._result.stopped[node_id] = f"ended {node.state}"
        await self._hand_on()
        return self._result

    async def _hand_on(self) -> None:
        """This batch's room goes to enrolled nodes still waiting for theirs, now rather than at
        the next sweep; should that fail, the sweep starts them as it always would."""
        try:
            # By name: the reconciler's activities start this workflow, so it cannot import them.
            started = await workflow.execute_activity(
                "start_waiting_bringups", result_type=SweepResult, **options.SWEEP
            )
        except ActivityError as err:
            workflow.logger.warning("waiting bring-ups left to the sweep: %s", failure_message(err))
            return
        self._result.handed_on = started.started

    async def _power_on(self, nodes: list[NodeView]) -> None:
        """Out of band first, for nodes with a BMC: what it says the system is, and its power on
        (the agent's heartbeat awaited when it was off). A node whose BMC fails (after its
        bounded retries) fails its inspection with the BMC's error: quarantined, cause named."""

        async def one(node: NodeView) -> None:
            try:
                ref = NodeRef(node_id=node.node_id)
                await workflow.execute_activity_method(BmcActivities.bmc_discover, ref, **options.BMC)
                req = BmcPowerInput(node_id=node.node_id, action="on", cause="bring-up", wait_for_agent=True)
                await workflow.execute_activity_method(BmcActivities.bmc_power, req, **options.BMC)
            except ActivityError as err:
                # Its inspection fails with the BMC's cause: the node ends quarantined, named why.
                self._bmc_failed[node.node_id] = f"power on through the BMC failed: {failure_message(err)}"

        await asyncio.gather(*(one(node) for node in nodes))

    def _stop(self, node_id: str, reason: str) -> None:
        self._result.stopped[node_id] = reason
        self._nodes.pop(node_id, None)

    async def _act(self, action: AgentAction, node_ids: list[str]) -> AgentBatchResult:
        info = workflow.info()
        items = [
            AgentActionInput(
                node_id=i,
                agent_url=self._nodes[i].agent_url,
                request_id=f"{info.workflow_id}/{info.run_id}/{self._round}/{i}",
            )
            for i in node_ids
        ]
        try:
            return await workflow.execute_activity_method(
                HostAgentActivities.agent_batch, AgentBatchInput(action=action, items=items), **options.AGENT_BATCH
            )
        except ActivityError as err:
            # The batch call itself kept failing (not one agent): leave these nodes to the reconciler.
            reason = f"{action} batch failed: {failure_message(err)}"
            return AgentBatchResult(unreachable=dict.fromkeys(node_ids, reason))

    async def _move(self, moves: list[tuple[str, NodeEvent, str]]) -> None:
        info = workflow.info()
        items = [
            NodeTransitionInput(
                node_id=node_id,
                event=event.value,
                from_state=self._nodes[node_id].state,
                op_id=f"{info.workflow_id}/{info.run_id}/{self._round}/{node_id}",
                cause=cause[:500],
                actor=f"workflow:{info.workflow_id}",
            )
            for node_id, event, cause in moves
        ]
        result = await db_step(
            ControlDbActivities.transition_nodes, NodeTransitionBatch(items=items, lease_to_deadline=True)
        )
        failures = {node_id: cause for node_id, event, cause in moves if event == NodeEvent.FAIL}
        for outcome in result.outcomes:
            if outcome.state is None:
                self._stop(outcome.node_id, f"node moved under us: {outcome.error}")
            elif outcome.node_id in failures:
                self._stop(outcome.node_id, f"{failures[outcome.node_id]} -> {outcome.state}")
            else:
                self._nodes[outcome.node_id] = self._nodes[outcome.node_id].model_copy(update={"state": outcome.state})
