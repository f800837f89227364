"""Inputs and results of workflows, activities, signals and updates: one pydantic model each.

Workflow code imports these, so this module imports nothing heavier than pydantic: fields can be
added later (with defaults) without breaking callers or recorded histories.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field

from gpucloud.protocol.actions import AgentAction, Workload


class NodeRef(BaseModel):
    """A message about one node."""

    node_id: str


class AllocationRef(BaseModel):
    """A message about one allocation."""

    allocation_id: str


class NodeOperationKind(StrEnum):
    BRINGUP = "bringup"  # enrolled -> inspecting -> wiping -> burn_in -> available
    PROVISION = "provision"  # reserved -> provisioning -> active
    RELEASE = "release"  # active -> releasing -> wiping (the agent confirms the tenant is off)
    RECYCLE = "recycle"  # wiping -> burn_in -> available
    DRAIN = "drain"  # available | active -> draining -> quarantined (the agent stops the workload)
    RESTORE = "restore"  # active, but the agent lost the workload (reboot, wipe): provision again
    REPAIR = "repair"  # quarantined -> repairing (reset | reboot | reflash) -> wiping -> burn_in -> available; or rma
    # available, leased by `services.diagnostics` -> the agent's diagnose -> findings judged -> available
    # (or drained, when they call for it); the state does not change on its own
    DIAGNOSE = "diagnose"


class NodeOperationInput(NodeRef):
    operation: NodeOperationKind
    allocation_id: str | None = None
    tenant_id: str | None = None
    # What a provision (or a restore) starts on the node: the allocation's workload.
    workload: Workload | None = None
    # The diagnostic lease a diagnose holds the node under (`services.diagnostics`).
    lease: str | None = None


class DiagnosisInput(NodeRef):
    """A diagnose's end, to record: the agent's answer (None: it gave none, `failure` says why)."""

    lease: str
    answer: dict | None = None
    failure: str | None = None


class NodeOperationResult(NodeRef):
    ok: bool
    state: str
    error: str | None = None


class NodeTransitionInput(NodeRef):
    event: str
    from_state: str
    # Identifies this step of this workflow: a retried activity whose first try committed finds
    # its own transition already recorded and succeeds instead of failing the CAS.
    op_id: str
    cause: str = ""
    actor: str = "system"
    # Set when a tenant's data may land on the node (entering provisioning).
    tenant_id: str | None = None


class NodeTransitionResult(NodeRef):
    state: str
    generation: int


class NodeView(NodeRef):
    state: str
    generation: int
    agent_url: str
    allocation_id: str | None = None
    tenant_id: str | None = None
    has_bmc: bool = False
    agent_reachable: bool = True


class BmcPowerInput(NodeRef):
    """Bring a node's power to `action` through its BMC (`activities/bmc.py`)."""

    action: Literal["on", "off", "cycle"]
    cause: str = ""
    actor: str = "system"
    # After a cycle or an on: wait until the node's agent heartbeats again (its host booted).
    wait_for_agent: bool = False
    # The operator's operation to finish with the outcome (`POST /v1/nodes/{id}/power`).
    operation_id: str | None = None


class BmcPowerResult(NodeRef):
    # False: the node has no BMC, nothing was done (the caller falls back to the agent).
    done: bool
    power_state: str | None = None
    answer: str = ""


class ImageCheckInput(NodeRef):
    """What the agent that answered after a re-image's power cycle reported (`bmc_check_image`)."""

    boot_id_before: str | None
    boot_id: str | None
    image_digest: str | None
    actor: str = "system"


class ImageCheckResult(NodeRef):
    ok: bool
    answer: str


class EnrollmentInput(NodeRef):
    """A checked re-image's step (`bmc_hand_enrollment`): the token is derived from it."""

    request_id: str
    actor: str = "system"


class EnrollmentResult(NodeRef):
    done: bool  # False: no config drive (the wipe hands the credential in band, weaker)
    answer: str


class AgentActionInput(NodeRef):
    agent_url: str
    request_id: str
    tenant_id: str | None = None
    # A provision's allocation: the agent meters the node's usage against it.
    allocation_id: str | None = None
    # What a provision starts: the allocation's workload, in a process tree the agent owns.
    workload: Workload | None = None
    # A wipe hands the agent the node's next credential, unless a re-image's config drive did.
    hand_credential: bool = True


class AgentActionResult(NodeRef):
    action: AgentAction
    details: dict = Field(default_factory=dict)


class NodeRefs(BaseModel):
    node_ids: list[str]


class NodeViews(BaseModel):
    nodes: list[NodeView]


class NodeTransitionBatch(BaseModel):
    items: list[NodeTransitionInput]
    # Keep the reconciler off nodes left in a transient state until that state's deadline (a
    # bring-up batch holds them; at the deadline the reconciler takes over).
    lease_to_deadline: bool = False


class NodeTransitionOutcome(NodeRef):
    # The node's state after the step; None when the step did not apply (error says why).
    state: str | None = None
    error: str | None = None


class NodeTransitionBatchResult(BaseModel):
    outcomes: list[NodeTransitionOutcome]


class AgentBatchInput(BaseModel):
    action: AgentAction
    items: list[AgentActionInput]


class AgentBatchResult(BaseModel):
    # Nodes whose agent refused the action for good: node id -> reason (the node fails).
    failed: dict[str, str] = Field(default_factory=dict)
    # Nodes whose agent stayed unreachable through the activity's own retries: node id -> reason.
    # They are left where they are, for the reconciler's per-node backoff.
    unreachable: dict[str, str] = Field(default_factory=dict)


class BringupInput(BaseModel):
    node_ids: list[str]


class BringupResult(BaseModel):
    available: list[str] = Field(default_factory=list)
    # Node id -> why it stopped short of available (failed into its failure target, moved by
    # someone else, agent unreachable and left for the reconciler).
    stopped: dict[str, str] = Field(default_factory=dict)
    # Enrolled nodes whose bring-up this batch started as it finished, in its room.
    handed_on: int = 0


class AllocationInput(AllocationRef):
    # Nodes that fail provisioning are replaced by others, this many in all; past that the
    # allocation fails (a fault that follows every node is not fixed by trying more of them).
    provision_retries: int = 3
    replacement_recheck_s: float = 30.0
    # Queued: how often its workflow reads its row again (and makes sure the pool's scheduler runs).
    queue_recheck_s: float = 60.0
    # A run continued as new while queued: the pool's scheduler was told of it already.
    queued_before: bool = False


class AllocationResult(AllocationRef):
    status: str
    failure_reason: str | None = None


class AllocationView(AllocationRef):
    tenant_id: str
    status: str
    desired: str
    node_ids: list[str]
    workload: Workload | None = None
    # Its price class (`on_demand`, `preemptible`, `reserved`), told to the ledger at its start.
    tier: str = "on_demand"
    # Its pool (a queued allocation's workflow makes sure the pool's scheduler runs).
    gpu_type: str = ""
    region: str = ""


class PoolRef(BaseModel):
    """A pool: the nodes of one GPU type in one region (one queue, one scheduler workflow)."""

    gpu_type: str
    region: str


class PoolSchedulerInput(PoolRef):
    poll_s: float = 5.0


class EnsureSchedulerInput(PoolRef):
    """A queued allocation's pool: its scheduler made sure to run, and asked to plan now
    (`plan_now`: the request is new to the queue) or left to its own round (a recheck)."""

    plan_now: bool = True


class PreemptRequest(AllocationRef):
    """A preemptible allocation is taken back: stop its workload at `stop_at` (the notice's end)."""

    reason: str
    stop_at: datetime


class PoolPlanResult(BaseModel):
    """What one plan of a pool did (`services/scheduling.py`): the allocations it placed and
    expired, the preemptible ones whose workflows must be told they are taken back, and how many
    still wait."""

    placed: list[str] = []
    expired: list[str] = []
    preempted: list[PreemptRequest] = []
    queued: int = 0
    reservations: int = 0  # open (accepted or active): the scheduler keeps planning while any is
    unbilled: int = 0  # reservations whose window began that the ledger has not recorded yet
    # Nothing queued and every open reservation's hold still ahead: no plan changes anything for
    # this long (the scheduler sleeps until then, a poke waking it sooner).
    quiet_s: float = 0.0


class AllocationStatusInput(AllocationRef):
    status: str
    failure_reason: str | None = None


class ReplaceNodeRequest(NodeRef):
    """A node of the allocation is unhealthy: pull it and give the tenant another."""

    reason: str
    # The fault is already fatal to the job: pull now, no checkpoint grace.
    immediate: bool = False
    grace_s: float = 300.0
    recheck_s: float = 30.0
    # When the fault was seen (the agent's report), for the fault-to-pulled latency.
    fault_at: datetime | None = None


class DetachNodeInput(AllocationRef):
    node_id: str
    reason: str
    fault_at: datetime | None = None


class DetachNodesInput(AllocationRef):
    nodes: list[DetachNodeInput]


class DetachNodesResult(BaseModel):
    pulled: list[str]
    allocation: AllocationView


class ReplacementInput(AllocationRef):
    # Nodes not to take (those that already failed provisioning for this allocation).
    exclude: list[str] = []


class ReplacementResult(BaseModel):
    node_id: str | None = None
    reason: str = ""


class AttachNodeInput(AllocationRef):
    node_id: str
    replaces: str
    ready: bool = True


class AllocationEventInput(AllocationRef):
    kind: str
    reason: str
    node_id: str | None = None


class RepairPlan(NodeRef):
    # The ladder's actions to try in order (the first that succeeds wins); empty: RMA.
    actions: list[AgentAction] = Field(default_factory=list)
    reason: str = ""


class CancelRequest(BaseModel):
    operation_id: str | None = None


class AllocationProgress(AllocationRef):
    phase: str
    nodes_total: int = 0
    nodes_done: int = 0
    cancel_requested: bool = False


class SweepInput(BaseModel):
    # None: the whole fleet (the periodic sweep); else just these nodes (an event).
    node_ids: list[str] | None = None


class SweepResult(BaseModel):
    candidates: int = 0
    deadlines_applied: int = 0
    marked_unreachable: int = 0
    marked_reachable: int = 0
    started: int = 0
    already_running: int = 0
    deferred_by_limit: int = 0
    # Bring-up batches started (each counted in `started` by its nodes).
    bringup_batches: int = 0
    # Replace requests (re)sent to allocation workflows for bad nodes they still hold.
    replace_signals: int = 0
    # In-flight allocations and tenant operations whose lost workflow was started again.
    adopted: int = 0
    # So much of the fleet is silent that the control plane is suspect: power actions held.
    power_held: bool = False
    # Idempotency records past their retention, deleted.
    idempotency_expired: int = 0
    # Idle nodes leased for a scheduled diagnostic and their diagnose started.
    diagnostics_started: int = 0
    # Fleet-kind incidents whose workflow nobody followed, started (`services.fleet_kind_incidents`).
    incidents_started: int = 0
    errors: list[str] = Field(default_factory=list)
