"""Evaluation records: the one way a signed evaluation of a version is kept.

Both kinds land here: results the platform ran and signed with its evaluator key
(`EvaluationSource.PLATFORM`, recorded by the worker's evaluation activity), and results a
tenant reports signed with one of its own keys (`REPORTED`, through the API). The signed record
goes to the tenant's manifest store beside the version's manifest, and a row indexes it; a
record already kept (same digest) is answered with the existing row, so a retried activity or
request records it once.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlmodel import Session, col, select

from gpucloud.db import Database
from gpucloud.models.evaluation_messages import EvaluateVersionInput
from gpucloud.models.registry_names import EvaluatorName
from gpucloud.models.registry_tables import EvaluationResult, EvaluationSource, ModelVersion, RegistryModel
from gpucloud.registry import promotion
from gpucloud.registry.manifest import SignedEvaluation
from gpucloud.registry.stores import RegistryStores

# What a kept evaluation row takes from its record under the same names.
_RECORD_AS_KEPT = {"version", "evaluator", "results", "recorded_at", "details"}


def keep_evaluation(
    db: Database, stores: RegistryStores, tenant_id: str, signed: SignedEvaluation, *, source: EvaluationSource
) -> tuple[EvaluationResult, bool]:
    """Keep a verified, signed record of the tenant's version `signed.record.version`: the row,
    and whether it is new."""
    record = signed.record
    query = select(EvaluationResult).where(
        col(EvaluationResult.tenant_id) == tenant_id, col(EvaluationResult.record_digest) == record.digest
    )
    with db.session() as session:
        if (existing := session.exec(query).first()) is not None:
            return existing, False
    stores.manifests(tenant_id).add_evaluation(signed)  # the signed record, beside the manifest
    row = EvaluationResult(
        tenant_id=tenant_id,
        **record.model_dump(include=_RECORD_AS_KEPT),
        record_digest=record.digest,
        error=record.failure,
        key_id=signed.key_id,
        signature=signed.signature,
        source=source,
    )
    try:
        with db.session() as session:
            session.add(row)
            return row, True
    except sa.exc.IntegrityError:
        with db.session() as session:
            return session.exec(query).one(), False


OPERATION_PREFIX = "version_evaluation_"


def operation_kind(evaluator: EvaluatorName) -> str:
    return f"{OPERATION_PREFIX}{evaluator.value}"


def evaluation_input(
    session: Session, model: RegistryModel, version: ModelVersion, evaluator: EvaluatorName, operation_id: str
) -> EvaluateVersionInput:
    """What the evaluation workflow of a version needs: its lineage parent (when the tenant still
    has it) for the sanity evaluator, and the model's command for the command evaluator."""
    parent = version.parent
    if parent is not None and promotion.version_row(session, version.tenant_id, parent) is None:
        parent = None
    return EvaluateVersionInput(
        tenant_id=version.tenant_id,
        model=model.name,
        version=version.digest,
        parent=parent,
        evaluator=evaluator,
        command=promotion.evaluation_of(model) if evaluator == EvaluatorName.COMMAND else None,
        operation_id=operation_id,
    )


def evaluation_input_for(
    session: Session, tenant_id: str, digest: str, kind: str, operation_id: str
) -> EvaluateVersionInput | None:
    """The workflow input of a running evaluation operation (for adoption); None when its version
    or model is gone."""
    evaluator = EvaluatorName(kind.removeprefix(OPERATION_PREFIX))
    version = promotion.version_row(session, tenant_id, digest)
    model = promotion.model_by_id(session, version.model_id) if version is not None else None
    if version is None or model is None:
        return None
    return evaluation_input(session, model, version, evaluator, operation_id)


def evaluations_of(session: Session, tenant_id: str, digest: str) -> list[EvaluationResult]:
    """A version's evaluation records, oldest first."""
    return list(
        session.exec(
            select(EvaluationResult)
            .where(col(EvaluationResult.tenant_id) == tenant_id, col(EvaluationResult.version) == digest)
            .order_by(col(EvaluationResult.recorded_at), col(EvaluationResult.record_digest))
        )
    )
