"""The staged rollout's messages (workflow input and result, activity inputs and results, the
updates and the progress query) and `plan_waves`, the pure rule that cuts a fleet into waves.

One input model and one result model per workflow, activity and update (STYLE.md): fields can be
added later without breaking callers or recorded histories.
"""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpucloud.models.registry_names import HEX_DIGEST, EvaluatorName
from gpucloud.models.registry_tables import EvaluationCommand, GateSpec


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutPhase(StrEnum):
    RESOLVING = "resolving"
    PREFETCHING = "prefetching"
    VERIFYING = "verifying"
    ACTIVATING = "activating"
    BAKING = "baking"
    CHECKING = "checking"
    PAUSED = "paused"
    ROLLING_BACK = "rolling_back"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


FINISHED = frozenset({RolloutPhase.SUCCEEDED, RolloutPhase.ROLLED_BACK, RolloutPhase.FAILED})


class WaveSpec(_Message):
    """How far one wave takes the rollout, counted over the whole target: `nodes` in all, or a
    `fraction` of them (rounded up, so 10% of 8 nodes is 1). Waves are cumulative."""

    nodes: int | None = Field(default=None, ge=1)
    fraction: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _one_of(self) -> WaveSpec:
        if (self.nodes is None) == (self.fraction is None):
            raise ValueError("a wave gives either nodes or fraction")
        return self

    def reach(self, total: int) -> int:
        if self.nodes is not None:
            return min(self.nodes, total)
        assert self.fraction is not None  # the validator requires one of the two
        return min(total, max(1, math.ceil(self.fraction * total - 1e-9)))


DEFAULT_WAVES = [WaveSpec(nodes=1), WaveSpec(fraction=0.1), WaveSpec(fraction=0.5), WaveSpec(fraction=1.0)]


def plan_waves(nodes: list[str], waves: list[WaveSpec]) -> list[list[str]]:
    """The nodes each wave adds, in target order; waves that add nobody are dropped, and the last
    wave always reaches every node (a rollout never silently stops short of its target)."""
    planned, done = [], 0
    for spec in waves:
        reach = spec.reach(len(nodes))
        if reach > done:
            planned.append(nodes[done:reach])
            done = reach
    if done < len(nodes):
        planned.append(nodes[done:])
    return planned


class RolloutTarget(_Message):
    """One node of the rollout: its id, the URL its agent serves the weights API on, its rack,
    and the tenant's allocation it was in when the rollout resolved it (every step checks it
    still is; None: any of the tenant's allocations)."""

    node_id: str = Field(min_length=1, max_length=128)
    agent_url: str = Field(min_length=1)
    rack: str = "rack-0"
    site: str = "site-1"
    allocation_id: str | None = None


class Thresholds(_Message):
    """What a wave must show after its bake: every node healthy, and every node's evaluation
    probe scoring at least `min_eval_score`."""

    min_eval_score: float = 0.0
    require_healthy: bool = True


class RolloutEvaluation(_Message):
    """The model's evaluations a rollout's bake runs on its canary nodes (the first wave), and
    the gates that judge what they find: a gate that fails there rolls the rollout back. Set
    by the API from the version's model, never by the caller."""

    gates: list[GateSpec] = Field(min_length=1)
    command: EvaluationCommand | None = None

    @property
    def evaluators(self) -> list[EvaluatorName]:
        return sorted({gate.source for gate in self.gates})


class RolloutInput(_Message):
    rollout_id: str
    tenant_id: str
    model_version: str = Field(pattern=HEX_DIGEST, description="the manifest digest to roll out")
    # Exactly one of these names the target; the last two are resolved by an activity.
    nodes: list[RolloutTarget] | None = None
    allocation_id: str | None = None
    serving_fleet: bool = False
    waves: list[WaveSpec] = Field(default_factory=lambda: list(DEFAULT_WAVES), min_length=1)
    bake_s: float = Field(default=300.0, ge=0)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    prefetch_ahead: bool = True
    evaluation: RolloutEvaluation | None = None

    @model_validator(mode="after")
    def _one_target(self) -> RolloutInput:
        given = (self.nodes is not None) + (self.allocation_id is not None) + self.serving_fleet
        if given != 1:
            raise ValueError("name the target once: nodes, allocation_id or serving_fleet")
        if self.nodes is not None:
            if not self.nodes:
                raise ValueError("nodes must not be empty")
            ids = [n.node_id for n in self.nodes]
            if len(set(ids)) != len(ids):
                raise ValueError("nodes lists a node twice")
        return self


class ResolveTargetsInput(_Message):
    tenant_id: str
    allocation_id: str | None = None


class ResolvedTargets(_Message):
    nodes: list[RolloutTarget]


class PrepareInput(_Message):
    rollout_id: str
    tenant_id: str
    model_version: str
    nodes: list[RolloutTarget]


class Prepared(_Message):
    swarm: str
    chunks: int
    total_bytes: int


class WaveInput(_Message):
    """One step (prefetch, verify, activate, check, rollback) on some nodes of a rollout."""

    rollout_id: str
    tenant_id: str
    model_version: str
    swarm: str = ""
    nodes: list[RolloutTarget]
    thresholds: Thresholds = Field(default_factory=Thresholds)
    evaluation: RolloutEvaluation | None = Field(
        default=None, description="on a check of the canary: the model's evaluations to run, and their gates"
    )


class NodeOutcome(_Message):
    node_id: str
    ok: bool
    detail: str = ""
    active: str | None = None
    previous: str | None = None
    eval_score: float | None = None
    healthy: bool | None = None
    evaluations: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="what the model's evaluators found on the node, by evaluator"
    )


class WaveResult(_Message):
    outcomes: list[NodeOutcome]
    dropped: dict[str, str] = Field(
        default_factory=dict,
        description="nodes the step found no longer in the tenant's allocation, and why: sent nothing",
    )

    @property
    def failed(self) -> list[NodeOutcome]:
        return [o for o in self.outcomes if not o.ok]


class ReasonInput(_Message):
    reason: str = Field(default="", max_length=500)


class RolloutProgress(_Message):
    rollout_id: str
    tenant_id: str
    model_version: str
    phase: RolloutPhase
    paused: bool = False
    wave: int = 0  # 1-based index of the wave under way (0 before the first)
    waves: list[list[str]] = []
    activated: list[str] = []
    rolled_back: list[str] = []
    prefetched: list[str] = []
    reason: str = ""
    outcomes: dict[str, NodeOutcome] = {}
    dropped: dict[str, str] = Field(
        default={}, description="nodes that left the tenant's allocation mid-rollout, and why; sent nothing since"
    )

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED


class RolloutResult(_Message):
    rollout_id: str
    status: RolloutPhase
    reason: str = ""
    activated: list[str] = []
    rolled_back: list[str] = []
