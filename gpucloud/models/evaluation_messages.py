"""What the platform evaluation workflow and its activity exchange (Temporal payloads)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gpucloud.models.registry_tables import DIGEST_PATTERN, EvaluationCommand
from gpucloud.registry.names import EvaluatorName


class EvaluateVersionInput(BaseModel):
    """Run one evaluator on one version of a tenant's model; `parent` is the version the sanity
    evaluator compares against (its lineage parent), `command` the model's registered command."""

    model_config = ConfigDict(extra="forbid")

    tenant_id: str
    model: str
    version: str = Field(pattern=DIGEST_PATTERN)
    parent: str | None = Field(default=None, pattern=DIGEST_PATTERN)
    evaluator: EvaluatorName
    command: EvaluationCommand | None = None
    operation_id: str | None = None


class EvaluateVersionResult(BaseModel):
    evaluator: EvaluatorName
    results: dict[str, float]
    failure: str | None = None
    record_digest: str
    compared_with: str | None = Field(default=None, description="the parent the sanity evaluator compared against")
