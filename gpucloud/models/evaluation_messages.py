"""What the platform evaluation workflow and its activities exchange (Temporal payloads)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpucloud.models.registry_names import EvaluatorName
from gpucloud.models.registry_tables import DIGEST_PATTERN, EvaluationCommand


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


class RegistryAccess(BaseModel):
    """How the evaluation worker reads the version: the API's URL and a short-lived token the
    control plane's worker signed for this tenant's model and these versions only (the one
    evaluated and its parent: `web/service_tokens.REGISTRY_READ_AUDIENCE`)."""

    api_url: str
    token: str


class EvaluationKeys(BaseModel):
    """The public keys the tenant trusts to sign its versions (hex Ed25519), as the control
    plane holds them when the evaluation starts, and the access to read them: the evaluation
    worker pulls the version through the API and verifies it against these keys, with no
    database and no store credentials of its own."""

    public_keys: list[str]
    access: RegistryAccess


class RunEvaluationInput(BaseModel):
    request: EvaluateVersionInput
    keys: EvaluationKeys


class EvaluationRefusal(StrEnum):
    """Why the evaluation worker ran no evaluator: each ends the evaluation, never retried."""

    VERSION_NOT_FOUND = "VersionNotFound"
    VERSION_UNVERIFIABLE = "VersionUnverifiable"
    OVER_DISK_BUDGET = "EvaluationOverDiskBudget"
    ACCESS_REFUSED = "EvaluationAccessRefused"  # the API refused the evaluation's token (expired)


class EvaluationRun(BaseModel):
    """What the evaluation worker found, unsigned: the evaluator's results (or why it produced
    none), or why it ran none (`refusal`, with `failure` saying why)."""

    results: dict[str, float] = Field(default_factory=dict)
    failure: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    compared_with: str | None = None
    refusal: EvaluationRefusal | None = None


class RecordEvaluationInput(BaseModel):
    request: EvaluateVersionInput
    run: EvaluationRun


class EvaluateVersionResult(BaseModel):
    evaluator: EvaluatorName
    results: dict[str, float]
    failure: str | None = None
    record_digest: str
    compared_with: str | None = Field(default=None, description="the parent the sanity evaluator compared against")
