"""The platform's evaluation of a version, in the worker: pull it from the tenant's registry
store and verify it (fail closed, as any pull), pull its parent for the sanity evaluator's
comparison, run the evaluator, sign what it found with the platform evaluator key, and keep the
record. Only such records open a `staging` or `production` gate.

What the evaluator reports is the result, whatever it is: NaN weights are a result (their gate
refuses them), and so is a command that crashed, hung or printed garbage (a failed evaluation,
recorded with its reason, which fails that evaluator's gates). An object store that is down
raises, and Temporal retries; bytes that fail verification are recorded as a failed evaluation
and end the activity non-retryable (`VersionUnverifiable`).
"""

from __future__ import annotations

import logging
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.config import RegistrySettings
from gpucloud.db import Database
from gpucloud.models.evaluation_messages import EvaluateVersionInput, EvaluateVersionResult
from gpucloud.models.registry_tables import EvaluationSource
from gpucloud.registry import promotion
from gpucloud.registry.evaluators import EvaluatorOutcome, evaluate_directory
from gpucloud.registry.manifest import (
    BadSignatureError,
    EvaluationRecord,
    IntegrityError,
    Signer,
    UnknownKeyError,
    VersionNotFoundError,
)
from gpucloud.registry.pull import pull
from gpucloud.registry.stores import RegistryStores
from gpucloud.services.evaluations import keep_evaluation
from gpucloud.services.operations import settle

log = logging.getLogger(__name__)


class EvaluationActivities(ActivityGroup):
    def __init__(
        self, db: Database, stores: RegistryStores, signer: Signer, *, work_dir: Path, registry: RegistrySettings
    ) -> None:
        """`registry` says how a model's command runs (its container runtime, or on the host
        where the operator allows it); versions are pulled into `work_dir`."""
        self.db, self.stores, self.signer = db, stores, signer
        self.work_dir, self.registry = work_dir, registry

    def _pull(self, tenant_id: str, digest: str, dest: Path) -> Path:
        with self.db.session() as session:
            keyring = promotion.keyring_for(session, tenant_id)
        pull(
            digest,
            dest,
            chunk_store=self.stores.chunks(tenant_id),
            manifest_store=self.stores.manifests(tenant_id),
            keyring=keyring,
            tenant=tenant_id,
            progress=lambda *_: activity.heartbeat(),
        )
        return dest

    def _keep(self, req: EvaluateVersionInput, outcome: EvaluatorOutcome, compared_with: str | None = None) -> str:
        record = EvaluationRecord(
            version=req.version,
            evaluator=req.evaluator,
            results=outcome.results,
            recorded_at=datetime.now(UTC),
            failure=outcome.failure[:2000] if outcome.failure else None,
            details={**outcome.details, "compared_with": compared_with} if outcome.details else None,
        )
        signed = self.signer.sign_evaluation(record)
        row, _ = keep_evaluation(self.db.url, self.stores, req.tenant_id, signed, source=EvaluationSource.PLATFORM)
        return row.record_digest

    @activity.defn
    def evaluate_version(self, req: EvaluateVersionInput) -> EvaluateVersionResult:
        work = self.work_dir / uuid.uuid4().hex
        try:
            try:
                version = self._pull(req.tenant_id, req.version, work / "version")
            except VersionNotFoundError as exc:
                settle(self.db.url, req.operation_id, error=f"version not found: {exc}")
                raise ApplicationError(str(exc), type="VersionNotFound", non_retryable=True) from exc
            except (IntegrityError, BadSignatureError, UnknownKeyError) as exc:
                failure = f"the version failed verification ({type(exc).__name__}): {exc}"
                self._keep(req, EvaluatorOutcome(req.evaluator, {}, failure=failure))
                settle(self.db.url, req.operation_id, error=failure)
                raise ApplicationError(failure, type="VersionUnverifiable", non_retryable=True) from exc
            parent, compared_with = None, None
            if req.parent is not None and req.evaluator == "sanity":
                try:
                    parent, compared_with = self._pull(req.tenant_id, req.parent, work / "parent"), req.parent
                except (VersionNotFoundError, IntegrityError, BadSignatureError, UnknownKeyError) as exc:
                    # The parent is gone (collected) or no longer verifies: judge the version alone.
                    log.warning("evaluating %s without its parent %s: %s", req.version, req.parent, exc)
            activity.heartbeat()
            outcome = evaluate_directory(
                version,
                parent,
                [req.evaluator],
                req.command,
                runtime=self.registry.evaluation_runtime,
                host_commands=self.registry.evaluation_host_commands,
            )[req.evaluator]
            record_digest = self._keep(req, outcome, compared_with)
            settle(self.db.url, req.operation_id, error=outcome.failure)
            return EvaluateVersionResult(
                evaluator=req.evaluator,
                results=outcome.results,
                failure=outcome.failure,
                record_digest=record_digest,
                compared_with=compared_with,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
