"""The evaluation worker's one activity (`EvaluationRunner`): code a tenant wrote runs here, in a
process that holds no platform secret (see `activities/evaluation.py`, which hands it the keys
and a short-lived read token and signs what it found, and `workers/evaluation.py`).

This module imports only what that takes: the registry's client, verification and pull, the
evaluators, and the settings; nothing of the database, the issuer key or the control plane's
adapters, so the evaluation worker's process never loads them.
"""

from __future__ import annotations

import functools
import logging
import shutil
import uuid
from pathlib import Path

from temporalio import activity

from gpucloud.activities import ActivityGroup
from gpucloud.client.base import ApiError
from gpucloud.client.registry import RegistryClient, RegistryPullSource
from gpucloud.config import RegistrySettings
from gpucloud.models.evaluation_messages import EvaluationRefusal, EvaluationRun, RunEvaluationInput
from gpucloud.registry.command_eval import bounded
from gpucloud.registry.evaluators import evaluate_directory, run_model_command
from gpucloud.registry.manifest import (
    BadSignatureError,
    IntegrityError,
    Keyring,
    Manifest,
    UnknownKeyError,
    VersionNotFoundError,
)
from gpucloud.registry.pull import pull

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
