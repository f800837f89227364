"""The platform's evaluation of a version, in two workers, so that code a tenant wrote never
runs in a process that holds a platform secret:

- `EvaluationRunner` (`activities/evaluation_runner.py`), on the evaluation worker (its own
  process and task queue, see `workers/evaluation.py`), holds no database, no object store credentials, no
  issuer key, no operator token and no evaluator key: given the tenant's public keys and a
  short-lived token that reads only this version and its parent (`RegistryAccess`), it reads
  them through the API and verifies them (fail closed, as any pull: `client.registry`), checks
  that they fit the evaluation disk budget before a byte is assembled, pulls them, runs the
  evaluator, and returns what it found, unsigned;
- `EvaluationActivities`, on the control plane's worker, hands it the keys and mints that token
  with the issuer key (`web/service_tokens.REGISTRY_READ_AUDIENCE`), then signs what it found
  with the platform evaluator key, keeps the record, and settles the tenant's operation. Only
  such records open a `staging` or `production` gate.

What the evaluator reports is the result, whatever it is: NaN weights are a result (their gate
refuses them), and so is a command that crashed, hung or printed garbage (a failed evaluation,
recorded with its reason, which fails that evaluator's gates). An API or store that is down
raises, and Temporal retries; bytes that fail verification are recorded as a failed evaluation
and end the evaluation non-retryable (`VersionUnverifiable`); a version too large for the disk
budget ends it non-retryable too (`EvaluationOverDiskBudget`), and so does a token the API
refuses (a retry after it expired: `EvaluationAccessRefused`), with no record: its weights were
never judged.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.db import Database
from gpucloud.models.evaluation_messages import (
    EvaluateVersionInput,
    EvaluateVersionResult,
    EvaluationKeys,
    EvaluationRefusal,
    EvaluationRun,
    RecordEvaluationInput,
    RegistryAccess,
)
from gpucloud.models.registry_tables import EvaluationSource
from gpucloud.registry.command_eval import bounded
from gpucloud.registry.manifest import EvaluationRecord, Signer
from gpucloud.registry.promotion import active_public_keys
from gpucloud.registry.stores import RegistryStores
from gpucloud.services.evaluations import keep_evaluation
from gpucloud.services.operations import settle
from gpucloud.web.service_tokens import EVALUATION, REGISTRY_READ_AUDIENCE, Issuer

log = logging.getLogger(__name__)


class EvaluationActivities(ActivityGroup):
    """The control plane's side of an evaluation: the tenant's keys and the token to read the
    version before, the signed record after."""

    def __init__(
        self,
        db: Database,
        stores: RegistryStores,
        signer: Signer,
        *,
        issuer: Issuer,
        api_url: str,
        token_ttl_s: float,
    ) -> None:
        """`issuer` (the issuer key) mints each evaluation's token for the API at `api_url`."""
        self.db, self.stores, self.signer = db, stores, signer
        self.issuer, self.api_url, self.token_ttl_s = issuer, api_url, token_ttl_s

    @activity.defn
    def evaluation_keys(self, req: EvaluateVersionInput) -> EvaluationKeys:
        with self.db.session() as session:
            public_keys = active_public_keys(session, req.tenant_id)
        versions = (req.version,) if req.parent is None else (req.version, req.parent)
        token = self.issuer.mint(
            REGISTRY_READ_AUDIENCE,
            subject=f"evaluation:{req.operation_id or req.version}",
            role=EVALUATION,
            tenant=req.tenant_id,
            model=req.model,
            versions=versions,
            ttl_s=self.token_ttl_s,
        )
        return EvaluationKeys(public_keys=public_keys, access=RegistryAccess(api_url=self.api_url, token=token))

    def _keep(self, req: EvaluateVersionInput, run: EvaluationRun) -> str:
        record = EvaluationRecord(
            version=req.version,
            evaluator=req.evaluator,
            results=run.results,
            recorded_at=datetime.now(UTC),
            failure=bounded(run.failure) if run.failure else None,
            details={**run.details, "compared_with": run.compared_with} if run.details else None,
        )
        signed = self.signer.sign_evaluation(record)
        row, _ = keep_evaluation(self.db, self.stores, req.tenant_id, signed, source=EvaluationSource.PLATFORM)
        return row.record_digest

    @activity.defn
    def record_evaluation(self, inp: RecordEvaluationInput) -> EvaluateVersionResult:
        req, run = inp.request, inp.run
        if run.refusal is not None:
            if run.refusal == EvaluationRefusal.VERSION_UNVERIFIABLE:
                self._keep(req, run)  # bytes that fail verification fail the version's gates
            settle(self.db, req.operation_id, error=run.failure)
            raise ApplicationError(run.failure or run.refusal.value, type=run.refusal.value, non_retryable=True)
        record_digest = self._keep(req, run)
        settle(self.db, req.operation_id, error=run.failure)
        return EvaluateVersionResult(
            evaluator=req.evaluator,
            results=run.results,
            failure=run.failure,
            record_digest=record_digest,
            compared_with=run.compared_with,
        )
