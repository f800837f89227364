"""What tenants ask of their models' versions through the API: push a signed manifest (once per
content and key), report evaluations, have the platform evaluate one, move aliases (gated).
Refusals are domain errors (`services/errors.py`)."""

from __future__ import annotations

import sqlalchemy as sa
from pydantic import BaseModel
from sqlmodel import Session, col, select

from gpucloud.config import Settings
from gpucloud.db import Database
from gpucloud.models.evaluation_messages import EvaluateVersionInput
from gpucloud.models.registry_names import GATED_ALIASES, AliasName, EvaluatorName, RefKind, ref_kind
from gpucloud.models.registry_tables import (
    EvaluationResult,
    EvaluationSource,
    ModelAlias,
    ModelAliasPublic,
    ModelVersion,
    ModelVersionPublic,
    RegistryModel,
)
from gpucloud.models.tables import Operation, utcnow
from gpucloud.models.workflow_ids import evaluation_workflow_id
from gpucloud.registry import gc, promotion
from gpucloud.registry.manifest import (
    BadSignatureError,
    IntegrityError,
    SignedEvaluation,
    SignedManifest,
    UnknownKeyError,
)
from gpucloud.registry.stores import RegistryStores
from gpucloud.services.errors import Conflict, Invalid, NotFound
from gpucloud.services.evaluations import evaluation_input, keep_evaluation, operation_kind
from gpucloud.services.registry_models import model_row

# An ambiguous digest prefix names at most this many of the versions it matches.
_CANDIDATES_NAMED = 5


def resolve_version(session: Session, model: RegistryModel, ref: str, *, field: str = "version") -> ModelVersion:
    """The version REF names (`names.ref_kind`): NotFound where none does, Invalid where the ref is not one
    or a digest prefix matches several versions (naming them, so the caller can pick)."""
    query = select(ModelVersion).where(col(ModelVersion.model_id) == model.id)
    try:
        kind = ref_kind(ref)
    except ValueError as exc:
        raise Invalid(field, str(exc)) from None
    if kind == RefKind.ALIAS:
        alias = session.exec(
            select(ModelAlias).where(col(ModelAlias.model_id) == model.id, col(ModelAlias.name) == ref)
        ).first()
        if alias is None:
            raise NotFound("alias", f"{model.name}@{ref}")
        query = query.where(col(ModelVersion.digest) == alias.version)
    elif kind == RefKind.DIGEST:
        query = query.where(col(ModelVersion.digest) == ref)
    else:
        query = query.where(col(ModelVersion.digest).startswith(ref))
    rows = session.exec(query.order_by(col(ModelVersion.digest)).limit(_CANDIDATES_NAMED + 1)).all()
    if len(rows) > 1:
        named = ", ".join(r.digest for r in rows[:_CANDIDATES_NAMED]) + (
            ", ..." if len(rows) > _CANDIDATES_NAMED else ""
        )
        raise Invalid(
            field,
            f"prefix {ref!r} matches several versions of {model.name} ({named}); give more digits",
            "ambiguous-version",
        )
    if not rows:
        raise NotFound("version", f"{model.name}@{ref}")
    return rows[0]


def signature_invalid(exc: IntegrityError) -> Invalid:
    if isinstance(exc, UnknownKeyError):
        return Invalid(
            "key_id", f"{exc}; register the public key with POST /v1/signing-keys first", "unknown-signing-key"
        )
    return Invalid(
        "signature", f"{exc}: the signed content was changed after signing, or another key signed it", "bad-signature"
    )


def register_version(
    db: Database, settings: Settings, stores: RegistryStores, tenant_id: str, name: str, signed: SignedManifest
) -> tuple[ModelVersionPublic, bool]:
    manifest, digest = signed.manifest, signed.digest
    with db.session() as session:
        model = model_row(session, tenant_id, name)
        if manifest.model != name:
            raise Invalid("manifest.model", f"the manifest is for model {manifest.model!r}, posted to {name!r}")
        limits = settings.registry
        if problem := manifest.size_problem(
            max_bytes=limits.max_version_bytes,
            max_amplification=limits.max_version_amplification,
            amplification_floor=limits.version_amplification_floor,
        ):
            raise Invalid("manifest.total_size", problem, "version-too-large")
        if (existing := promotion.version_row(session, tenant_id, digest)) is not None:
            return promotion.publish_versions(session, tenant_id, [existing])[0], False
        try:
            promotion.keyring_for(session, tenant_id).verify(signed, tenant=tenant_id)
        except (UnknownKeyError, BadSignatureError) as exc:
            raise signature_invalid(exc) from None
        if (
            same := promotion.version_with_content(session, tenant_id, manifest.content_digest, signed.key_id)
        ) is not None:
            return promotion.publish_versions(session, tenant_id, [same])[0], False
        parent = manifest.lineage.parent
        if parent is not None and promotion.version_row(session, tenant_id, parent) is None:
            raise Invalid("manifest.lineage.parent", f"no version {parent} visible to this caller")
        model_id = model.id
    # Outside the transaction: checking thousands of chunks must not hold the database. The hold
    # keeps a concurrent garbage collection from deleting a chunk between the check and the put.
    ordered = [chunk.id for entry in manifest.files.values() for chunk in entry.chunks]
    with gc.holding(stores.manifests(tenant_id), ordered, model=name):
        missing = promotion.missing_chunks(stores.chunks(tenant_id), ordered)
        if missing:
            raise Conflict(
                f"{len(missing)} of the version's {len(set(ordered))} chunks are not in the store; "
                "upload them and post the manifest again",
                type_="chunks-missing",
                title="Chunks missing",
                missing=missing[:1000],
                missing_count=len(missing),
            )
        stores.manifests(tenant_id).put(signed)
    row = ModelVersion(
        digest=digest,
        tenant_id=tenant_id,
        model_id=model_id,
        **manifest.lineage.model_dump(),  # parent, base model, training run, datasets
        total_size=manifest.total_size,
        chunk_count=manifest.chunk_count,
        file_count=len(manifest.files),
        key_id=signed.key_id,
        created_at=manifest.created_at,
        manifest_uri=stores.manifest_uri(tenant_id, digest),
        content_digest=manifest.content_digest,
    )
    try:
        with db.session() as session:
            session.add(row)
            session.flush()
            return promotion.publish_versions(session, tenant_id, [row])[0], True
    except sa.exc.IntegrityError:  # the same version, or the same content, posted concurrently
        with db.session() as session:
            existing = promotion.version_row(session, tenant_id, digest) or promotion.version_with_content(
                session, tenant_id, manifest.content_digest, signed.key_id
            )
            assert existing is not None  # the insert that won the race committed it
            if existing.digest != digest:
                # Our manifest is stored under a digest no version has: the winner's stands for it.
                stores.manifests(tenant_id).delete(digest)
            return promotion.publish_versions(session, tenant_id, [existing])[0], False


def record_evaluation(
    db: Database, stores: RegistryStores, tenant_id: str, name: str, ref: str, signed: SignedEvaluation
) -> tuple[EvaluationResult, bool]:
    record = signed.record
    with db.session() as session:
        digest = resolve_version(session, model_row(session, tenant_id, name), ref).digest
        if record.version != digest:
            raise Invalid("record.version", f"the record is about version {record.version}, posted for {digest}")
        try:
            promotion.keyring_for(session, tenant_id).verify_evaluation(signed, tenant=tenant_id)
        except (UnknownKeyError, BadSignatureError) as exc:
            raise signature_invalid(exc) from None
    return keep_evaluation(db, stores, tenant_id, signed, source=EvaluationSource.REPORTED)


def evaluation_operation(
    db: Database, tenant_id: str, name: str, ref: str, evaluator: EvaluatorName, actor: str
) -> tuple[EvaluateVersionInput, Operation]:
    with db.session() as session:
        model = model_row(session, tenant_id, name)
        version = resolve_version(session, model, ref)
        if evaluator == EvaluatorName.COMMAND and promotion.evaluation_of(model) is None:
            raise Conflict(
                f"model {name!r} has no evaluation command; register one with PUT /v1/models/{name}/evaluation",
                type_="no-evaluation-command",
                title="No evaluation command",
            )
        op = Operation(kind=operation_kind(evaluator), resource_id=version.digest, tenant_id=tenant_id, actor=actor)
        op.workflow_id = evaluation_workflow_id(tenant_id, op.id)
        session.add(op)
        session.flush()
        session.refresh(op)
        return evaluation_input(session, model, version, evaluator, op.id), op


def _key_refusal(version: ModelVersion, active_keys: set[str]) -> Conflict | None:
    if version.key_id in active_keys:
        return None
    return Conflict(
        f"version {version.digest} was signed by key {version.key_id}, which is no longer trusted",
        type_="signing-key-revoked",
        title="Signing key revoked",
    )


def _gates_refusal(
    model: RegistryModel, alias: AliasName, version: ModelVersion, failures: list[promotion.GateFailure]
) -> Conflict | None:
    if not failures:
        return None
    evaluators = " or ".join(sorted({f.evaluator for f in failures}))
    return Conflict(
        f"{model.name}@{alias.value} cannot move to {version.digest[:12]}: "
        + "; ".join(f.describe() for f in failures)
        + f". Have the platform evaluate it ({evaluators}: POST /v1/models/{model.name}/versions/"
        f"{version.digest}/evaluate, or `gpucloud weights evaluate {model.name} {version.digest[:12]} "
        "--evaluator ...`), or push a version that fixes what fails",
        type_="gates-failed",
        title="Evaluation gates failed",
        failing_metrics=[f.model_dump() for f in failures],
    )


def _check_gates(
    session: Session,
    tenant_id: str,
    model: RegistryModel,
    alias: AliasName,
    version: ModelVersion,
    *,
    require_sanity: bool,
) -> None:
    if (revoked := _key_refusal(version, promotion.active_key_ids(session, tenant_id))) is not None:
        raise revoked
    failures = promotion.promotion_failures(
        session, tenant_id, model.id, version.digest, alias=alias, require_sanity=require_sanity
    )
    if (failed := _gates_refusal(model, alias, version, failures)) is not None:
        raise failed


class PromotionVerdict(BaseModel):
    """What a move of a gated alias to a version would meet: the gates it fails (empty: none),
    and the refusal `move_alias` would answer, in its words (None: the move would happen)."""

    alias: AliasName
    failures: list[promotion.GateFailure]
    refusal: str | None


def promotion_verdicts(
    session: Session, tenant_id: str, model: RegistryModel, versions: list[ModelVersion], *, require_sanity: bool
) -> dict[str, list[PromotionVerdict]]:
    """Each version's verdict for each gated alias, as `move_alias` would judge it now (read
    once for the whole list: the console's model page shows one per version)."""
    aliases = [a for a in AliasName if a in GATED_ALIASES]  # in the order a version climbs
    active = promotion.active_key_ids(session, tenant_id)
    found = promotion.promotion_failures_of(
        session, tenant_id, model.id, [v.digest for v in versions], aliases=aliases, require_sanity=require_sanity
    )
    verdicts: dict[str, list[PromotionVerdict]] = {}
    for version in versions:
        verdicts[version.digest] = []
        for alias in aliases:
            failures = found[version.digest][alias]
            refusal = _key_refusal(version, active) or _gates_refusal(model, alias, version, failures)
            verdicts[version.digest].append(
                PromotionVerdict(alias=alias, failures=failures, refusal=refusal.detail if refusal else None)
            )
    return verdicts


def move_alias(
    db: Database, tenant_id: str, name: str, alias: AliasName, ref: str, *, moved_by: str, require_sanity: bool
) -> ModelAliasPublic:
    """Point an alias at a version; `staging` and `production` move only when the model's gates
    and the platform's pass."""
    with db.session() as session:
        # The model row lock serialises moves of one model's aliases (a no-op on SQLite, which
        # already holds the write lock), so two promotions cannot both pass against a stale production.
        model = model_row(session, tenant_id, name, for_update=True)
        version = resolve_version(session, model, ref)
        if alias in GATED_ALIASES:
            _check_gates(session, tenant_id, model, alias, version, require_sanity=require_sanity)
        row = session.exec(
            select(ModelAlias).where(col(ModelAlias.model_id) == model.id, col(ModelAlias.name) == alias)
        ).first()
        row = row or ModelAlias(model_id=model.id, name=alias, version=version.digest, moved_by=moved_by)
        row.version, row.moved_at, row.moved_by = version.digest, utcnow(), moved_by
        session.add(row)
        return ModelAliasPublic(name=alias, version=row.version, moved_at=row.moved_at, moved_by=row.moved_by)
