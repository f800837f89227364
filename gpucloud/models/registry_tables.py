"""Weight-registry tables (SQLModel): models, versions, aliases, gates, evaluations, signing keys.

The chunks and signed manifests live in the registry's stores (`gpucloud.registry.stores`); these
rows are the index the API queries and the state promotion changes. Every row carries the tenant
(directly or through its model), and model names are unique per tenant only: two tenants may both
have a `llama-8b`, and neither learns that the other does.

A version row is written only after its signed manifest was verified and stored and every chunk it
lists was found in the tenant's chunk store, so a listed version is always a complete one.

Families follow `XBase -> XCreate / XPublic -> X(table=True)`, as in `gpucloud.models.tables`.
"""

from __future__ import annotations

import math
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, StringConstraints, field_validator, model_validator
from sqlmodel import Column, Field, SQLModel

from gpucloud.models.images import ImageReference
from gpucloud.models.registry_names import MAX_IDS_PER_QUERY, AliasName, EvaluatorName
from gpucloud.models.tables import OperationPublic, UTCDateTime, new_id, timestamp_field

MODEL_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,99}$"
DIGEST_PATTERN = r"^[0-9a-f]{64}$"


class EvaluationSource(StrEnum):
    """Who signed an evaluation's results: the platform's evaluator key (an evaluation the
    platform ran), or one of the tenant's keys (`reported`: shown, never opens a gate)."""

    PLATFORM = "platform"
    REPORTED = "reported"


# The metrics the sanity evaluator reports (`SanityReport.metrics`): a gate on one of them
# that names no evaluator holds the sanity evaluator's value; any other metric, the command's.
SANITY_METRICS = frozenset(
    {
        "nan_inf_count",
        "nan_count",
        "inf_count",
        "tensor_count",
        "max_rel_norm_change",
        "tensors_over_norm_threshold",
        "shape_changes",
        "dtype_changes",
        "tensors_added",
        "tensors_removed",
        "files_added",
        "files_removed",
    }
)


# ---------------------------------------------------------------- gates (the rules; rows below)


class GateSpec(BaseModel):
    """The gate on one metric: an optional range and an optional maximum regression against
    production (semantics in `gpucloud.registry.promotion.evaluate_gates`)."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(min_length=1, max_length=100)
    min: float | None = None
    max: float | None = None
    max_regression: float | None = Field(default=None, ge=0)
    higher_is_better: bool = True
    evaluator: EvaluatorName | None = Field(
        default=None,
        description="the platform evaluator the metric must come from; unset: `sanity` for the sanity "
        "evaluator's metrics, else `command`",
    )

    @field_validator("min", "max", "max_regression")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @model_validator(mode="after")
    def _meaningful(self) -> GateSpec:
        if self.min is None and self.max is None and self.max_regression is None:
            raise ValueError(f"gate on {self.metric!r} sets none of min, max, max_regression")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"gate on {self.metric!r} has min {self.min} above max {self.max}")
        if self.evaluator is None:
            self.evaluator = EvaluatorName.SANITY if self.metric in SANITY_METRICS else EvaluatorName.COMMAND
        return self

    @property
    def source(self) -> EvaluatorName:
        """The evaluator this gate's metric comes from (always set once validated)."""
        return self.evaluator or EvaluatorName.COMMAND

    def row(self, model_id: str) -> EvaluationGate:
        """The gate as the model's table keeps it (`min` and `max` are its `min_value`, `max_value`)."""
        same = self.model_dump(include=_GATE_ALIKE)
        return EvaluationGate(
            model_id=model_id, min_value=self.min, max_value=self.max, evaluator=self.source.value, **same
        )

    @classmethod
    def of_row(cls, row: EvaluationGate) -> GateSpec:
        same = row.model_dump(include=_GATE_ALIKE)
        return cls(min=row.min_value, max=row.max_value, evaluator=EvaluatorName(row.evaluator), **same)


# What a gate and its row call alike.
_GATE_ALIKE = {"metric", "max_regression", "higher_is_better"}


_NO_NUL = r"^[^\x00]*$"


class EvaluationCommand(BaseModel):
    """A model's own evaluation: a program the platform runs against the pulled, verified
    version (`GPUCLOUD_MODEL_DIR`, also its working directory), under a time limit, which prints
    its metrics as one JSON object on its last line (`gpucloud.registry.command_eval`)."""

    model_config = ConfigDict(extra="forbid")

    # Every string reaches `<runtime> run` after `--` or as the value of `--env`, or exec as
    # it is: none may hold a NUL (exec refuses it), and the program may not start with '-'.
    argv: list[Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=_NO_NUL)]] = Field(
        min_length=1, max_length=64, description="the program and its arguments (the program never starts with '-')"
    )
    image: ImageReference | None = Field(
        default=None,
        description="an OCI image reference to run it in (the version mounted read-only at /model); without "
        "one it runs in the host's environment, where the operator allows it",
    )
    env: dict[
        Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")],
        Annotated[str, StringConstraints(max_length=4096, pattern=_NO_NUL)],
    ] = Field(default_factory=dict, max_length=64)
    timeout_s: float = Field(default=600.0, gt=0, le=6 * 3600)

    @field_validator("argv")
    @classmethod
    def _program_is_no_option(cls, argv: list[str]) -> list[str]:
        if argv[0].startswith("-"):
            raise ValueError(f"the program {argv[0][:100]!r} starts with '-': name a program, not an option")
        return argv


def _unique_metrics(gates: list[GateSpec]) -> list[GateSpec]:
    metrics = [g.metric for g in gates]
    if len(set(metrics)) != len(metrics):
        raise ValueError("each metric may have one gate only")
    return gates


# ---------------------------------------------------------------- models


class RegistryModelBase(SQLModel):
    # sqlmodel's own `regex=` is not enforced under pydantic 2: the pattern goes in as pydantic's.
    name: str = Field(
        schema_extra={"pattern": MODEL_NAME_PATTERN},
        max_length=100,
        description="lowercase letters, digits, '.', '_' and '-'; unique per tenant",
    )
    description: str = Field(default="", max_length=1000)


class RegistryModelCreate(RegistryModelBase):
    gates: list[GateSpec] = []
    evaluation: EvaluationCommand | None = None

    @field_validator("gates")
    @classmethod
    def _gates_unique(cls, gates: list[GateSpec]) -> list[GateSpec]:
        return _unique_metrics(gates)


class GatesUpdate(BaseModel):
    gates: list[GateSpec]

    @field_validator("gates")
    @classmethod
    def _gates_unique(cls, gates: list[GateSpec]) -> list[GateSpec]:
        return _unique_metrics(gates)


class RegistryModel(RegistryModelBase, table=True):
    __tablename__ = "registry_model"
    __table_args__ = (sa.UniqueConstraint("tenant_id", "name", name="uq_registry_model_tenant_name"),)

    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(default_factory=lambda: new_id("mdl"), unique=True, index=True)
    tenant_id: str = Field(index=True)
    created_at: datetime = timestamp_field()
    evaluation: dict[str, Any] | None = Field(
        default=None, sa_column=Column(sa.JSON, nullable=True), description="an `EvaluationCommand`, dumped"
    )


# ---------------------------------------------------------------- versions


class ModelVersionBase(SQLModel):
    digest: str = Field(max_length=64, description="BLAKE3 of the canonical manifest: the version's identity")
    parent: str | None = Field(default=None, max_length=64)
    base_model: str | None = None
    training_run: str | None = None
    dataset_digests: list[str] = Field(default_factory=list, sa_column=Column(sa.JSON, nullable=False))
    total_size: int = Field(sa_type=sa.BigInteger)
    chunk_count: int
    file_count: int
    key_id: str = Field(max_length=64, description="the signing key that signed the manifest")
    created_at: datetime = Field(sa_type=UTCDateTime, description="when the manifest was built (signed)")


class ModelVersionPublic(ModelVersionBase):
    model: str
    registered_at: datetime
    aliases: list[str] = []
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="latest result per metric across the evaluations the platform ran (and signed)",
    )
    reported_metrics: dict[str, float] = Field(
        default_factory=dict,
        description="latest result per metric the tenant reported (signed by its own keys); never opens a gate",
    )


class ModelVersion(ModelVersionBase, table=True):
    __tablename__ = "registry_version"
    __table_args__ = (
        sa.UniqueConstraint("tenant_id", "digest", name="uq_registry_version_tenant_digest"),
        # One version per content and signing key: two pushes of the same files and lineage (built
        # at different times, so of different digests) race to one row. Another key makes another
        # version: weights re-signed after their key was revoked must not answer the old signature.
        # Versions registered before the column have none, and NULLs never collide.
        sa.UniqueConstraint("tenant_id", "content_digest", "key_id", name="uq_registry_version_tenant_content"),
        sa.Index("ix_registry_version_tenant_parent", "tenant_id", "parent"),
    )

    seq: int | None = Field(default=None, primary_key=True)
    tenant_id: str = Field(index=True)
    model_id: str = Field(foreign_key="registry_model.id", index=True)
    content_digest: str | None = Field(
        default=None,
        max_length=64,
        description="the manifest's digest without its creation time (`Manifest.content_digest`)",
    )
    manifest_uri: str = Field(description="where the signed manifest is stored")
    registered_at: datetime = timestamp_field()


class _PerModel(SQLModel):
    """A row that belongs to one model (its alias, its gate)."""

    seq: int | None = Field(default=None, primary_key=True)
    model_id: str = Field(foreign_key="registry_model.id", index=True)


# ---------------------------------------------------------------- aliases


class ModelAliasPublic(SQLModel):
    name: AliasName
    version: str
    moved_at: datetime
    moved_by: str


class ModelAlias(_PerModel, table=True):
    __tablename__ = "registry_alias"
    __table_args__ = (sa.UniqueConstraint("model_id", "name", name="uq_registry_alias_model_name"),)

    name: str = Field(max_length=32)
    version: str = Field(max_length=64)
    moved_at: datetime = timestamp_field()
    moved_by: str


# ---------------------------------------------------------------- evaluation gates and results


class EvaluationGate(_PerModel, table=True):
    """One metric's gate on a model; the rules live in `gpucloud.registry.promotion.GateSpec`."""

    __tablename__ = "registry_gate"
    __table_args__ = (sa.UniqueConstraint("model_id", "metric", name="uq_registry_gate_model_metric"),)

    metric: str = Field(max_length=100)
    min_value: float | None = None
    max_value: float | None = None
    max_regression: float | None = None
    higher_is_better: bool = True
    evaluator: str = Field(default=EvaluatorName.COMMAND, max_length=32)


class EvaluationResultPublic(SQLModel):
    version: str
    evaluator: str
    source: str = Field(description="`platform` (the platform ran it and signed it) or `reported` (the tenant did)")
    results: dict[str, float]
    error: str | None = Field(default=None, description="why a platform evaluation failed (no results then)")
    details: dict[str, Any] | None = Field(default=None, description="what the evaluator names behind its results")
    recorded_at: datetime
    record_digest: str
    key_id: str


class EvaluationResult(SQLModel, table=True):
    """A signed evaluation record as received; the signature is kept so it can be re-checked."""

    __tablename__ = "registry_evaluation"
    __table_args__ = (
        sa.UniqueConstraint("tenant_id", "record_digest", name="uq_registry_evaluation_tenant_record"),
        sa.Index("ix_registry_evaluation_tenant_version", "tenant_id", "version"),
    )

    seq: int | None = Field(default=None, primary_key=True)
    tenant_id: str
    version: str = Field(max_length=64)
    evaluator: str
    results: dict[str, float] = Field(default_factory=dict, sa_column=Column(sa.JSON, nullable=False))
    recorded_at: datetime = Field(sa_type=UTCDateTime)
    record_digest: str = Field(max_length=64)
    key_id: str = Field(max_length=64)
    signature: str = Field(max_length=128)
    source: str = Field(default=EvaluationSource.REPORTED, max_length=16)
    error: str | None = Field(default=None, sa_type=sa.Text)
    details: dict[str, Any] | None = Field(default=None, sa_column=Column(sa.JSON, nullable=True))


class EvaluationRequest(BaseModel):
    """Ask the platform to evaluate a version."""

    model_config = ConfigDict(extra="forbid")

    evaluator: EvaluatorName = EvaluatorName.SANITY


class EvaluationStarted(BaseModel):
    version: str
    evaluator: EvaluatorName
    parent: str | None = Field(description="the version the sanity evaluator compares against, if any")
    operation: OperationPublic


class EvaluationPage(BaseModel):
    items: list[EvaluationResultPublic]


class EvaluatorKey(BaseModel):
    """The key the platform signs its evaluations with (verify a record's signature with it)."""

    public_key: str
    key_id: str


# ---------------------------------------------------------------- signing keys


class SigningKeyCreate(SQLModel):
    public_key: str = Field(
        schema_extra={"pattern": r"^[0-9a-f]{64}$"}, description="raw Ed25519 public key, 64 hex digits"
    )


class SigningKeyRegistration(SigningKeyCreate):
    proof: str = Field(
        schema_extra={"pattern": r"^[0-9a-f]{128}$"},
        description="the key's own Ed25519 signature (hex) of `gpucloud.registry.key-possession.v1\\n"
        "<tenant id>\\n<public key hex>`: proof that the caller holds the private half",
    )


class SigningKeyPublic(SigningKeyCreate):
    key_id: str
    created_at: datetime
    revoked_at: datetime | None


class SigningKey(SigningKeyCreate, table=True):
    """A public key the registry trusts for one tenant's manifests and evaluations."""

    __tablename__ = "registry_signing_key"
    __table_args__ = (sa.UniqueConstraint("tenant_id", "key_id", name="uq_registry_signing_key_tenant_key"),)

    seq: int | None = Field(default=None, primary_key=True)
    tenant_id: str = Field(index=True)
    key_id: str = Field(max_length=64)
    created_at: datetime = timestamp_field()
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class StorageUsage(SQLModel, table=True):
    """Bytes of chunks a tenant's registry store holds: added to as uploads store new chunks,
    measured again by every garbage collection of the tenant (which also drops what it deletes)."""

    __tablename__ = "registry_storage_usage"

    tenant_id: str = Field(primary_key=True, max_length=128)
    bytes: int = Field(default=0, sa_type=sa.BigInteger)
    measured_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class TrackerSwarm(SQLModel, table=True):
    """A rollout's swarm as the tracker registered it (its spec, JSON), so the tracker answers
    for it after a restart; deleted when the rollout ends. Holdings are not kept: nodes
    announce them again."""

    __tablename__ = "tracker_swarm"

    name: str = Field(primary_key=True, max_length=200)
    tenant_id: str | None = Field(default=None, max_length=128)
    spec: str = Field(sa_type=sa.Text)
    created_at: datetime = timestamp_field()


# ---------------------------------------------------------------- API bodies composed from the rows


class ModelPublic(RegistryModelBase):
    id: str
    created_at: datetime
    aliases: list[ModelAliasPublic]
    gates: list[GateSpec]
    evaluation: EvaluationCommand | None = None


class ModelPage(BaseModel):
    items: list[ModelPublic]
    next_page_token: str


class VersionPage(BaseModel):
    items: list[ModelVersionPublic]
    next_page_token: str


class LineageEntry(ModelVersionPublic):
    depth: int = Field(description="1 for a parent or child, 2 for a grandparent or grandchild, ...")


class LineagePage(BaseModel):
    items: list[LineageEntry]


class ChunkQuery(BaseModel):
    chunk_ids: list[Annotated[str, StringConstraints(pattern=DIGEST_PATTERN)]] = Field(max_length=MAX_IDS_PER_QUERY)


class MissingChunks(BaseModel):
    missing: list[str]


class ChunkStored(BaseModel):
    id: str
    size: int
    stored: bool = Field(description="false when the store already had the chunk")


class AliasMove(BaseModel):
    version: str = Field(min_length=1, max_length=64, description="a digest, a unique prefix, or an alias")


class SigningKeyList(BaseModel):
    tenant_id: str
    items: list[SigningKeyPublic]
