"""The platform's evaluation of a version, in two workers, so that code a tenant wrote never
runs in a process that holds a platform secret:

- `EvaluationRunner`, on the evaluation worker (its own process and task queue, see
  `workers.main.run_evaluation_worker`), holds no database, no object store credentials, no
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

import functools
import logging
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.client.base import ApiError
from gpucloud.client.registry import RegistryClient, RegistryPullSource
from gpucloud.config import RegistrySettings
from gpucloud.db import Database
from gpucloud.models.evaluation_messages import (
    EvaluateVersionInput,
    EvaluateVersionResult,
    EvaluationKeys,
    EvaluationRefusal,
    EvaluationRun,
    RecordEvaluationInput,
    RegistryAccess,
    RunEvaluationInput,
)
from gpucloud.models.registry_tables import EvaluationSource
from gpucloud.registry.command_eval import bounded
from gpucloud.registry.evaluators import evaluate_directory, run_model_command
from gpucloud.registry.manifest import (
    BadSignatureError,
    EvaluationRecord,
    IntegrityError,
    Keyring,
    Manifest,
    Signer,
    UnknownKeyError,
    VersionNotFoundError,
)
from gpucloud.registry.promotion import active_public_keys
from gpucloud.registry.pull import pull
from gpucloud.registry.stores import RegistryStores
from gpucloud.services.evaluations import keep_evaluation
from gpucloud.services.operations import settle
from gpucloud.web.service_tokens import EVALUATION, REGISTRY_READ_AUDIENCE, Issuer

log = logging.getLogger(__name__)

_UNVERIFIABLE = (IntegrityError, BadSignatureError, UnknownKeyError)


class DiskBudgetExceeded(Exception):
    pass


def check_disk_budget(size: int, work_dir: Path, *, budget_bytes: int) -> None:
    """Refuse (`DiskBudgetExceeded`) `size` bytes of versions to assemble in `work_dir` past the
    budget or past the disk's free space: a manifest can declare terabytes of repeated chunks."""
    if size > budget_bytes:
        raise DiskBudgetExceeded(
            f"the version's files ({size} bytes, with its parent's) exceed the evaluation disk budget "
            f"of {budget_bytes} bytes"
        )
    work_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work_dir).free
    if size > free:
        raise DiskBudgetExceeded(
            f"the version's files ({size} bytes, with its parent's) exceed the {free} bytes free on the evaluation disk"
        )


class EvaluationRunner(ActivityGroup):
    """The evaluation worker's one activity (see the module doc)."""

    def __init__(self, *, work_dir: Path, registry: RegistrySettings) -> None:
        """`registry` says how a model's command runs (its container runtime, or on the host
        where the operator allows it) and the disk budget; versions are pulled into `work_dir`."""
        self.work_dir, self.registry = work_dir, registry

    @activity.defn
    def run_evaluation(self, inp: RunEvaluationInput) -> EvaluationRun:
        access = inp.keys.access
        with RegistryClient(access.api_url, access.token) as client:
            try:
                return self._run(inp, RegistryPullSource(client, inp.request.model))
            except ApiError as exc:
                if exc.status not in (401, 403):
                    raise  # the API busy or failing: Temporal retries
                failure = f"the registry refused the evaluation's token ({exc}); evaluate the version again"
                return EvaluationRun(failure=failure, refusal=EvaluationRefusal.ACCESS_REFUSED)

    def _run(self, inp: RunEvaluationInput, source: RegistryPullSource) -> EvaluationRun:
        req = inp.request
        keyring = Keyring()
        for public_key in inp.keys.public_keys:
            keyring.trust(req.tenant_id, bytes.fromhex(public_key))

        def verified(digest: str) -> Manifest:
            return keyring.verify(source.get(digest), tenant=req.tenant_id)

        def pulled(digest: str, dest: Path) -> Path:
            # `source` is both stores `pull` reads: the manifest and each chunk, hashed on arrival.
            pull(
                digest,
                dest,
                chunk_store=source,  # type: ignore[arg-type]
                manifest_store=source,  # type: ignore[arg-type]
                keyring=keyring,
                tenant=req.tenant_id,
                progress=lambda *_: activity.heartbeat(),
            )
            return dest

        work = self.work_dir / uuid.uuid4().hex
        try:
            try:
                size = verified(req.version).total_size
            except VersionNotFoundError as exc:
                return EvaluationRun(failure=f"version not found: {exc}", refusal=EvaluationRefusal.VERSION_NOT_FOUND)
            except _UNVERIFIABLE as exc:
                failure = f"the version failed verification ({type(exc).__name__}): {exc}"
                return EvaluationRun(failure=failure, refusal=EvaluationRefusal.VERSION_UNVERIFIABLE)
            parent = None
            if req.parent is not None and req.evaluator == "sanity":
                try:
                    size += verified(req.parent).total_size
                    parent = req.parent
                except (VersionNotFoundError, *_UNVERIFIABLE) as exc:
                    # The parent is gone (collected) or no longer verifies: judge the version alone.
                    log.warning("evaluating %s without its parent %s: %s", req.version, req.parent, exc)
            try:
                check_disk_budget(size, self.work_dir, budget_bytes=self.registry.evaluation_disk_budget_bytes)
            except DiskBudgetExceeded as exc:
                return EvaluationRun(failure=str(exc), refusal=EvaluationRefusal.OVER_DISK_BUDGET)
            try:
                version = pulled(req.version, work / "version")
            except _UNVERIFIABLE as exc:  # a chunk that does not match its manifest
                failure = f"the version failed verification ({type(exc).__name__}): {exc}"
                return EvaluationRun(failure=failure, refusal=EvaluationRefusal.VERSION_UNVERIFIABLE)
            parent_dir = None
            if parent is not None:
                try:
                    parent_dir = pulled(parent, work / "parent")
                except _UNVERIFIABLE as exc:
                    log.warning("evaluating %s without its parent %s: %s", req.version, parent, exc)
                    parent = None
            activity.heartbeat()
            run_command = functools.partial(
                run_model_command,
                runtime=self.registry.evaluation_runtime,
                host_commands=self.registry.evaluation_host_commands,
            )
            outcome = evaluate_directory(version, parent_dir, [req.evaluator], req.command, run_command=run_command)[
                req.evaluator
            ]
            return EvaluationRun(
                results=outcome.results,
                failure=bounded(outcome.failure) if outcome.failure else None,
                details=outcome.details,
                compared_with=parent,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)


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
