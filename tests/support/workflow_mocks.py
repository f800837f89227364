"""Stand-ins for the activities the node, bring-up and allocation workflows call: a small fleet
in memory that answers as the control plane's DB, agents, BMCs, fabric managers and ledger do,
records every call in order, and fails a call on demand.

Each stand-in is registered under the real activity's name (the method's name: the workflows call
`workflow.execute_activity_method(ControlDbActivities.get_node, ...)`), so the workflows run as
written; `test_stand_ins.py` checks that every name here is a real activity's. Node moves go
through the real transition table (`models/node_states.py`), with the DB's compare-and-swap on
the state a workflow last read. Every failure is raised non-retryable: a test waits for no
retry's backoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.models.billing_messages import LedgerEventsInput, LedgerEventsResult
from gpucloud.models.fabric_messages import (
    FabricApplyInput,
    FabricMembershipResult,
    FabricReleaseInput,
    FabricRemoveInput,
)
from gpucloud.models.messages import (
    AgentActionInput,
    AgentActionResult,
    AgentBatchInput,
    AgentBatchResult,
    AllocationEventInput,
    AllocationInput,
    AllocationStatusInput,
    AllocationView,
    AttachNodeInput,
    BmcPowerInput,
    BmcPowerResult,
    DetachNodesInput,
    DetachNodesResult,
    EnrollmentInput,
    EnrollmentResult,
    ImageCheckInput,
    ImageCheckResult,
    NodeRef,
    NodeRefs,
    NodeTransitionBatch,
    NodeTransitionBatchResult,
    NodeTransitionInput,
    NodeTransitionOutcome,
    NodeTransitionResult,
    NodeView,
    NodeViews,
    RepairPlan,
    ReplacementInput,
    ReplacementResult,
    SweepResult,
)
from gpucloud.models.node_states import InvalidTransition, NodeState, next_state
from gpucloud.protocol.actions import AgentAction, Workload

CLEAN_IMAGE = "sha256:" + "c" * 64
# How long a held activity waits for `let_go` at most: a test that forgets it fails, not hangs.
HOLD_LIMIT_S = 30.0


@dataclass
class FakeNode:
    """What the stand-in DB, agent and BMC know of one node."""

    node_id: str
    state: str
    allocation_id: str | None = None
    tenant_id: str | None = None
    has_bmc: bool = False
    agent_reachable: bool = True
    generation: int = 0
    boot_id: str = "boot-1"
    # What its BMC does: the image it boots checks out, and a config drive hands the credential.
    image_ok: bool = True
    config_drive: bool = True
    repair: RepairPlan | None = None


@dataclass
class FakeAllocation:
    allocation_id: str
    tenant_id: str
    node_ids: list[str]
    status: str = "provisioning"
    desired: str = "running"
    workload: Workload | None = None
    failure_reason: str | None = None


@dataclass(frozen=True)
class Call:
    """One activity call: its name, the node it was about (None: the allocation's own), a short
    detail (the event, the action, the status), and the request as the workflow sent it."""

    name: str
    node_id: str | None
    detail: str = ""
    req: Any = None

    @property
    def step(self) -> str:
        return f"{self.name}:{self.detail}" if self.detail else self.name


@dataclass
class _Failure:
    message: str
    type: str


@dataclass
class StandIns:
    """The fleet in memory and the activities that read and change it."""

    nodes: dict[str, FakeNode] = field(default_factory=dict)
    allocations: dict[str, FakeAllocation] = field(default_factory=dict)
    spares: list[str] = field(default_factory=list)  # nodes reserve_replacement hands out, in order
    calls: list[Call] = field(default_factory=list)
    ledger: list[list[str]] = field(default_factory=list)  # each send's events, "kind" or "kind:node"
    unreachable: set[str] = field(default_factory=set)  # agents a bring-up batch cannot reach
    waiting_started: int = 0  # what start_waiting_bringups answers
    _failures: dict[tuple[str, str | None], _Failure] = field(default_factory=dict)
    _holds: dict[tuple[str, str | None], asyncio.Event] = field(default_factory=dict)

    # ------------------------------------------------------------ set-up

    def add_node(self, node_id: str, state: str | NodeState, **fields: Any) -> FakeNode:
        node = FakeNode(node_id=node_id, state=str(state), **fields)
        self.nodes[node_id] = node
        return node

    def add_allocation(self, allocation_id: str, node_ids: list[str], **fields: Any) -> FakeAllocation:
        """An allocation whose nodes the API reserved (they exist already, `reserved`)."""
        alloc = FakeAllocation(allocation_id=allocation_id, tenant_id="ten_a", node_ids=list(node_ids), **fields)
        self.allocations[allocation_id] = alloc
        for node_id in node_ids:
            self.nodes[node_id].allocation_id = allocation_id
        return alloc

    def fail(
        self, name: str, node_id: str | None = None, *, message: str = "stand-in failure", type: str = "StandInFailure"
    ) -> None:
        """Every later call of activity `name` (about `node_id`, or any) fails with `message`.
        `agent_batch:<action>` fails that action for the node inside a batch."""
        self._failures[(name, node_id)] = _Failure(message, type)

    def hold(self, name: str, node_id: str | None = None) -> None:
        """Calls of `name` (about `node_id`) wait, heartbeating, until `let_go` or their cancel."""
        self._holds[(name, node_id)] = asyncio.Event()

    def let_go(self) -> None:
        for event in self._holds.values():
            event.set()

    # ------------------------------------------------------------ what happened

    def steps(self, node_id: str | None = None) -> list[str]:
        """The calls about `node_id` in order (None: the allocation's own, ledger sends aside)."""
        return [c.step for c in self.calls if c.node_id == node_id]

    def requests(self, name: str, node_id: str | None = None) -> list[Any]:
        return [c.req for c in self.calls if c.name == name and (node_id is None or c.node_id == node_id)]

    def calls_of(self, prefix: str) -> list[Any]:
        """The requests of every call whose name starts with `prefix`, in order."""
        return [c.req for c in self.calls if c.name.startswith(prefix)]

    def held(self, name: str, node_id: str | None = None) -> bool:
        """Whether a call of `name` (about `node_id`) has started (and is waiting in its hold)."""
        return any(c.name == name and c.node_id == node_id for c in self.calls)

    def activities(self) -> list[Any]:
        return [
            self.get_node,
            self.get_nodes,
            self.transition_node,
            self.transition_nodes,
            self.release_bringup_holds,
            self.plan_repair,
            self.load_allocation,
            self.set_allocation_status,
            self.detach_nodes,
            self.reserve_replacement,
            self.attach_node,
            self.record_allocation_event,
            self.inspect_node,
            self.burn_in_node,
            self.provision_node,
            self.release_node,
            self.wipe_node,
            self.reset_node,
            self.reboot_node,
            self.reflash_node,
            self.agent_batch,
            self.bmc_discover,
            self.bmc_power,
            self.bmc_firmware_update,
            self.bmc_boot_image,
            self.bmc_check_image,
            self.bmc_hand_enrollment,
            self.apply_allocation_fabric,
            self.remove_allocation_fabric_nodes,
            self.release_allocation_fabric,
            self.record_ledger_events,
            self.start_waiting_bringups,
        ]

    # ------------------------------------------------------------ plumbing

    async def _called(self, name: str, node_id: str | None, detail: str = "", req: Any = None) -> None:
        self.calls.append(Call(name, node_id, detail, req))
        hold = self._holds.get((name, node_id))
        if hold is not None:
            await _wait_heartbeating(hold)
        failure = self._failures.get((name, node_id)) or self._failures.get((name, None))
        if failure is not None:
            raise ApplicationError(failure.message, type=failure.type, non_retryable=True)

    def _view(self, node: FakeNode) -> NodeView:
        return NodeView(
            node_id=node.node_id,
            state=node.state,
            generation=node.generation,
            agent_url=f"https://{node.node_id}.agents.test",
            allocation_id=node.allocation_id,
            tenant_id=node.tenant_id,
            has_bmc=node.has_bmc,
            agent_reachable=node.agent_reachable,
        )

    def _move(self, req: NodeTransitionInput) -> str:
        """The DB's compare-and-swap through the real table; the new state, or raises why not."""
        node = self.nodes.get(req.node_id)
        if node is None:
            raise ApplicationError(f"node {req.node_id} does not exist", type="NodeNotFound", non_retryable=True)
        if node.state != req.from_state:
            raise ApplicationError(
                f"node {req.node_id} is {node.state}, not {req.from_state}", type="StaleNode", non_retryable=True
            )
        try:
            node.state = str(next_state(node.state, req.event))
        except InvalidTransition as exc:
            raise ApplicationError(str(exc), type="InvalidTransition", non_retryable=True) from exc
        node.generation += 1
        if req.tenant_id is not None:
            node.tenant_id = req.tenant_id
        if node.state == NodeState.AVAILABLE:  # back in the pool: no one's
            node.allocation_id = node.tenant_id = None
        return node.state

    def _allocation(self, allocation_id: str) -> FakeAllocation:
        return self.allocations[allocation_id]

    def _allocation_view(self, alloc: FakeAllocation) -> AllocationView:
        return AllocationView(
            allocation_id=alloc.allocation_id,
            tenant_id=alloc.tenant_id,
            status=alloc.status,
            desired=alloc.desired,
            node_ids=list(alloc.node_ids),
            workload=alloc.workload,
        )

    # ------------------------------------------------------------ the control DB

    @activity.defn(name="get_node")
    async def get_node(self, req: NodeRef) -> NodeView:
        await self._called("get_node", req.node_id, req=req)
        return self._view(self.nodes[req.node_id])

    @activity.defn(name="get_nodes")
    async def get_nodes(self, req: NodeRefs) -> NodeViews:
        await self._called("get_nodes", None, ",".join(req.node_ids), req)
        return NodeViews(nodes=[self._view(self.nodes[i]) for i in req.node_ids if i in self.nodes])

    @activity.defn(name="transition_node")
    async def transition_node(self, req: NodeTransitionInput) -> NodeTransitionResult:
        await self._called("transition_node", req.node_id, req.event, req)
        state = self._move(req)
        return NodeTransitionResult(node_id=req.node_id, state=state, generation=self.nodes[req.node_id].generation)

    @activity.defn(name="transition_nodes")
    async def transition_nodes(self, req: NodeTransitionBatch) -> NodeTransitionBatchResult:
        outcomes = []
        for item in req.items:
            try:
                await self._called("transition_nodes", item.node_id, item.event, item)
                outcomes.append(NodeTransitionOutcome(node_id=item.node_id, state=self._move(item)))
            except ApplicationError as exc:
                outcomes.append(NodeTransitionOutcome(node_id=item.node_id, error=exc.message))
        return NodeTransitionBatchResult(outcomes=outcomes)

    @activity.defn(name="release_bringup_holds")
    async def release_bringup_holds(self, req: NodeRefs) -> int:
        await self._called("release_bringup_holds", None, ",".join(req.node_ids), req)
        return len(req.node_ids)

    @activity.defn(name="plan_repair")
    async def plan_repair(self, req: NodeRef) -> RepairPlan:
        await self._called("plan_repair", req.node_id, req=req)
        node = self.nodes[req.node_id]
        return node.repair or RepairPlan(node_id=req.node_id, actions=[AgentAction.RESET], reason="first repair")

    @activity.defn(name="load_allocation")
    async def load_allocation(self, req: AllocationInput) -> AllocationView:
        await self._called("load_allocation", None, req=req)
        return self._allocation_view(self._allocation(req.allocation_id))

    @activity.defn(name="set_allocation_status")
    async def set_allocation_status(self, req: AllocationStatusInput) -> AllocationView:
        await self._called("set_allocation_status", None, req.status, req)
        alloc = self._allocation(req.allocation_id)
        alloc.status, alloc.failure_reason = req.status, req.failure_reason
        return self._allocation_view(alloc)

    @activity.defn(name="detach_nodes")
    async def detach_nodes(self, req: DetachNodesInput) -> DetachNodesResult:
        wanted = [n.node_id for n in req.nodes]
        await self._called("detach_nodes", None, ",".join(wanted), req)
        alloc = self._allocation(req.allocation_id)
        pulled = [node_id for node_id in wanted if node_id in alloc.node_ids]
        alloc.node_ids = [n for n in alloc.node_ids if n not in pulled]
        if pulled:
            alloc.status = "degraded"
        return DetachNodesResult(pulled=pulled, allocation=self._allocation_view(alloc))

    @activity.defn(name="reserve_replacement")
    async def reserve_replacement(self, req: ReplacementInput) -> ReplacementResult:
        found = next((n for n in self.spares if n not in req.exclude), None)
        await self._called("reserve_replacement", None, found or "none", req)
        if found is None:
            return ReplacementResult(reason="no available node in fabric domain pod-1; waiting for capacity")
        self.spares.remove(found)
        node = self.nodes[found]
        node.state, node.allocation_id = str(NodeState.RESERVED), req.allocation_id
        return ReplacementResult(node_id=found)

    @activity.defn(name="attach_node")
    async def attach_node(self, req: AttachNodeInput) -> AllocationView:
        await self._called("attach_node", None, f"{req.node_id} for {req.replaces}", req)
        alloc = self._allocation(req.allocation_id)
        if req.node_id not in alloc.node_ids:
            alloc.node_ids.append(req.node_id)
        if req.ready:
            alloc.status = "ready"
        return self._allocation_view(alloc)

    @activity.defn(name="record_allocation_event")
    async def record_allocation_event(self, req: AllocationEventInput) -> None:
        await self._called("record_allocation_event", None, req.kind, req)

    # ------------------------------------------------------------ the agents

    async def _agent(self, action: AgentAction, req: AgentActionInput) -> AgentActionResult:
        await self._called(f"{action}_node", req.node_id, req=req)
        node = self.nodes[req.node_id]
        return AgentActionResult(
            node_id=req.node_id, action=action, details={"boot_id": node.boot_id, "image_digest": CLEAN_IMAGE}
        )

    @activity.defn(name="inspect_node")
    async def inspect_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._agent(AgentAction.INSPECT, req)

    @activity.defn(name="burn_in_node")
    async def burn_in_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._agent(AgentAction.BURN_IN, req)

    @activity.defn(name="provision_node")
    async def provision_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._agent(AgentAction.PROVISION, req)

    @activity.defn(name="release_node")
    async def release_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._agent(AgentAction.RELEASE, req)

    @activity.defn(name="wipe_node")
    async def wipe_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._agent(AgentAction.WIPE, req)

    @activity.defn(name="reset_node")
    async def reset_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._agent(AgentAction.RESET, req)

    @activity.defn(name="reboot_node")
    async def reboot_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._agent(AgentAction.REBOOT, req)

    @activity.defn(name="reflash_node")
    async def reflash_node(self, req: AgentActionInput) -> AgentActionResult:
        return await self._agent(AgentAction.REFLASH, req)

    @activity.defn(name="agent_batch")
    async def agent_batch(self, req: AgentBatchInput) -> AgentBatchResult:
        result = AgentBatchResult()
        for item in req.items:
            if item.node_id in self.unreachable:
                self.calls.append(Call("agent_batch", item.node_id, f"{req.action} unreachable", item))
                result.unreachable[item.node_id] = f"agent of {item.node_id} did not answer"
                continue
            try:
                await self._called(f"agent_batch:{req.action}", item.node_id, req=item)
            except ApplicationError as exc:
                result.failed[item.node_id] = exc.message
        return result

    # ------------------------------------------------------------ the BMCs

    @activity.defn(name="bmc_discover")
    async def bmc_discover(self, req: NodeRef) -> BmcPowerResult:
        await self._called("bmc_discover", req.node_id, req=req)
        return BmcPowerResult(node_id=req.node_id, done=True, power_state="off")

    @activity.defn(name="bmc_power")
    async def bmc_power(self, req: BmcPowerInput) -> BmcPowerResult:
        await self._called("bmc_power", req.node_id, req.action, req)
        return BmcPowerResult(node_id=req.node_id, done=True, power_state="off" if req.action == "off" else "on")

    @activity.defn(name="bmc_firmware_update")
    async def bmc_firmware_update(self, req: NodeRef) -> BmcPowerResult:
        await self._called("bmc_firmware_update", req.node_id, req=req)
        return BmcPowerResult(node_id=req.node_id, done=True)

    @activity.defn(name="bmc_boot_image")
    async def bmc_boot_image(self, req: NodeRef) -> BmcPowerResult:
        """A node with a BMC boots the clean image (its agent answers from a new boot); one
        without cannot be re-imaged (done false: the in-band wipe alone cleans it)."""
        node = self.nodes[req.node_id]
        await self._called("bmc_boot_image", req.node_id, "done" if node.has_bmc else "no BMC", req)
        if node.has_bmc:
            node.boot_id = f"boot-{int(node.boot_id.split('-')[1]) + 1}"
        return BmcPowerResult(node_id=req.node_id, done=node.has_bmc)

    @activity.defn(name="bmc_check_image")
    async def bmc_check_image(self, req: ImageCheckInput) -> ImageCheckResult:
        node = self.nodes[req.node_id]
        ok = node.image_ok and req.boot_id != req.boot_id_before and req.image_digest == CLEAN_IMAGE
        await self._called("bmc_check_image", req.node_id, "ok" if ok else "mismatch", req)
        answer = "the clean image booted" if ok else "the booted image is not the clean image"
        return ImageCheckResult(node_id=req.node_id, ok=ok, answer=answer)

    @activity.defn(name="bmc_hand_enrollment")
    async def bmc_hand_enrollment(self, req: EnrollmentInput) -> EnrollmentResult:
        node = self.nodes[req.node_id]
        await self._called("bmc_hand_enrollment", req.node_id, "done" if node.config_drive else "no drive", req)
        answer = "enrolled through the config drive" if node.config_drive else "no config drive"
        return EnrollmentResult(node_id=req.node_id, done=node.config_drive, answer=answer)

    # ------------------------------------------------------------ the fabric managers

    @activity.defn(name="apply_allocation_fabric")
    async def apply_allocation_fabric(self, req: FabricApplyInput) -> FabricMembershipResult:
        await self._called("apply_allocation_fabric", None, ",".join(req.joining), req)
        return FabricMembershipResult(allocation_id=req.allocation_id, applied=True)

    @activity.defn(name="remove_allocation_fabric_nodes")
    async def remove_allocation_fabric_nodes(self, req: FabricRemoveInput) -> FabricMembershipResult:
        await self._called("remove_allocation_fabric_nodes", None, ",".join(req.node_ids), req)
        return FabricMembershipResult(allocation_id=req.allocation_id, applied=True)

    @activity.defn(name="release_allocation_fabric")
    async def release_allocation_fabric(self, req: FabricReleaseInput) -> FabricMembershipResult:
        await self._called("release_allocation_fabric", None, req=req)
        return FabricMembershipResult(allocation_id=req.allocation_id, applied=True)

    # ------------------------------------------------------------ the ledger and the reconciler

    @activity.defn(name="record_ledger_events")
    async def record_ledger_events(self, req: LedgerEventsInput) -> LedgerEventsResult:
        # Sends are not awaited where they happen: kept apart from `steps`, whose order they'd race.
        self.ledger.append([f"{e.kind}:{e.node_id}" if e.node_id else e.kind for e in req.events])
        return LedgerEventsResult(recorded=len(req.events))

    @activity.defn(name="start_waiting_bringups")
    async def start_waiting_bringups(self) -> SweepResult:
        await self._called("start_waiting_bringups", None)
        return SweepResult(started=self.waiting_started)


async def _wait_heartbeating(event: asyncio.Event) -> None:
    """Wait for `event`, heartbeating (so a cancel of the workflow reaches the activity)."""
    async with asyncio.timeout(HOLD_LIMIT_S):
        while not event.is_set():
            activity.heartbeat()
            try:
                await asyncio.wait_for(event.wait(), 0.1)
            except TimeoutError:
                continue


async def until(predicate: Callable[[], object], *, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Wait until `predicate()` holds (the stand-ins run on the test's event loop), at most `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:  # the stand-ins change on this loop: look between its steps
                if predicate():
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from None
