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

from gpucloud.db import session_scope
from gpucloud.models.registry_tables import EvaluationResult, EvaluationSource
from gpucloud.registry.manifest import SignedEvaluation
from gpucloud.registry.stores import RegistryStores


def keep_evaluation(
    db_url: str, stores: RegistryStores, tenant_id: str, signed: SignedEvaluation, *, source: EvaluationSource
) -> tuple[EvaluationResult, bool]:
    """Keep a verified, signed record of the tenant's version `signed.record.version`: the row,
    and whether it is new."""
    record = signed.record
    query = select(EvaluationResult).where(
        col(EvaluationResult.tenant_id) == tenant_id, col(EvaluationResult.record_digest) == record.digest
    )
    with session_scope(db_url) as session:
        if (existing := session.exec(query).first()) is not None:
            return existing, False
    stores.manifests(tenant_id).add_evaluation(signed)  # the signed record, beside the manifest
    row = EvaluationResult(
        tenant_id=tenant_id,
        version=record.version,
        evaluator=record.evaluator,
        results=record.results,
        recorded_at=record.recorded_at,
        record_digest=record.digest,
        key_id=signed.key_id,
        signature=signed.signature,
        source=source,
        error=record.failure,
        details=record.details,
    )
    try:
        with session_scope(db_url) as session:
            session.add(row)
            return row, True
    except sa.exc.IntegrityError:
        with session_scope(db_url) as session:
            return session.exec(query).one(), False


def evaluations_of(session: Session, tenant_id: str, digest: str) -> list[EvaluationResult]:
    """A version's evaluation records, oldest first."""
    return list(
        session.exec(
            select(EvaluationResult)
            .where(col(EvaluationResult.tenant_id) == tenant_id, col(EvaluationResult.version) == digest)
            .order_by(col(EvaluationResult.recorded_at), col(EvaluationResult.record_digest))
        )
    )
