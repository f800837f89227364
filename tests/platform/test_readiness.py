"""`/readyz`'s checks of what a deployment prepares once. Temporal: the frontend's health every
probe; the namespace and the search attributes only until they are found once (registered, they
stay), since every load balancer probes every few seconds. The object store (API, worker): its
bucket, named with `gpucloud prepare` while it is missing, asked until found once, each probe
bounded and never doubled. The ledger's price book: `tests/billing/test_ledger_service.py`."""

from __future__ import annotations

import asyncio
import shutil
import threading
import uuid
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from gpucloud.config import Settings
from gpucloud.models import search_attributes
from gpucloud.storage.objects import StoreMissingError
from gpucloud.web import readiness as readiness_module
from gpucloud.web.readiness import Check, object_store_check, readiness, temporal_check

pytestmark = pytest.mark.unit


class FakeTemporal:
    def __init__(self, attributes: set[str]) -> None:
        self.namespace, self.attributes, self.listed, self.health_checks = "default", attributes, 0, 0
        self.service_client = SimpleNamespace(
            check_health=self._health, operator_service=SimpleNamespace(list_search_attributes=self._list)
        )

    async def _health(self, **_options) -> bool:
        self.health_checks += 1
        return True

    async def _list(self, request):
        self.listed += 1
        return SimpleNamespace(custom_attributes=dict.fromkeys(self.attributes, 1))


async def test_the_search_attributes_are_listed_until_found_then_only_health_is_checked():
    temporal = FakeTemporal(set())
    check = temporal_check(lambda: temporal)
    with pytest.raises(RuntimeError, match="run `gpucloud prepare`"):
        await check()
    temporal.attributes = {key.name for key in search_attributes.ALL}
    for _ in range(3):
        await check()
    assert (temporal.listed, temporal.health_checks) == (2, 4)


async def readiness_of(checks: dict[str, Check]) -> dict[str, str]:
    """Each check's verdict, as `/readyz` reports it."""
    import json

    return json.loads((await readiness(checks)).body)["checks"]


# ---------------------------------------------------------------- the object store


@pytest.fixture
def no_bucket(s3_endpoint, tmp_path, monkeypatch) -> Settings:
    """A deployment whose S3 bucket was never made (`gpucloud prepare` not run)."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    store = {"backend": "s3", "bucket": f"unmade-{uuid.uuid4().hex[:8]}", "endpoint_url": s3_endpoint}
    return Settings(data_dir=tmp_path, object_store={**store, "region": "us-east-1"})


def _names_the_bucket(settings: Settings, why: str) -> None:
    assert why.startswith(f"StoreMissingError: bucket {settings.object_store.bucket} at http"), why
    assert "(NoSuchBucket): run `gpucloud prepare` to create it" in why


async def test_the_bucket_is_looked_for_until_found_then_taken_as_there(no_bucket: Settings) -> None:
    from gpucloud.bootstrap import object_store, s3_client

    store = object_store(no_bucket)
    probes = 0
    probe = store.probe

    def counted() -> None:
        nonlocal probes
        probes += 1
        probe()

    store.probe = counted  # type: ignore[method-assign]
    check = object_store_check(store)
    for _ in range(2):
        _names_the_bucket(no_bucket, (await readiness_of({"object store": check}))["object store"])
    s3_client(no_bucket).create_bucket(Bucket=no_bucket.object_store.bucket)
    for _ in range(3):
        assert (await readiness_of({"object store": check}))["object store"] == "ok"
    assert probes == 3  # two refused, one found; then no more calls to S3


async def test_a_probe_that_hangs_is_bounded_and_never_doubled(monkeypatch) -> None:
    """A store that does not answer: `/readyz` answers in its bounded time, and the next
    probe waits for the one still running rather than starting another thread."""
    monkeypatch.setattr(readiness_module, "CHECK_TIMEOUT_S", 0.2)
    release, started = threading.Event(), []

    class Hung:
        def probe(self) -> None:
            started.append(1)
            release.wait(10)

    check = object_store_check(Hung())  # type: ignore[arg-type]
    try:
        for _ in range(3):
            assert (await readiness_of({"object store": check}))["object store"] == "no answer within 0.2 s"
        assert len(started) == 1
    finally:
        release.set()
    await asyncio.sleep(0.1)
    assert (await readiness_of({"object store": check}))["object store"] == "ok"


def test_the_api_is_not_ready_without_its_bucket(no_bucket: Settings) -> None:
    from gpucloud.api.app import create_app

    temporal = FakeTemporal({key.name for key in search_attributes.ALL})
    with TestClient(create_app(no_bucket, temporal=temporal), raise_server_exceptions=False) as client:  # type: ignore[arg-type]
        answer = client.get("/readyz")
    assert answer.status_code == 503 and answer.headers["retry-after"]
    checks = answer.json()["checks"]
    assert (checks["database"], checks["temporal"]) == ("ok", "ok")
    _names_the_bucket(no_bucket, checks["object store"])
    assert f"object store: StoreMissingError: bucket {no_bucket.object_store.bucket}" in answer.json()["detail"]


async def test_the_worker_is_not_ready_without_its_bucket(no_bucket: Settings) -> None:
    from gpucloud import bootstrap
    from gpucloud.devstack.stack import free_port
    from gpucloud.workers.main import serve_worker_http

    settings = no_bucket.model_copy(
        update={"telemetry": no_bucket.telemetry.model_copy(update={"worker_port": free_port()})}
    )
    cp = bootstrap.control_plane(settings)
    temporal = FakeTemporal({key.name for key in search_attributes.ALL})
    server, serving = serve_worker_http(settings, cp, temporal, before_scrape=lambda: None)  # type: ignore[arg-type]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.telemetry.worker_port}") as http:
            for _ in range(100):
                if server.started:
                    break
                await asyncio.sleep(0.05)
            answer = await http.get("/readyz", timeout=10)
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        await cp.aclose()
    assert answer.status_code == 503
    checks = answer.json()["checks"]
    assert (checks["database"], checks["temporal"]) == ("ok", "ok")
    _names_the_bucket(settings, checks["object store"])


def test_a_local_store_whose_directory_is_gone_is_not_ready(tmp_path) -> None:
    from gpucloud.storage.local import LocalObjectStore

    store = LocalObjectStore(tmp_path / "objects")
    store.probe()
    shutil.rmtree(tmp_path / "objects")
    with pytest.raises(StoreMissingError, match="run `gpucloud prepare` to create it"):
        store.probe()
