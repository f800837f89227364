"""The evaluation worker: tenants' evaluation code runs in a process whose settings and
environment hold none of the platform's secrets, and an evaluation refuses a version its disk
budget cannot hold before a byte of it is assembled."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from gpucloud.config import ObjectStoreSettings, Settings
from gpucloud.models.evaluation_messages import (
    EvaluateVersionInput,
    EvaluationKeys,
    EvaluationRefusal,
    EvaluationRun,
    RecordEvaluationInput,
    RegistryAccess,
    RunEvaluationInput,
)
from gpucloud.registry import pull as pull_module
from gpucloud.registry.manifest import Signer

pytestmark = pytest.mark.unit

SECRETS = {
    "database": {"url": "postgresql+psycopg://gpucloud:db-password-1@db/gpucloud"},
    "api": {"operator_token": "operator-token-2", "page_token_secret": "page-secret-3"},
    "registry": {"evaluator_key": "ab" * 32},
    "telemetry": {"metrics_token": "metrics-token-4"},
    "tenants": {"storage_master_key": "c2VjcmV0LW1hc3Rlci1rZXktNS0zMi1ieXRlcy1sb25n"},
    "fabric": {"ufm_token": "fabric-token-6", "nmx_token": "fabric-token-6n", "vpc_token": "fabric-token-6v"},
    "agent": {"credential_secret": "agent-secret-7"},
    "ledger": {"database_url": "postgresql+psycopg://ledger:ledger-password-8@db/ledger"},
    "object_store": {"backend": "s3", "bucket": "b", "access_key_id": "s3-id-10", "secret_access_key": "s3-secret-11"},
}


def test_the_evaluation_workers_environment_holds_no_platform_secret(monkeypatch, tmp_path: Path) -> None:
    """Built as `gpucloud up` builds it, from settings that hold every secret (and a shell that
    exports one): no secret's value, no secret's variable, and a data dir with none of the files
    the platform keeps its secrets in, and no object store at all: the worker built from it
    reads each version through the API, with the token its evaluation brings."""
    from gpucloud import bootstrap
    from gpucloud.devstack.stack import evaluation_worker_env
    from gpucloud.workers.evaluation import build_evaluation_worker

    monkeypatch.setenv("GPUCLOUD_API__OPERATOR_TOKEN", "shell-token-9")
    monkeypatch.setenv("GPUCLOUD_SECRETS_DIR", str(tmp_path / "secrets"))
    (tmp_path / "secrets").mkdir()
    settings = Settings(data_dir=tmp_path / "data", temporal={"task_queue": "tq-1"}, **SECRETS)
    bootstrap.token_issuer(settings)  # the issuer key the control plane keeps in its data dir
    env = evaluation_worker_env(settings)

    values = "\n".join(env.values())
    secrets = ["db-password-1", "operator-token-2", "page-secret-3", "ab" * 32, "metrics-token-4"]
    secrets += ["c2VjcmV0LW1hc3Rlci1rZXkt", "fabric-token-6", "agent-secret-7", "ledger-password-8", "shell-token-9"]
    secrets += ["s3-id-10", "s3-secret-11"]
    assert [secret for secret in secrets if secret in values] == []
    secretive = ("TOKEN", "KEY", "KEYS", "SECRET", "PASSWORD", "DATABASE_URL")

    def holds_secret(variable: str) -> bool:
        section, _, field = variable.removeprefix("GPUCLOUD_").partition("__")
        return section == "DATABASE" or field.endswith(secretive)

    # Only the payload keys, the same as the platform's: it must read the activities it is sent.
    held = [key for key in env if key.startswith("GPUCLOUD_") and holds_secret(key)]
    assert held == ["GPUCLOUD_TEMPORAL__CODEC_KEYS"]
    assert env["GPUCLOUD_TEMPORAL__CODEC_KEYS"] == settings.temporal_codec_keys

    for key in [k for k in os.environ if k.startswith("GPUCLOUD_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    evaluation = Settings()
    assert evaluation.database.url is None and evaluation.api.operator_token is None
    assert evaluation.registry.evaluator_key is None and evaluation.tenants.storage_master_key is None
    # No store: not the platform's bucket, nor its local directory.
    assert evaluation.object_store == ObjectStoreSettings()
    # Only the sections it was given travel: the store's, the database's and the agent's do not.
    sections = {k.removeprefix("GPUCLOUD_").partition("__")[0] for k in env if k.startswith("GPUCLOUD_") and "__" in k}
    assert sections == {"TEMPORAL", "REGISTRY", "TLS", "TELEMETRY"}
    assert evaluation.object_store_dir != settings.object_store_dir
    assert evaluation.temporal.evaluation_task_queue == "tq-1-evaluations"
    with (
        mock.patch("gpucloud.workers.evaluation.Worker") as worker,
        mock.patch.object(bootstrap, "object_store", side_effect=AssertionError("the store was built")),
    ):
        build_evaluation_worker(mock.MagicMock(), evaluation, executor=mock.MagicMock())
    assert worker.call_args.kwargs["task_queue"] == "tq-1-evaluations"
    assert [a.__name__ for a in worker.call_args.kwargs["activities"]] == ["run_evaluation"]
    assert evaluation.data_dir != settings.data_dir.resolve()
    assert not evaluation.data_dir.exists() or not any(evaluation.data_dir.rglob("*"))  # no secret made there


@pytest.fixture
def pushed(tmp_path: Path):
    """A version of a few files pushed into a tenant's registry store: (stores, signer, manifest)."""
    from gpucloud.registry.push import StoreTarget, push
    from gpucloud.registry.stores import RegistryStores
    from gpucloud.storage.local import LocalObjectStore

    stores = RegistryStores(LocalObjectStore(tmp_path / "objects"))
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text('{"layers": 2}')
    (source / "weights.bin").write_bytes(os.urandom(100_000))
    signer = Signer.generate()
    target = StoreTarget(stores.chunks("t1"), stores.manifests("t1"), settle_seconds=0)
    result = push(source, model="m", target=target, signer=signer)
    return stores, signer, result.signed


class StoreSource:
    """What the evaluation worker reads through the API (`RegistryPullSource`), served from the
    tenant's store in this process (the API's side is tests/weights/test_registry_api.py)."""

    def __init__(self, stores, model: str) -> None:
        self.manifests, self.chunks = stores.manifests("t1"), stores.chunks("t1")

    def get(self, digest: str):
        return self.manifests.get(digest)

    def stream(self, chunk_id: str):
        return self.chunks.stream(chunk_id)


def _run(stores, signer: Signer, digest: str, work: Path, **registry) -> EvaluationRun:
    from gpucloud.activities.evaluation_runner import EvaluationRunner
    from gpucloud.config import RegistrySettings

    runner = EvaluationRunner(work_dir=work, registry=RegistrySettings(**registry))
    request = EvaluateVersionInput(tenant_id="t1", model="m", version=digest, evaluator="sanity")
    access = RegistryAccess(api_url="http://127.0.0.1:9", token="scoped")
    keys = EvaluationKeys(public_keys=[bytes(signer.verify_key).hex()], access=access)
    source = functools.partial(StoreSource, stores)
    with mock.patch(
        "gpucloud.activities.evaluation_runner.RegistryPullSource", side_effect=lambda _client, model: source(model)
    ):
        return ActivityEnvironment().run(runner.run_evaluation, RunEvaluationInput(request=request, keys=keys))


def test_a_version_over_the_disk_budget_is_refused_before_it_is_assembled(pushed, tmp_path: Path) -> None:
    stores, signer, signed = pushed
    size = signed.manifest.total_size
    work = tmp_path / "work"
    with mock.patch("gpucloud.activities.evaluation_runner.pull", wraps=pull_module.pull) as pull:
        refused = _run(stores, signer, signed.digest, work, evaluation_disk_budget_bytes=size - 1)
        assert refused.refusal == EvaluationRefusal.OVER_DISK_BUDGET and refused.results == {}
        assert f"({size} bytes, with its parent's) exceed the evaluation disk budget of {size - 1}" in refused.failure
        assert pull.call_count == 0 and not work.exists()

        free = shutil.disk_usage(tmp_path)._replace(free=size - 1)
        with mock.patch("gpucloud.activities.evaluation_runner.shutil.disk_usage", return_value=free):
            no_room = _run(stores, signer, signed.digest, work)
        assert no_room.refusal == EvaluationRefusal.OVER_DISK_BUDGET and "bytes free" in (no_room.failure or "")
        assert pull.call_count == 0

        fits = _run(stores, signer, signed.digest, work, evaluation_disk_budget_bytes=size)
    assert fits.refusal is None and pull.call_count == 1 and "nan_inf_count" in fits.results


def test_a_refused_evaluation_ends_non_retryable_and_settles_its_operation() -> None:
    from gpucloud.activities.evaluation import EvaluationActivities

    db = mock.MagicMock(url="sqlite://")
    activities = EvaluationActivities(
        db,
        mock.MagicMock(),
        Signer.generate(),
        issuer=mock.MagicMock(),
        api_url="http://api",
        token_ttl_s=60,
    )
    request = EvaluateVersionInput(tenant_id="t1", model="m", version="a" * 64, evaluator="sanity", operation_id="op1")
    run = EvaluationRun(failure="too big", refusal=EvaluationRefusal.OVER_DISK_BUDGET)
    with mock.patch("gpucloud.activities.evaluation.settle") as settle, pytest.raises(ApplicationError) as raised:
        ActivityEnvironment().run(activities.record_evaluation, RecordEvaluationInput(request=request, run=run))
    assert raised.value.type == "EvaluationOverDiskBudget" and raised.value.non_retryable
    settle.assert_called_once_with(db, "op1", error="too big")


def test_the_control_plane_hands_the_evaluation_a_token_for_its_version_and_parent_only() -> None:
    """Minted with the issuer key, for the registry-read audience: the tenant, the model, the
    version and its parent, and a life of `registry.evaluation_token_ttl_s`."""
    import time

    from gpucloud.activities.evaluation import EvaluationActivities
    from gpucloud.web.service_tokens import EVALUATION, REGISTRY_READ_AUDIENCE, Issuer, Verifier

    issuer = Issuer(Ed25519PrivateKey.generate())
    activities = EvaluationActivities(
        mock.MagicMock(),
        mock.MagicMock(),
        Signer.generate(),
        issuer=issuer,
        api_url="https://api:8443",
        token_ttl_s=600,
    )
    request = EvaluateVersionInput(
        tenant_id="t1", model="m", version="a" * 64, parent="b" * 64, evaluator="sanity", operation_id="op1"
    )
    keys = ActivityEnvironment().run(activities.evaluation_keys, request)
    assert keys.access.api_url == "https://api:8443"
    claims = Verifier(issuer.public_key).verify(keys.access.token, audience=REGISTRY_READ_AUDIENCE, roles=(EVALUATION,))
    assert (claims.tenant, claims.model, claims.versions) == ("t1", "m", ("a" * 64, "b" * 64))
    assert 590 < claims.expires_at - time.time() <= 600


def test_a_token_the_api_refuses_ends_the_evaluation_without_a_run(pushed, tmp_path: Path) -> None:
    """An activity retried after its token expired: the API answers 401, and the evaluation
    ends (non-retryable, `EvaluationAccessRefused`) instead of retrying for hours."""
    from gpucloud.client.base import ApiError

    stores, signer, signed = pushed
    refused = ApiError(401, {"title": "Invalid credentials", "detail": "the API key is unknown or revoked"})
    with mock.patch.object(StoreSource, "get", side_effect=refused):
        run = _run(stores, signer, signed.digest, tmp_path / "work")
    assert run.refusal == EvaluationRefusal.ACCESS_REFUSED and run.results == {}
    assert "refused the evaluation's token" in (run.failure or "")


def test_the_evaluation_worker_refuses_to_start_holding_a_platform_secret(tmp_path: Path) -> None:
    """Started with the platform's environment by mistake (gpucloud.env, its data dir), it says
    which secrets it was given and starts nothing; with its own (what `up` and the unit give
    it), it holds none."""
    import asyncio

    from gpucloud import bootstrap
    from gpucloud.workers.evaluation import platform_secrets_in, run_evaluation_worker

    platform = Settings(data_dir=tmp_path / "data", **SECRETS)
    bootstrap.token_issuer(platform)
    held = platform_secrets_in(platform)
    assert "GPUCLOUD_DATABASE__URL" in held and "GPUCLOUD_API__OPERATOR_TOKEN" in held
    assert str(tmp_path / "data" / "issuer_key.pem") in held
    with pytest.raises(SystemExit, match=r"must hold none of the platform's secrets.*GPUCLOUD_DATABASE__URL"):
        asyncio.run(run_evaluation_worker(platform))
    assert platform_secrets_in(platform.for_evaluation_worker()) == []


def test_the_evaluation_workers_process_loads_nothing_of_the_control_plane(tmp_path) -> None:
    """What `gpucloud worker --role evaluation` imports to run (the CLI, the worker's entrypoint
    and `workers/evaluation.py`, and its check of the shared secrets it must not hold), in a fresh
    interpreter: no database layer, no `prepare`, no `bootstrap` and
    the adapters it picks, no service-token issuer, no control-plane activities, no web framework
    (the process that runs tenants' commands carries no code that could reach a platform secret)."""
    import subprocess
    import sys

    probe = (
        "import sys, gpucloud.cli.main, gpucloud.entrypoints.worker, gpucloud.workers.evaluation\n"
        "from gpucloud.config import Settings\n"
        f"gpucloud.workers.evaluation.platform_secrets_in(Settings(data_dir={str(tmp_path)!r}))\n"
        "print(sorted(m for m in sys.modules if m in FORBIDDEN or m.startswith(('gpucloud.services.', 'boto3'))))"
    )
    forbidden = [
        "gpucloud.db",
        "gpucloud.bootstrap",
        "gpucloud.prepare",
        "gpucloud.workers.main",
        "gpucloud.activities.control_db",
        "gpucloud.activities.evaluation",
        "gpucloud.web.service_tokens",
        "gpucloud.storage.tenant",
        "fastapi",
        "alembic",
    ]
    loaded = subprocess.run(
        [sys.executable, "-c", f"FORBIDDEN = {forbidden!r}\n{probe}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout
