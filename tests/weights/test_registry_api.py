"""The registry API and the `weights` client over real HTTP on a real DB: push with dedup and
resume, pulls that fail closed, signatures checked at push, gated promotion, tenant isolation,
pagination and bad input, the CLI commands, and the S3 backend chosen by configuration."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import blake3
import httpx
import pytest
from sqlmodel import col, select
from temporalio.client import WorkflowExecutionStatus
from typer.testing import CliRunner

from gpucloud.cli.evaluation import weights_app
from gpucloud.client.base import ApiError
from gpucloud.client.registry import (
    RegistryClient,
    RegistryPullSource,
    RegistryPushTarget,
    pull_version,
    signer_for,
)
from gpucloud.db import session_scope
from gpucloud.models.tables import Operation
from gpucloud.registry.chunking import chunk_file
from gpucloud.registry.manifest import (
    BadSignatureError,
    ChunkCorruptedError,
    ChunkMissingError,
    ChunkRef,
    ChunkSwappedError,
    ChunkTruncatedError,
    EvaluationRecord,
    IntegrityError,
    Keyring,
    Lineage,
    Manifest,
    ManifestTamperedError,
    SignedEvaluation,
    Signer,
    UnknownKeyError,
)
from gpucloud.registry.pull import pull
from gpucloud.registry.push import PushResult, push
from gpucloud.registry.store import LocalChunkStore
from support.codec import CODEC_KEYS
from support.forked import CliProcess
from support.models import POLICY, float_model, random_tensors, tree, write_model
from support.stack import async_wait_until, settled_operation

pytestmark = pytest.mark.integration

OPERATOR = "test-operator-token"


class Recorder(httpx.BaseTransport):
    """Real HTTP, with a log of requests and an optional cut after N chunk uploads. JSON calls go
    through this transport; chunk bodies through `RecordingClient.upload`, which logs them here."""

    def __init__(self, *, fail_after_uploads: int | None = None) -> None:
        self.inner = httpx.HTTPTransport()
        self.requests: list[tuple[str, str]] = []
        self.fail_after = fail_after_uploads
        self._lock = threading.Lock()

    def uploads(self) -> list[str]:
        return [path.rsplit("/", 1)[-1] for method, path in self.requests if method == "PUT" and "/chunks/" in path]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests.append((request.method, request.url.path))
        return self.inner.handle_request(request)

    def upload(self, model: str, chunk_id: str) -> None:
        with self._lock:
            if self.fail_after is not None and len(self.uploads()) >= self.fail_after:
                raise ConnectionResetError("network cut by the test")
            self.requests.append(("PUT", f"/v1/models/{model}/chunks/{chunk_id}"))


class RecordingClient(RegistryClient):
    def __init__(self, url: str, key: str, recorder: Recorder) -> None:
        super().__init__(url, key, transport=recorder)
        self.recorder = recorder

    def upload(self, model: str, path: Path, chunk: ChunkRef) -> bool:
        self.recorder.upload(model, chunk.id)
        return super().upload(model, path, chunk)


@dataclass
class Tenant:
    id: str
    key: str
    url: str
    data_dir: Path
    server_dir: Path

    def client(self, transport: httpx.BaseTransport | None = None) -> RegistryClient:
        if isinstance(transport, Recorder):
            return RecordingClient(self.url, self.key, transport)
        return RegistryClient(self.url, self.key, transport=transport)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=30)

    @property
    def signer(self) -> Signer:
        return signer_for(self.data_dir, self.id)

    @property
    def chunks(self) -> LocalChunkStore:
        return LocalChunkStore(self.server_dir / "objects" / "registry" / "tenants" / self.id)

    def push(
        self,
        source: Path,
        *,
        model: str = "llama",
        lineage: Lineage | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> PushResult:
        with self.client(transport) as client:
            target = RegistryPushTarget(client)
            return push(source, model=model, target=target, signer=self.signer, lineage=lineage, policy=POLICY)

    def pull(self, ref: str, dest: Path, *, model: str = "llama"):
        with self.client() as client:
            return pull_version(client, model, ref, dest, trusted=[self.signer.verify_key])


@dataclass
class Registry:
    url: str
    tmp: Path
    app: object
    settings: object
    workers: list[subprocess.Popen | CliProcess] = field(default_factory=list)

    def start_worker(self) -> None:
        """The production workers, each its own process, for the platform's evaluations: the
        control plane's, and the evaluation worker in the environment `gpucloud up` gives it."""
        from gpucloud.devstack.stack import evaluation_worker_env

        if self.workers:
            return
        control_plane = {**os.environ, **self.settings.env(), "GPUCLOUD_LOG_LEVEL": "WARNING"}
        # The control plane's worker forked from the server that imported the CLI
        # (`support/forked.py`); the evaluation worker started afresh, as `up` starts it (a forked
        # process would keep this one's start-up environment).
        self.workers.append(
            CliProcess(
                ["worker", "--role", "control-plane"], env=control_plane, log_path=self.tmp / "worker-control-plane.log"
            )
        )
        with open(self.tmp / "worker-evaluation.log", "ab") as log:
            self.workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "gpucloud.cli.main", "worker", "--role", "evaluation"],
                    env={**evaluation_worker_env(self.settings), "GPUCLOUD_LOG_LEVEL": "WARNING"},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def platform_evaluation(
        self, tenant: Tenant, digest: str, evaluator: str, results: dict[str, float], failure: str | None = None
    ) -> None:
        """Keep results (or a failed run) as the worker's evaluation activity does: signed with the platform's key."""
        from gpucloud import bootstrap
        from gpucloud.db import Database
        from gpucloud.models.registry_tables import EvaluationSource
        from gpucloud.services.evaluations import keep_evaluation

        record = EvaluationRecord(
            version=digest, evaluator=evaluator, results=results, recorded_at=datetime.now(UTC), failure=failure
        )
        signed = bootstrap.evaluator_signer(self.settings).sign_evaluation(record)
        stores = bootstrap.registry_stores(self.settings)
        keep_evaluation(
            Database(self.settings.database_url), stores, tenant.id, signed, source=EvaluationSource.PLATFORM
        )

    def new_tenant(self) -> Tenant:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {OPERATOR}"}) as op:
            tenant = op.post("/v1/tenants", json={"name": f"t-{uuid.uuid4().hex[:8]}"}).json()
            key = op.post(f"/v1/tenants/{tenant['id']}/api-keys").json()["key"]
        return Tenant(tenant["id"], key, self.url, self.tmp / "cli", self.tmp / "server")


@pytest.fixture
def registry(db_url, tmp_path, temporal_env) -> Iterator[Registry]:
    from gpucloud.api.app import create_app
    from gpucloud.config import Settings
    from gpucloud.devstack.stack import free_port
    from gpucloud.web.serving import ThreadedServer

    settings = Settings(
        data_dir=tmp_path / "server",
        database={"url": db_url},
        api={"operator_token": OPERATOR, "port": free_port()},
        temporal={
            "address": temporal_env.client.service_client.config.target_host,
            "task_queue": f"tq-{uuid.uuid4().hex[:10]}",
            "codec_keys": CODEC_KEYS,
        },
        registry={"evaluation_host_commands": True},
    )
    app = create_app(settings, temporal=temporal_env.client)
    with ThreadedServer(app, port=settings.api.port, name="api"):
        registry = Registry(settings.api_url, tmp_path, app, settings)
        try:
            yield registry
        finally:
            for worker in registry.workers:
                worker.kill()
                worker.wait()


def test_push_dedups_between_versions_and_pull_round_trips(registry: Registry, tmp_path: Path) -> None:
    tenant = registry.new_tenant()
    tensors = random_tensors()
    v1_dir = write_model(tmp_path / "v1", tensors)
    first = Recorder()
    v1 = tenant.push(v1_dir, transport=first)
    assert sorted(first.uploads()) == sorted(v1.signed.manifest.chunk_ids())
    assert v1.stats.chunks_uploaded == len(v1.signed.manifest.chunk_ids())
    assert v1.version["digest"] == v1.digest

    # A fine-tune rewrites two tensors: exactly their chunks go up, everything else is shared.
    tensors["layer.3"], tensors["layer.6"] = os.urandom(9000), os.urandom(5000)
    v2_dir = write_model(tmp_path / "v2", tensors)
    expected = {
        c.id for c in chunk_file(v2_dir / "model.safetensors", policy=POLICY).chunks
    } - v1.signed.manifest.chunk_ids()
    second = Recorder()
    v2 = tenant.push(v2_dir, transport=second, lineage=Lineage(parent=v1.digest, base_model="llama-3"))
    assert set(second.uploads()) == expected and len(second.uploads()) == len(expected)
    assert v2.stats.bytes_uploaded == v2.stats.bytes_to_upload < 9000 + 5000 + 4096
    assert v2.stats.bytes_skipped == v2.stats.bytes_total - v2.stats.bytes_uploaded

    pulled = tenant.pull(v2.digest[:12], tmp_path / "out" / "v2")
    assert tree(pulled.path) == tree(v2_dir)
    assert tree(tenant.pull(v1.digest, tmp_path / "out" / "v1").path) == tree(v1_dir)

    with tenant.http() as http:
        ancestors = http.get(f"/v1/models/llama/versions/{v2.digest}/ancestors").json()["items"]
        descendants = http.get(f"/v1/models/llama/versions/{v1.digest}/descendants").json()["items"]
        version = http.get(f"/v1/models/llama/versions/{v2.digest}").json()
    assert [(a["digest"], a["depth"]) for a in ancestors] == [(v1.digest, 1)]
    assert [(d["digest"], d["depth"]) for d in descendants] == [(v2.digest, 1)]
    assert version["parent"] == v1.digest and version["base_model"] == "llama-3"


def test_the_same_files_pushed_again_answer_the_version_already_there(registry: Registry, tmp_path: Path) -> None:
    """A push of the same files with the same lineage builds a manifest of another creation time,
    so of another digest; it answers the version registered first (200) and registers nothing, and
    pushes of that content at once end as one version. Before, every push was a new version."""
    tenant = registry.new_tenant()
    source = write_model(tmp_path / "v1", random_tensors())
    first, again = tenant.push(source), tenant.push(source)
    assert not first.existed and again.existed
    assert again.signed.digest != first.digest and again.digest == first.digest == again.version["digest"]
    assert again.stats.chunks_uploaded == 0

    def post(http: httpx.Client, signed) -> httpx.Response:
        body = signed.model_dump_json()
        return http.post("/v1/models/llama/versions", content=body, headers={"Content-Type": "application/json"})

    manifest, signer = first.signed.manifest, tenant.signer
    with tenant.http() as http:
        replayed = post(http, first.signed)  # the very manifest again
        assert replayed.status_code == 200 and replayed.json()["digest"] == first.digest
        # Built again a minute later, posted by hand: the same answer, and its digest names nothing.
        later = signer.sign(manifest.model_copy(update={"created_at": datetime(2030, 1, 1, tzinfo=UTC)}))
        answered = post(http, later)
        assert answered.status_code == 200 and answered.json()["digest"] == first.digest
        assert http.get(f"/v1/models/llama/versions/{later.digest}").status_code == 404
        # Other lineage is another version.
        child = post(http, signer.sign(manifest.model_copy(update={"lineage": Lineage(parent=first.digest)})))
        assert child.status_code == 201 and child.json()["digest"] != first.digest
        # So is the same content built again and signed by another key (the first may be revoked).
        other = Signer.generate()
        with tenant.client() as client:
            client.register_key(other)
        resigned = post(http, other.sign(manifest.model_copy(update={"created_at": datetime(2032, 1, 1, tzinfo=UTC)})))
        assert resigned.status_code == 201 and resigned.json()["key_id"] == other.key_id

        # Eight builds of one new content posted at once: one registers it, seven are told it exists.
        raced = manifest.model_copy(update={"lineage": Lineage(training_run="raced")})
        builds = [
            signer.sign(raced.model_copy(update={"created_at": datetime(2031, 1, 1, 0, 0, i, tzinfo=UTC)}))
            for i in range(8)
        ]
        barrier = threading.Barrier(len(builds))

        def racer(signed) -> httpx.Response:
            with tenant.http() as own:
                barrier.wait(timeout=30)
                return post(own, signed)

        with ThreadPoolExecutor(len(builds)) as pool:
            answers = list(pool.map(racer, builds))
        assert sorted(a.status_code for a in answers) == [200] * 7 + [201], [a.text for a in answers]
        assert len({a.json()["digest"] for a in answers}) == 1
        listed = [v["digest"] for v in http.get("/v1/models/llama/versions").json()["items"]]
    assert len(listed) == 4 and first.digest in listed and answers[0].json()["digest"] in listed
    assert set(tenant_manifests(registry, tenant)) == set(listed)  # the losers' manifests are not kept


def tenant_manifests(registry: Registry, tenant: Tenant) -> list[str]:
    from gpucloud.bootstrap import registry_stores

    return list(registry_stores(registry.settings).manifests(tenant.id).digests())


def test_interrupted_push_resumes_with_only_the_missing_chunks(registry: Registry, tmp_path: Path) -> None:
    tenant = registry.new_tenant()
    source = write_model(tmp_path / "v1", random_tensors())
    cut = Recorder(fail_after_uploads=3)
    with pytest.raises(ConnectionError):
        tenant.push(source, transport=cut)
    with tenant.http() as http:
        assert http.get("/v1/models/llama/versions").json()["items"] == []  # nothing half-registered

    resumed = Recorder()
    outcome = tenant.push(source, transport=resumed)
    everything = outcome.signed.manifest.chunk_ids()
    assert set(cut.uploads()).isdisjoint(resumed.uploads())
    assert set(cut.uploads()) | set(resumed.uploads()) == everything
    assert len(resumed.uploads()) == len(everything) - 3
    assert tree(tenant.pull(outcome.digest, tmp_path / "out").path) == tree(source)


def _corrupt(kind: str, tenant: Tenant, outcome: PushResult) -> None:
    manifest = outcome.signed.manifest
    entry = manifest.files["model.safetensors"]
    victim, other = entry.chunks[0], entry.chunks[1]
    path = tenant.chunks.path(victim.id)
    manifest_file = tenant.chunks.root / "manifests" / f"{outcome.digest}.json"
    if kind == "corrupted":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[: victim.size // 2])
    elif kind == "swapped":
        path.write_bytes(tenant.chunks.path(other.id).read_bytes())
    elif kind == "missing":
        path.unlink()
    elif kind == "tampered-manifest":
        raw = json.loads(manifest_file.read_text())
        raw["manifest"]["lineage"]["base_model"] = "something-else"
        manifest_file.write_text(json.dumps(raw))
    elif kind == "bad-signature":
        raw = json.loads(manifest_file.read_text())
        raw["signature"] = ("0" if raw["signature"][0] != "0" else "1") + raw["signature"][1:]
        manifest_file.write_text(json.dumps(raw))
    elif kind == "revoked-key":
        with tenant.http() as http:
            http.delete(f"/v1/signing-keys/{outcome.signed.key_id}").raise_for_status()


@pytest.mark.one_database  # the database only underneath: on SQLite
@pytest.mark.parametrize(
    ("kind", "error", "named"),
    [
        ("corrupted", ChunkCorruptedError, "chunk"),
        ("truncated", ChunkTruncatedError, "chunk"),
        ("swapped", ChunkSwappedError, "chunk"),
        ("missing", ChunkMissingError, "chunk"),
        ("tampered-manifest", ManifestTamperedError, "digest"),
        ("bad-signature", BadSignatureError, "key"),
        ("revoked-key", UnknownKeyError, "key"),
    ],
)
def test_pull_fails_closed_on_every_corruption(
    registry: Registry, tmp_path: Path, kind: str, error: type[IntegrityError], named: str
) -> None:
    tenant = registry.new_tenant()
    outcome = tenant.push(write_model(tmp_path / "v1", random_tensors()))
    _corrupt(kind, tenant, outcome)
    dest = tmp_path / "out" / "v1"
    with pytest.raises(error) as caught:
        tenant.pull(outcome.digest, dest)
    message = str(caught.value)
    first_chunk = outcome.signed.manifest.files["model.safetensors"].chunks[0].id
    expected = {"chunk": first_chunk, "digest": outcome.digest, "key": outcome.signed.key_id}[named]
    assert expected in message
    if named == "chunk":
        assert "model.safetensors" in message
    assert not dest.exists()
    leftovers = list(dest.parent.iterdir()) if dest.parent.exists() else []
    assert leftovers == []  # no partial directory either


def test_push_refuses_tampered_manifests_unknown_keys_and_missing_chunks(registry: Registry, tmp_path: Path) -> None:
    tenant = registry.new_tenant()
    good = tenant.push(write_model(tmp_path / "v1", random_tensors()))
    base = good.signed.manifest
    tampered = good.signed.model_copy(
        update={"manifest": base.model_copy(update={"lineage": Lineage(training_run="forged")})}
    )
    stranger = Signer.generate().sign(Manifest.build(model="llama", files=base.files))
    missing_file = chunk_file(write_model(tmp_path / "v2", random_tensors()) / "model.safetensors", policy=POLICY)
    unuploaded = tenant.signer.sign(Manifest.build(model="llama", files={"w.safetensors": missing_file}))
    wrong_model = tenant.signer.sign(Manifest.build(model="other", files=base.files))
    orphan = tenant.signer.sign(Manifest.build(model="llama", files=base.files, lineage=Lineage(parent="a" * 64)))
    with tenant.http() as http:

        def post(signed) -> httpx.Response:
            return http.post(
                "/v1/models/llama/versions",
                content=signed.model_dump_json(),
                headers={"content-type": "application/json"},
            )

        for signed, status, kind, field in [
            (tampered, 422, "bad-signature", "signature"),
            (stranger, 422, "unknown-signing-key", "key_id"),
            (wrong_model, 422, "invalid-request", "manifest.model"),
            (orphan, 422, "invalid-request", "manifest.lineage.parent"),
            (unuploaded, 409, "chunks-missing", None),
        ]:
            response = post(signed)
            assert response.status_code == status, response.text
            body = response.json()
            assert body["type"].endswith("/" + kind)
            if field:
                assert body["errors"][0]["field"] == field and body["detail"].startswith(field)
        # The header chunk is shared with v1 (same tensor sizes): only the new tensors are missing.
        assert set(post(unuploaded).json()["missing"]) == {c.id for c in missing_file.chunks} - base.chunk_ids()
        assert [v["digest"] for v in http.get("/v1/models/llama/versions").json()["items"]] == [good.digest]
        assert post(good.signed).status_code == 200  # the same version again: already there


@pytest.mark.one_database  # the database only underneath: on SQLite
def test_a_manifest_bomb_is_refused_at_push(registry: Registry) -> None:
    """Issue 37, item 6: a 6.5 MiB manifest listing one 64 MiB chunk 60,000 times declared a
    3.66 TiB version, which evaluation would assemble on a worker's disk. Refused before anything
    else is checked, naming the problem."""
    from gpucloud.registry.manifest import FileEntry

    tenant = registry.new_tenant()
    with tenant.http() as http:
        http.post("/v1/models", json={"name": "llama"}).raise_for_status()
    size, chunk_id = 64 << 20, blake3.blake3(b"one chunk").hexdigest()
    refs = [ChunkRef(id=chunk_id, offset=i * size, size=size) for i in range(60_000)]
    bomb = Manifest.build(model="llama", files={"model.safetensors": FileEntry(size=60_000 * size, chunks=refs)})
    body = tenant.signer.sign(bomb).model_dump_json()
    assert len(body) > 6_000_000
    with tenant.http() as http:
        refused = http.post("/v1/models/llama/versions", content=body, headers={"content-type": "application/json"})
    assert refused.status_code == 422, refused.text
    problem = refused.json()
    assert problem["type"].endswith("/version-too-large") and problem["errors"][0]["field"] == "manifest.total_size"
    assert "60000 times over" in problem["detail"] and "listed again and again" in problem["detail"]


def test_chunk_upload_verifies_blake3_before_storing(registry: Registry) -> None:
    tenant = registry.new_tenant()
    data = os.urandom(3000)
    real_id = blake3.blake3(data).hexdigest()
    wrong_id = "f" * 64
    with tenant.http() as http:
        http.post("/v1/models", json={"name": "llama"}).raise_for_status()
        refused = http.put(f"/v1/models/llama/chunks/{wrong_id}", content=data)
        assert refused.status_code == 422 and refused.json()["type"].endswith("/chunk-digest-mismatch")
        assert real_id in refused.json()["detail"]
        missing = http.post("/v1/models/llama/chunks:missing", json={"chunk_ids": [wrong_id, real_id]}).json()
        assert missing["missing"] == [wrong_id, real_id]
        assert http.put(f"/v1/models/llama/chunks/{real_id}", content=data).status_code == 201
        assert http.put(f"/v1/models/llama/chunks/{real_id}", content=data).status_code == 200
        assert http.post("/v1/models/llama/chunks:missing", json={"chunk_ids": [real_id]}).json()["missing"] == []
        served = http.get(f"/v1/models/llama/chunks/{real_id}")
        assert served.content == data and served.headers["content-length"] == str(len(data))
        bad = http.put("/v1/models/llama/chunks/not-a-digest", content=data)
        assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "chunk_id"
    assert not tenant.chunks.has(wrong_id)


def test_chunk_upload_needs_its_length_and_stores_nothing_without_it(registry: Registry) -> None:
    tenant = registry.new_tenant()
    data = os.urandom(3000)
    chunk_id = blake3.blake3(data).hexdigest()
    with tenant.http() as http:
        http.post("/v1/models", json={"name": "llama"}).raise_for_status()
        refused = http.put(f"/v1/models/llama/chunks/{chunk_id}", content=iter([data]))  # chunked: no length
        assert refused.status_code == 411 and refused.json()["type"].endswith("/length-required")
        assert "Content-Length" in refused.json()["detail"]
    assert not tenant.chunks.has(chunk_id)


def _report(
    tenant: Tenant, digest: str, results: dict[str, float], signer: Signer | None = None, version: str | None = None
) -> httpx.Response:
    """Results the tenant reports, signed with its own key."""
    record = EvaluationRecord(
        version=version or digest, evaluator="eval-suite", results=results, recorded_at=datetime.now(UTC)
    )
    with tenant.http() as http:
        return http.post(
            f"/v1/models/gated/versions/{digest}/evaluations",
            content=(signer or tenant.signer).sign_evaluation(record).model_dump_json(),
            headers={"content-type": "application/json"},
        )


def test_promotion_is_gated_on_evaluations(registry: Registry, tmp_path: Path) -> None:
    tenant = registry.new_tenant()
    gates = [
        {"metric": "accuracy", "min": 0.7, "max_regression": 0.02},
        {"metric": "latency_ms", "max": 100, "max_regression": 10, "higher_is_better": False},
    ]
    with tenant.http() as http:
        http.post("/v1/models", json={"name": "gated", "gates": gates}).raise_for_status()
    v1 = tenant.push(write_model(tmp_path / "v1", random_tensors()), model="gated")
    v2 = tenant.push(write_model(tmp_path / "v2", random_tensors()), model="gated", lineage=Lineage(parent=v1.digest))

    def promote(digest: str, alias: str) -> httpx.Response:
        with tenant.http() as http:
            return http.put(f"/v1/models/gated/aliases/{alias}", json={"version": digest})

    assert promote(v1.digest, "candidate").status_code == 200  # candidate is not gated
    refused = promote(v1.digest, "production")
    assert refused.status_code == 409 and refused.json()["type"].endswith("/gates-failed")
    assert {(f["metric"], f["evaluator"]) for f in refused.json()["failing_metrics"]} == {
        ("accuracy", "command"),
        ("latency_ms", "command"),
        ("nan_inf_count", "sanity"),  # the platform's own: production takes a version sanity passed
    }

    # Results the tenant reports are kept and shown, but never open a staging or production gate.
    assert _report(tenant, v1.digest, {"accuracy": 0.99, "latency_ms": 10}).status_code == 201
    refused = promote(v1.digest, "production")
    assert refused.status_code == 409
    assert {f["reason"] for f in refused.json()["failing_metrics"]} == {
        "no result from a platform command evaluation",
        "production takes only a version a platform sanity evaluation has passed, and none has run",
    }
    with tenant.http() as http:
        shown = http.get(f"/v1/models/gated/versions/{v1.digest}").json()
        assert shown["metrics"] == {} and shown["reported_metrics"] == {"accuracy": 0.99, "latency_ms": 10}
        listed = http.get(f"/v1/models/gated/versions/{v1.digest}/evaluations").json()["items"]
        assert [(e["source"], e["evaluator"]) for e in listed] == [("reported", "eval-suite")]
    assert promote(v1.digest, "staging").status_code == 409

    # A platform result from another evaluator does not stand in for the command's.
    registry.platform_evaluation(tenant, v1.digest, "sanity", {"accuracy": 0.80, "latency_ms": 90, "nan_inf_count": 0})
    assert promote(v1.digest, "production").status_code == 409
    registry.platform_evaluation(tenant, v1.digest, "command", {"accuracy": 0.80, "latency_ms": 90})
    assert promote(v1.digest, "production").status_code == 200

    registry.platform_evaluation(tenant, v2.digest, "command", {"accuracy": 0.77, "latency_ms": 120})
    refused = promote(v2.digest, "staging").json()
    failing = {(f["metric"], f["reason"].split()[0]) for f in refused["failing_metrics"]}
    assert failing == {("accuracy", "regresses"), ("latency_ms", "above"), ("latency_ms", "regresses")}
    assert "accuracy (command)=0.77" in refused["detail"] and "0.8" in refused["detail"]

    registry.platform_evaluation(tenant, v2.digest, "command", {"accuracy": 0.81, "latency_ms": 85})
    assert promote(v2.digest, "staging").status_code == 200
    registry.platform_evaluation(tenant, v2.digest, "sanity", {"nan_inf_count": 0})
    assert promote(v2.digest, "production").status_code == 200
    with tenant.http() as http:
        model = http.get("/v1/models/gated").json()
        assert {a["name"]: a["version"] for a in model["aliases"]} == {
            "candidate": v1.digest,
            "staging": v2.digest,
            "production": v2.digest,
        }
        assert http.get("/v1/models/gated/versions/production").json()["metrics"] == {
            "accuracy": 0.81,
            "latency_ms": 85,
            "nan_inf_count": 0,
        }
        key = http.get("/v1/registry/evaluator-key").json()
    platform = [e for e in _evaluations(tenant, "gated", v2.digest) if e["source"] == "platform"]
    assert {e["key_id"] for e in platform} == {key["key_id"]}  # signed by the platform's key

    unknown = _report(tenant, v2.digest, {"accuracy": 1.0}, signer=Signer.generate())
    assert unknown.status_code == 422 and unknown.json()["errors"][0]["field"] == "key_id"
    mismatch = _report(tenant, v2.digest, {"accuracy": 1.0}, version=v1.digest)
    assert mismatch.status_code == 422 and mismatch.json()["errors"][0]["field"] == "record.version"


def _evaluations(tenant: Tenant, model: str, digest: str) -> list[dict]:
    with tenant.http() as http:
        return http.get(f"/v1/models/{model}/versions/{digest}/evaluations").json()["items"]


def test_promotion_fails_closed_without_gates(registry: Registry, tmp_path: Path) -> None:
    """Issue 37: a model without gates took a version whose sanity evaluation found a NaN straight
    to production. Now a failed latest evaluation, or a NaN, keeps a version from staging and
    production whatever the gates, and production takes only a version sanity has passed."""
    tenant = registry.new_tenant()
    with tenant.http() as http:
        http.post("/v1/models", json={"name": "gated"}).raise_for_status()  # no gates
    digests = [tenant.push(write_model(tmp_path / f"v{i}", random_tensors()), model="gated").digest for i in range(4)]
    unevaluated, crashed, nan, clean = digests

    def promote(digest: str, alias: str) -> httpx.Response:
        with tenant.http() as http:
            return http.put(f"/v1/models/gated/aliases/{alias}", json={"version": digest})

    def refused(digest: str, alias: str) -> dict:
        answer = promote(digest, alias)
        assert answer.status_code == 409 and answer.json()["type"].endswith("/gates-failed"), answer.text
        assert f"/v1/models/gated/versions/{digest}/evaluate" in answer.json()["detail"]  # what to do
        return answer.json()

    assert promote(unevaluated, "staging").status_code == 200
    problem = refused(unevaluated, "production")
    assert "production takes only a version a platform sanity evaluation has passed" in problem["detail"]

    registry.platform_evaluation(tenant, crashed, "sanity", {"nan_inf_count": 0})
    registry.platform_evaluation(tenant, crashed, "command", {}, failure="the command exited with status 1")
    for alias in ("staging", "production"):
        problem = refused(crashed, alias)
        assert [(f["metric"], f["evaluator"]) for f in problem["failing_metrics"]] == [(None, "command")]
        assert "the latest command evaluation failed: the command exited with status 1" in problem["detail"]

    registry.platform_evaluation(tenant, nan, "sanity", {"nan_inf_count": 1})
    for alias in ("staging", "production"):
        [failure] = refused(nan, alias)["failing_metrics"]
        assert (failure["metric"], failure["evaluator"], failure["value"]) == ("nan_inf_count", "sanity", 1.0)
    assert promote(nan, "candidate").status_code == 200  # candidate is the tenant's to move

    registry.platform_evaluation(tenant, clean, "sanity", {"nan_inf_count": 0})
    assert promote(clean, "production").status_code == 200

    # The operator may turn the sanity requirement off; a failed evaluation still holds.
    registry.settings.registry.production_requires_sanity = False
    assert promote(unevaluated, "production").status_code == 200
    assert promote(nan, "production").status_code == 409
    assert promote(crashed, "production").status_code == 409


def test_tenants_cannot_see_each_others_models_versions_or_chunks(registry: Registry, tmp_path: Path) -> None:
    alice, bob = registry.new_tenant(), registry.new_tenant()
    pushed = alice.push(write_model(tmp_path / "v1", random_tensors()))
    chunk = next(iter(pushed.signed.manifest.chunk_ids()))
    with bob.http() as http:
        for path in [
            "/v1/models/llama",
            "/v1/models/llama/versions",
            f"/v1/models/llama/versions/{pushed.digest}",
            f"/v1/models/llama/versions/{pushed.digest}/manifest",
            f"/v1/models/llama/chunks/{chunk}",
            f"/v1/models/llama/versions/{pushed.digest}/ancestors",
        ]:
            response = http.get(path)
            assert response.status_code == 404, path
            assert alice.id not in response.text
        assert http.put("/v1/models/llama/aliases/candidate", json={"version": pushed.digest}).status_code == 404
        assert http.delete(f"/v1/signing-keys/{pushed.signed.key_id}").status_code == 404
        assert http.get("/v1/models").json()["items"] == []
        assert http.get("/v1/signing-keys").json()["items"] == []

        # Bob's own model of the same name: still no way to reach Alice's chunks or versions.
        http.post("/v1/models", json={"name": "llama"}).raise_for_status()
        assert http.get(f"/v1/models/llama/chunks/{chunk}").status_code == 404
        ids = sorted(pushed.signed.manifest.chunk_ids())
        assert http.post("/v1/models/llama/chunks:missing", json={"chunk_ids": ids}).json()["missing"] == ids
        assert http.get(f"/v1/models/llama/versions/{pushed.digest}").status_code == 404
    bob_key = bob.signer  # Bob re-signs Alice's manifest: the chunks are still not his
    with bob.client() as client:
        client.register_key(bob_key)
        with pytest.raises(ApiError) as refused:
            client.post_version("llama", bob_key.sign(pushed.signed.manifest))
    assert refused.value.type == "chunks-missing"


def test_an_evaluations_token_reads_its_versions_and_nothing_else(registry: Registry, tmp_path: Path) -> None:
    """Issue 37, item 1: the evaluation worker holds no store credentials; it reads the version
    it evaluates (and its parent) through the API with a short-lived token the issuer key signed
    for that tenant's model and those versions. Any other version, chunk, model, tenant or route
    is refused; so is the token once expired, or one an API's delegate minted."""
    from gpucloud import bootstrap
    from gpucloud.web.service_tokens import EVALUATION, REGISTRY_READ_AUDIENCE, load_delegate

    alice, bob = registry.new_tenant(), registry.new_tenant()
    v1 = alice.push(write_model(tmp_path / "v1", random_tensors()))
    v2 = alice.push(write_model(tmp_path / "v2", random_tensors()))
    other = bob.push(write_model(tmp_path / "bob", random_tensors()))
    only_v2 = sorted(v2.signed.manifest.chunk_ids() - v1.signed.manifest.chunk_ids())[0]
    issuer = bootstrap.token_issuer(registry.settings)  # the workers' key; the API was started before it existed

    def token(tenant: str, *versions: str, ttl_s: float = 60, minter=issuer) -> str:
        # Its own subject each: the issuer hands out a live token it minted before for the same claims.
        subject = f"evaluation:{uuid.uuid4().hex}"
        return minter.mint(
            REGISTRY_READ_AUDIENCE,
            subject=subject,
            role=EVALUATION,
            tenant=tenant,
            model="llama",
            versions=versions,
            ttl_s=ttl_s,
        )

    def get(bearer: str, path: str) -> httpx.Response:
        return httpx.get(registry.url + path, headers={"Authorization": f"Bearer {bearer}"}, timeout=30)

    scoped = token(alice.id, v1.digest)
    # Its version, through the pull client, verified chunk by chunk.
    keyring = Keyring()
    keyring.trust(alice.id, alice.signer.verify_key)
    with RegistryClient(registry.url, scoped) as client:
        pulled = pull(
            v1.digest,
            tmp_path / "pulled",
            chunk_store=(source := RegistryPullSource(client, "llama")),  # type: ignore[arg-type]
            manifest_store=source,  # type: ignore[arg-type]
            keyring=keyring,
            tenant=alice.id,
        )
    assert pulled.manifest.digest == v1.digest
    # Another version of the same model, or a chunk only it lists: 403.
    assert get(scoped, f"/v1/models/llama/versions/{v2.digest}/manifest").status_code == 403
    refused = get(scoped, f"/v1/models/llama/chunks/{only_v2}")
    assert refused.status_code == 403 and "does not read chunk" in refused.json()["detail"]
    # Another tenant's version or chunk: the token's tenant has none of them.
    assert get(scoped, f"/v1/models/llama/versions/{other.digest}/manifest").status_code == 404
    # One only Bob's version lists (tensors that happen to be equal share a chunk id).
    alices = v1.signed.manifest.chunk_ids() | v2.signed.manifest.chunk_ids()
    bobs_chunk = sorted(other.signed.manifest.chunk_ids() - alices)[0]
    assert get(scoped, f"/v1/models/llama/chunks/{bobs_chunk}").status_code == 403
    assert get(token(bob.id, v1.digest), f"/v1/models/llama/versions/{v1.digest}/manifest").status_code == 404
    # Anything but those two reads: 403, as for a node's agent.
    for path in ["/v1/models", "/v1/models/llama", f"/v1/models/llama/versions/{v1.digest}", "/v1/signing-keys"]:
        assert get(scoped, path).status_code == 403, path
    # Its parent, when named; the parent's chunks too.
    with_parent = token(alice.id, v2.digest, v1.digest)
    assert get(with_parent, f"/v1/models/llama/versions/{v1.digest}/manifest").status_code == 200
    assert get(with_parent, f"/v1/models/llama/chunks/{only_v2}").status_code == 200
    # Expired (past the verifier's leeway), or minted by an API's delegate (not certified for it): 401.
    expired = get(token(alice.id, v1.digest, ttl_s=-120), f"/v1/models/llama/versions/{v1.digest}/manifest")
    assert expired.status_code == 401
    delegate = load_delegate(bootstrap.issue_api_delegate(registry.settings, path=tmp_path / "delegate.pem"))
    minted = token(alice.id, v1.digest, minter=delegate)
    assert get(minted, f"/v1/models/llama/versions/{v1.digest}/manifest").status_code == 401


def test_versions_paginate_and_bad_input_is_a_4xx_naming_the_field(registry: Registry, tmp_path: Path) -> None:
    tenant = registry.new_tenant()
    digests = []
    for i in range(5):
        (tmp_path / f"d{i}").mkdir()
        (tmp_path / f"d{i}" / "weights.bin").write_bytes(os.urandom(100 + i))
        digests.append(tenant.push(tmp_path / f"d{i}").digest)
    with tenant.http() as http:
        seen, token = [], ""
        while True:
            page = http.get(
                "/v1/models/llama/versions", params={"page_size": 2, **({"page_token": token} if token else {})}
            ).json()
            seen += [v["digest"] for v in page["items"]]
            if len(seen) == 2:  # a version pushed mid-listing shifts nothing
                (tmp_path / "late").mkdir()
                (tmp_path / "late" / "w.bin").write_bytes(b"late")
                digests.append(tenant.push(tmp_path / "late").digest)
            if not (token := page["next_page_token"]):
                break
        assert seen == digests

        def field_of(response: httpx.Response, status: int = 422) -> str:
            assert response.status_code == status, response.text
            assert response.headers["content-type"].startswith("application/problem+json")
            return response.json()["errors"][0]["field"] if "errors" in response.json() else response.json()["detail"]

        assert field_of(http.get("/v1/models/llama/versions", params={"page_size": 0})) == "page_size"
        assert "page_token" in field_of(http.get("/v1/models/llama/versions", params={"page_token": "x"}), 400)
        assert field_of(http.post("/v1/models", json={"name": "Not OK"})) == "name"
        assert field_of(
            http.post("/v1/models", json={"name": "m", "gates": [{"metric": "a", "min": 2, "max": 1}]})
        ).startswith("gates.0")
        assert (
            field_of(
                http.post(
                    "/v1/models", json={"name": "m", "gates": [{"metric": "a", "min": 1}, {"metric": "a", "max": 2}]}
                )
            )
            == "gates"
        )
        assert field_of(http.put("/v1/models/llama/aliases/prod", json={"version": digests[0]})) == "alias"
        assert field_of(http.put("/v1/models/llama/aliases/staging", json={"version": "zz"})) == "version"
        assert field_of(http.post("/v1/signing-keys", json={"public_key": "xyz"})) == "public_key"
        assert field_of(http.post("/v1/models/llama/chunks:missing", json={"chunk_ids": ["nope"]})) == "chunk_ids.0"
        manifest = json.loads(tenant.signer.sign(Manifest.build(model="llama", files={})).model_dump_json())
        manifest["manifest"]["files"] = {"../escape": {"size": 0, "chunks": []}}
        assert field_of(http.post("/v1/models/llama/versions", json=manifest)).startswith("manifest.files")

        created = http.post("/v1/models", json={"name": "twice"}, headers={"Idempotency-Key": "k1"})
        replay = http.post("/v1/models", json={"name": "twice"}, headers={"Idempotency-Key": "k1"})
        assert created.status_code == replay.status_code == 201 and replay.content == created.content
        assert http.post("/v1/models", json={"name": "twice"}).status_code == 409


def _weights_cli(registry: Registry, tenant: Tenant):
    """`gpucloud weights ...` as the tenant runs it; each call asserts its exit code, returns the output."""
    env = {
        "GPUCLOUD_API_URL": registry.url,
        "GPUCLOUD_API_KEY": tenant.key,
        # The tenant's keys live in the CLI's config folder (`cli.tenant_keys`), not a data dir.
        "GPUCLOUD_CONFIG": str(tenant.data_dir / "cli" / "config.yaml"),
        "COLUMNS": "200",
    }
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(weights_app, list(args), env=env)
        assert result.exit_code == code, result.output
        return result.output

    return run


@pytest.mark.one_database  # the database only underneath: on SQLite
def test_cli_push_versions_evaluate_promote_pull(registry: Registry, tmp_path: Path) -> None:
    tenant = registry.new_tenant()
    run = _weights_cli(registry, tenant)

    source = write_model(tmp_path / "v1", random_tensors())
    assert "pushed cli-model@" in run("push", str(source), "--model", "cli-model")
    again = run("push", str(source), "--model", "cli-model")
    assert "already existed (the same files and lineage): nothing new was registered" in again
    key_file = tenant.data_dir / "cli" / "signing-keys" / f"{tenant.id}.ed25519"
    assert key_file.stat().st_mode & 0o777 == 0o600  # created on the first push, private
    with tenant.http() as http:
        digest = http.get("/v1/models/cli-model/versions").json()["items"][0]["digest"]
    assert digest[:12] in run("versions", "cli-model")
    run("evaluate", "cli-model", digest[:12], "--metric", "accuracy=0.9")
    refused = run("promote", "cli-model", digest[:12], "--to", "production", code=4)  # nothing the platform ran
    assert "sanity" in refused and "gpucloud weights evaluate cli-model" in refused
    registry.start_worker()
    run("evaluate", "cli-model", digest[:12], "--evaluator", "sanity")
    assert "production" in run("promote", "cli-model", digest[:12], "--to", "production")
    assert json.loads(run("promote", "cli-model", digest[:12], "--to", "staging", "-o", "json"))["version"] == digest
    pulled = json.loads(run("pull", "cli-model@staging", str(tmp_path / "json-out"), "-o", "json").splitlines()[-1])
    assert pulled["digest"] == digest and tree(tmp_path / "json-out") == tree(source)
    run("pull", "cli-model@production", str(tmp_path / "out"))
    assert tree(tmp_path / "out") == tree(source)
    run("promote", "cli-model", digest, "--to", "prod", code=2)

    tenant.chunks.path(next(iter(tenant.chunks.list())).id).write_bytes(b"garbage")
    output = run("pull", f"cli-model@{digest}", str(tmp_path / "bad"), code=2)
    assert "integrity check failed" in output and not (tmp_path / "bad").exists()


def test_s3_backend_by_configuration(registry: Registry, tmp_path: Path, s3_endpoint: str) -> None:
    from gpucloud.bootstrap import registry_stores
    from gpucloud.config import Settings
    from support.s3 import new_bucket

    s3, bucket = new_bucket(s3_endpoint, "weights")
    object_store = {
        "backend": "s3",
        "endpoint_url": s3_endpoint,
        "bucket": bucket,
        "region": "us-east-1",
        "access_key_id": "testing",
        "secret_access_key": "testing",
    }
    registry.app.state.registry_stores = registry_stores(Settings(data_dir=tmp_path, object_store=object_store))
    tenant = registry.new_tenant()
    source = write_model(tmp_path / "v1", random_tensors())
    pushed = tenant.push(source)
    assert tree(tenant.pull(pushed.digest, tmp_path / "out").path) == tree(source)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys and all(k.startswith(f"registry/tenants/{tenant.id}/") for k in keys)
    assert f"registry/tenants/{tenant.id}/manifests/{pushed.digest}.json" in keys


@pytest.mark.one_database  # the database only underneath: on SQLite
def test_demo_weights_scenario(registry: Registry, tmp_path: Path) -> None:
    from rich.console import Console

    from gpucloud.demo.weights import demo_weights

    registry.start_worker()
    tenant = registry.new_tenant()
    console = Console(record=True, width=160)
    pushed = demo_weights(console, registry.url, tenant.key, tmp_path / "demo")
    text = console.export_text()
    assert "refused" in text and "ChunkCorruptedError" in text and "skipped by dedup" in text
    assert f"weight sanity of {pushed.bad[:12]} against {pushed.production[:12]}, platform-signed" in text
    assert "max 0: fails" in text and "layers.7.weight" in text
    with tenant.http() as http:
        model = http.get(f"/v1/models/{pushed.model}").json()
    assert {a["name"]: a["version"] for a in model["aliases"]} == {
        "production": pushed.production,
        "candidate": pushed.bad,
    }


def _age(tenant: Tenant, hours: float = 48) -> None:
    import time

    then = time.time() - hours * 3600
    for info in tenant.chunks.list():
        os.utime(tenant.chunks.path(info.id), (then, then))


def test_operator_gc_removes_only_old_unreferenced_chunks_dry_run_first(registry: Registry, tmp_path: Path) -> None:
    tenant, bystander = registry.new_tenant(), registry.new_tenant()
    source = write_model(tmp_path / "v1", random_tensors())
    outcome = tenant.push(source)
    other = bystander.push(write_model(tmp_path / "other", random_tensors()))
    orphan = os.urandom(3000)
    orphan_id = blake3.blake3(orphan).hexdigest()
    with tenant.http() as http:
        http.put(f"/v1/models/llama/chunks/{orphan_id}", content=orphan).raise_for_status()
        assert http.post("/v1/registry/gc", json={}).status_code == 403  # operators only
    _age(tenant)
    _age(bystander)
    fresh = os.urandom(3000)  # young: inside the grace period, a push may be about to use it
    fresh_id = blake3.blake3(fresh).hexdigest()
    tenant.chunks.put(fresh_id, fresh)

    with httpx.Client(base_url=registry.url, headers={"Authorization": f"Bearer {OPERATOR}"}) as op:
        too_short = op.post("/v1/registry/gc", json={"grace_period_seconds": 60})
        assert too_short.status_code == 422
        assert op.post("/v1/registry/gc", json={"tenant_id": "nobody"}).status_code == 404
        dry = op.post("/v1/registry/gc", json={"dry_run": True, "tenant_id": tenant.id}).json()
        assert dry["dry_run"] and dry["tenants"][0]["deleted_ids"] == [orphan_id]
        assert tenant.chunks.has(orphan_id)
        done = op.post("/v1/registry/gc", json={"grace_period_seconds": 3600}).json()

    by_tenant = {t["tenant_id"]: t for t in done["tenants"]}
    assert by_tenant[tenant.id]["deleted_ids"] == [orphan_id] and by_tenant[tenant.id]["bytes_deleted"] == 3000
    assert by_tenant[tenant.id]["chunks_young"] == 1 and by_tenant[bystander.id]["chunks_deleted"] == 0
    assert done["chunks_deleted"] == 1
    assert not tenant.chunks.has(orphan_id) and tenant.chunks.has(fresh_id)
    assert tree(tenant.pull(outcome.digest, tmp_path / "out").path) == tree(source)
    assert bystander.pull(other.digest, tmp_path / "other-out").path.exists()
    # Each tenant's collection is an operation naming the operator; the dry run left none.
    with session_scope(registry.settings.database_url) as session:  # type: ignore[attr-defined]
        collected = session.exec(
            select(Operation).where(
                col(Operation.kind) == "registry_gc", col(Operation.resource_id).in_([tenant.id, bystander.id])
            )
        ).all()
    assert sorted((o.resource_id, o.actor) for o in collected) == sorted(
        (t, "operator:bootstrap") for t in (tenant.id, bystander.id)
    )


def test_cli_weights_gc(registry: Registry, tmp_path: Path) -> None:
    tenant = registry.new_tenant()
    tenant.push(write_model(tmp_path / "v1", random_tensors()))
    orphan = os.urandom(2000)
    orphan_id = blake3.blake3(orphan).hexdigest()
    tenant.chunks.put(orphan_id, orphan)
    _age(tenant)
    env = {"GPUCLOUD_API_URL": registry.url, "GPUCLOUD_API__OPERATOR_TOKEN": OPERATOR, "COLUMNS": "200"}
    runner = CliRunner()

    as_json = runner.invoke(weights_app, ["gc", "--dry-run", "--tenant", tenant.id, "-o", "json"], env=env)
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["dry_run"] is True
    dry = runner.invoke(weights_app, ["gc", "--dry-run", "--tenant", tenant.id], env=env)
    assert dry.exit_code == 0, dry.output
    assert "would remove 1 chunks" in dry.output and tenant.chunks.has(orphan_id)
    done = runner.invoke(weights_app, ["gc", "--grace", "2h", "--tenant", tenant.id], env=env)
    assert done.exit_code == 0, done.output
    assert "removed 1 chunks" in done.output and not tenant.chunks.has(orphan_id)
    refused = runner.invoke(weights_app, ["gc", "--grace", "5m"], env=env)
    assert refused.exit_code == 2 and "grace_period_seconds" in refused.output  # a 422: bad usage
    assert runner.invoke(weights_app, ["gc", "--grace", "soon"], env=env).exit_code == 2


@pytest.mark.one_database  # the database only underneath: on SQLite
def test_the_platform_evaluates_with_the_sanity_evaluator_and_a_nan_cannot_reach_production(
    registry: Registry, tmp_path: Path
) -> None:
    """Real fp32, fp16 and bf16 models of a few MiB, evaluated by the worker: a clean fine-tune
    passes and is promoted; one NaN, or a shape change, is refused at the gate, through the CLI
    and the API, whatever the tenant reports."""
    import numpy as np

    registry.start_worker()
    tenant = registry.new_tenant()
    run = _weights_cli(registry, tenant)
    with tenant.http() as http:
        gates = [
            {"metric": "nan_inf_count", "max": 0},
            {"metric": "max_rel_norm_change", "max": 0.5},
            {"metric": "shape_changes", "max": 0},
        ]
        http.post("/v1/models", json={"name": "sane", "gates": gates}).raise_for_status()

    def pushed(name: str, *, parent: str | None = None, **shape) -> str:
        source = float_model(tmp_path / name, np.random.default_rng(7), **shape)
        extra = ("--parent", parent[:12]) if parent else ()
        output = run("push", str(source), "--model", "sane", *extra)
        return re.search(r"pushed sane@([0-9a-f]{64})", output).group(1)

    base = pushed("base")
    good = pushed("tuned", parent=base, scale=1.02)
    bad = pushed("broken", parent=base, scale=1.02, nan=True)
    reshaped = pushed("reshaped", parent=base, wide=640)

    failed = run("evaluate", "sane", bad[:12], "--evaluator", "sanity", code=1)
    assert "platform-signed" in failed and f"against {base[:12]}" in failed
    assert "model-00001-of-00002.safetensors:mlp.weight" in failed and "max 0: fails" in failed
    # The tenant's own word does not open the gate: the platform's evaluation holds it.
    run("evaluate", "sane", bad[:12], "--metric", "nan_inf_count=0", "--metric", "max_rel_norm_change=0")
    refused = run("promote", "sane", bad[:12], "--to", "production", code=4)  # refused by the gates
    assert "nan_inf_count" in refused and "sanity" in refused and "above the maximum 0" in refused
    with tenant.http() as http:
        answer = http.put("/v1/models/sane/aliases/production", json={"version": bad})
        assert answer.status_code == 409
        [failure] = answer.json()["failing_metrics"]
        assert (failure["metric"], failure["evaluator"], failure["value"]) == ("nan_inf_count", "sanity", 1.0)
        shown = http.get(f"/v1/models/sane/versions/{bad}").json()
        assert shown["metrics"]["nan_inf_count"] == 1 and shown["reported_metrics"]["nan_inf_count"] == 0

    run("evaluate", "sane", reshaped[:12], code=1)
    refused = run("promote", "sane", reshaped[:12], "--to", "production", code=4)
    assert "shape_changes" in refused

    passed = run("evaluate", "sane", good[:12], "--evaluator", "sanity")
    assert "recorded" in passed and "max_rel_norm_change" in passed and "passes" in passed
    assert "production" in run("promote", "sane", good[:12], "--to", "production")
    listed = run("versions", "sane")
    assert "platform results" in listed and "reported" in listed
    [record] = [e for e in _evaluations(tenant, "sane", good) if e["source"] == "platform"]
    key = registry_evaluator_key(tenant)
    signed = SignedEvaluation(
        record=EvaluationRecord(
            version=record["version"],
            evaluator=record["evaluator"],
            results=record["results"],
            recorded_at=record["recorded_at"],
            details=record["details"],
        ),
        key_id=record["key_id"],
        signature=_stored_signature(registry, tenant, good, record["record_digest"]),
    )
    keyring = Keyring()
    keyring.trust("platform", bytes.fromhex(key["public_key"]))
    assert keyring.verify_evaluation(signed, tenant="platform").results["nan_inf_count"] == 0


def registry_evaluator_key(tenant: Tenant) -> dict:
    with tenant.http() as http:
        return http.get("/v1/registry/evaluator-key").json()


def _stored_signature(registry: Registry, tenant: Tenant, digest: str, record_digest: str) -> str:
    from gpucloud import bootstrap

    kept = bootstrap.registry_stores(registry.settings).manifests(tenant.id).evaluations(digest)
    return next(e.signature for e in kept if e.record.digest == record_digest)


@pytest.mark.one_database  # the database only underneath: on SQLite
def test_the_platform_runs_the_models_command_and_a_hanging_or_garbage_command_fails_its_gate(
    registry: Registry, tmp_path: Path
) -> None:
    import numpy as np

    registry.start_worker()
    tenant = registry.new_tenant()
    run = _weights_cli(registry, tenant)
    with tenant.http() as http:
        http.post(
            "/v1/models", json={"name": "scored", "gates": [{"metric": "accuracy", "min": 0.7}]}
        ).raise_for_status()
        assert http.post("/v1/models/scored/versions/abcdef12/evaluate", json={}).status_code == 404
        wrong = http.post("/v1/models/scored/versions/abcdef12/evaluate", json={"evaluator": "mmlu"})
        assert wrong.status_code == 422 and wrong.json()["errors"][0]["field"] == "evaluator"
    source = float_model(tmp_path / "v1", np.random.default_rng(1))
    digest = re.search(r"pushed scored@([0-9a-f]{64})", run("push", str(source), "--model", "scored")).group(1)
    with tenant.http() as http:
        missing = http.post(f"/v1/models/scored/versions/{digest}/evaluate", json={"evaluator": "command"})
        assert missing.status_code == 409 and "PUT /v1/models/scored/evaluation" in missing.json()["detail"]

    # The command reads the pulled version it is given and prints its metrics as its last line.
    script = (
        "import json, os, pathlib; "
        "files = sorted(pathlib.Path(os.environ['GPUCLOUD_MODEL_DIR']).glob('*.safetensors')); "
        "print('scoring', len(files)); print(json.dumps({'accuracy': 0.4 + 0.2 * len(files)}))"
    )
    run("evaluation-command", "scored", "--run", f"{sys.executable} -c {shlex.quote(script)}", "--timeout", "60")
    passed = run("evaluate", "scored", digest[:12], "--evaluator", "command")
    assert "accuracy" in passed and "0.8" in passed and "min 0.7: passes" in passed
    run("evaluate", "scored", digest[:12], "--evaluator", "sanity")  # production takes a version sanity passed
    assert "production" in run("promote", "scored", digest[:12], "--to", "production")

    run("evaluation-command", "scored", "--run", f"{sys.executable} -c 'import time; time.sleep(60)'", "--timeout", "2")
    hung = run("evaluate", "scored", digest[:12], "--evaluator", "command", code=1)
    assert "ran past its time limit of 2 s" in hung
    refused = run("promote", "scored", digest[:12], "--to", "staging", code=4)
    assert "the latest command evaluation failed" in refused

    run("evaluation-command", "scored", "--run", "echo all good")
    garbage = run("evaluate", "scored", digest[:12], "--evaluator", "command", code=1)
    assert "not JSON" in garbage
    run("evaluation-command", "scored", "--remove")
    run("evaluation-command", "scored", "--run", "true", "--env", "NO_VALUE", code=2)  # not NAME=VALUE


async def _orphaned_evaluation(registry: Registry, tmp_path: Path):
    """What the API leaves when it dies between committing an evaluation's operation and starting
    its workflow: a version pushed and a running operation with no workflow. The tenant, the
    version and the operation."""
    import numpy as np

    from gpucloud.db import Database
    from gpucloud.models.registry_names import EvaluatorName
    from gpucloud.services.registry_versions import evaluation_operation

    tenant = registry.new_tenant()
    with tenant.http() as http:
        http.post("/v1/models", json={"name": "llama"}).raise_for_status()
    # A small model: the push is the setting here, not what is tested.
    pushed = await asyncio.to_thread(tenant.push, float_model(tmp_path / "v1", np.random.default_rng(2), wide=64))
    db = Database(registry.settings.database_url)
    _, op = evaluation_operation(db, tenant.id, "llama", pushed.digest, EvaluatorName.SANITY, f"tenant:{tenant.id}")
    return tenant, pushed, db, op


def _orphan_aged(database_url: str, op_id: str) -> None:
    """The operation as if its API died a minute ago."""
    with session_scope(database_url) as session:
        row = session.exec(select(Operation).where(col(Operation.id) == op_id)).one()
        row.created_at -= timedelta(minutes=1)
        session.add(row)


async def test_an_evaluation_without_a_workflow_is_adopted_once_older_than_the_apis_window(
    registry: Registry, temporal_env, tmp_path: Path
) -> None:
    """The sweep's query on each database: an orphan younger than the API's window between commit
    and start is left alone; older, its workflow is started, once."""
    from gpucloud.adapters.temporal_gateway import running_workflow_ids
    from gpucloud.models.workflow_ids import VERSION_EVALUATION_WORKFLOW, evaluation_workflow_id
    from gpucloud.services.recovery import adopt_orphans

    tenant, _, db, op = await _orphaned_evaluation(registry, tmp_path)
    assert await adopt_orphans(temporal_env.client, db, registry.settings) == 0  # too young: the API's
    _orphan_aged(registry.settings.database_url, op.id)
    assert await adopt_orphans(temporal_env.client, db, registry.settings) == 1
    workflow_id = evaluation_workflow_id(tenant.id, op.id)
    handle = temporal_env.client.get_workflow_handle(workflow_id)
    try:
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        # The sweep reads what runs from Temporal's visibility, which follows a start by moments:
        # once it lists the workflow, the next sweep starts nothing.
        for _ in range(100):
            if workflow_id in await running_workflow_ids(temporal_env.client, [VERSION_EVALUATION_WORKFLOW]):
                break
            await asyncio.sleep(0.1)
        else:  # `support.stack.async_wait_until` asks a thread, and this client lives on this loop
            raise AssertionError(f"Temporal's visibility never listed {workflow_id} as running")
        assert await adopt_orphans(temporal_env.client, db, registry.settings) == 0  # running: not again
    finally:
        await handle.terminate("test over: no worker runs this task queue")


@pytest.mark.one_database  # the sweep's query runs on both above; this is the run it starts
async def test_an_evaluation_whose_workflow_never_started_is_adopted_by_the_sweep(
    registry: Registry, temporal_env, tmp_path: Path
) -> None:
    """The API committed the evaluation's operation and died before starting its workflow: the
    sweep's adoption starts it, and the platform's record appears."""
    from gpucloud.services.recovery import adopt_orphans

    registry.start_worker()
    tenant, pushed, db, op = await _orphaned_evaluation(registry, tmp_path)
    _orphan_aged(registry.settings.database_url, op.id)
    assert await adopt_orphans(temporal_env.client, db, registry.settings) == 1

    with tenant.http() as http:
        state = await async_wait_until(
            lambda: settled_operation(http, op.id), timeout_s=60, interval_s=0.2, what="the adopted evaluation"
        )
    assert state["status"] == "succeeded", state
    [record] = _evaluations(tenant, "llama", pushed.digest)
    assert (record["source"], record["evaluator"], record["results"]["nan_inf_count"]) == ("platform", "sanity", 0)


@pytest.mark.one_database  # the database only underneath: on SQLite
@pytest.mark.parametrize(
    ("command", "field"),
    [
        ({"argv": ["true"], "image": "--privileged"}, "image"),
        ({"argv": ["sh"], "image": "alpine --privileged"}, "image"),
        ({"argv": ["--volume=/:/host", "alpine", "sh"]}, "argv"),
        ({"argv": ["--privileged"], "image": "alpine"}, "argv"),
        ({"argv": ["sh", "a\x00b"], "image": "alpine"}, "argv.1"),
        ({"argv": ["sh"], "image": "alpine", "env": {"--volume": "/:/host"}}, "env.--volume.[key]"),
    ],
)
def test_an_evaluation_command_that_could_read_as_a_runtime_option_is_refused(
    registry: Registry, command: dict, field: str
) -> None:
    """Nothing a tenant registers reaches `<runtime> run` where the runtime reads an option."""
    tenant = registry.new_tenant()
    with tenant.http() as http:
        http.post("/v1/models", json={"name": "hostile"}).raise_for_status()
        refused = http.put("/v1/models/hostile/evaluation", json=command)
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["field"] == field
        assert http.get("/v1/models/hostile").json()["evaluation"] is None
