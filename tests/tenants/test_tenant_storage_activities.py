"""The tenant storage activities over the store the settings choose: S3 (moto's server, real
HTTP) and the local directory. Provisioning is idempotent, tenants' data keys are their own, and
deletion (at once, or when the retention mark is due) leaves nothing of the tenant. A bucket
that does not exist fails each step with a message that names it and the fix."""

from __future__ import annotations

import base64

import pytest
from cryptography.exceptions import InvalidTag
from temporalio.api.failure.v1 import Failure
from temporalio.converter import DataConverter
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from gpucloud.activities.storage import TENANT_RECORD, TenantStorageActivities
from gpucloud.bootstrap import object_store, tenant_store
from gpucloud.config import Settings
from gpucloud.models.tenant_messages import StorageDeletionInput, TenantRef
from gpucloud.storage.envelope import MasterKeys
from gpucloud.storage.objects import StoreMissingError
from support.s3 import new_bucket

pytestmark = pytest.mark.integration


@pytest.fixture(params=["s3", "local"])
def settings(request, tmp_path, monkeypatch) -> Settings:
    if request.param == "local":
        return Settings(data_dir=tmp_path)
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        monkeypatch.setenv(name, value)
    endpoint = request.getfixturevalue("s3_endpoint")
    _, bucket = new_bucket(endpoint, "tenants")
    master = base64.b64encode(MasterKeys.generate_key()).decode()
    return Settings(
        data_dir=tmp_path,
        object_store={"backend": "s3", "bucket": bucket, "endpoint_url": endpoint},
        tenants={"storage_master_key": master},
    )


def test_provision_delete_and_retention(settings: Settings) -> None:
    store = tenant_store(settings)
    steps = TenantStorageActivities(store)
    acme, globex = TenantRef(tenant_id="ten_acme"), TenantRef(tenant_id="ten_globex")
    first = steps.provision_tenant_storage(acme)
    assert steps.provision_tenant_storage(acme) == first  # a retry finds the same key version
    steps.provision_tenant_storage(globex)
    assert first.prefix == "tenants/ten_acme/"
    record_key = f"{first.prefix}{TENANT_RECORD}"
    blob = store.backend.get(record_key)
    assert store.keys.decrypt("ten_acme", blob, context=record_key)
    with pytest.raises(InvalidTag):
        store.keys.decrypt("ten_globex", blob, context=record_key)

    store.tenant("ten_acme").put("data/x", b"1")
    mark = steps.schedule_tenant_storage_deletion(StorageDeletionInput(tenant_id="ten_acme", retention_s=3600))
    with pytest.raises(ApplicationError, match="kept until"):
        steps.purge_tenant_storage(acme)  # not due yet: the workflow's retry waits
    assert (
        steps.schedule_tenant_storage_deletion(StorageDeletionInput(tenant_id="ten_acme", retention_s=0)).due_at
        == mark.due_at
    )  # the first mark holds

    undone = steps.delete_tenant_storage(acme)
    assert undone.objects_deleted == 2
    assert store.backend.list_keys("tenants/ten_acme/") == [] and store.keys.tenants() == ["ten_globex"]
    assert steps.purge_tenant_storage(acme).objects_deleted == 0  # nothing marked, nothing left
    assert steps.delete_tenant_storage(acme).objects_deleted == 0
    assert store.tenant("ten_globex").get_encrypted(TENANT_RECORD)


@pytest.fixture
def no_bucket(s3_endpoint, tmp_path, monkeypatch) -> Settings:
    """S3 settings naming a bucket nobody made: a deployment before `gpucloud prepare`."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    return Settings(
        data_dir=tmp_path,
        object_store={"backend": "s3", "bucket": "never-made", "endpoint_url": s3_endpoint, "region": "us-east-1"},
        tenants={"storage_master_key": base64.b64encode(MasterKeys.generate_key()).decode()},
    )


async def test_a_missing_bucket_reaches_temporal_as_itself(no_bucket: Settings) -> None:
    """What Temporal records for the failed attempt (the worker turns the error into a failure with
    this same converter) names the bucket, NoSuchBucket and `gpucloud prepare`; it was
    `maximum recursion depth exceeded` when the store raised boto3's error from itself."""
    steps = TenantStorageActivities(tenant_store(no_bucket))
    failures = []
    for step, arg in (
        (steps.provision_tenant_storage, TenantRef(tenant_id="ten_acme")),
        (steps.delete_tenant_storage, TenantRef(tenant_id="ten_acme")),
        (steps.schedule_tenant_storage_deletion, StorageDeletionInput(tenant_id="ten_acme", retention_s=0)),
        (steps.purge_tenant_storage, TenantRef(tenant_id="ten_acme")),
    ):
        with pytest.raises(ApplicationError) as raised:
            await ActivityEnvironment().run(step, arg)
        failure = Failure()
        await DataConverter.default.encode_failure(raised.value, failure)
        failures.append(failure)
    for failure in failures:
        assert "bucket never-made" in failure.message and "(NoSuchBucket)" in failure.message, failure.message
        assert "run `gpucloud prepare` to create it" in failure.message
        # Retried (an operator's fix lets the same attempt succeed), not failed for good.
        info = failure.application_failure_info
        assert (info.type, info.non_retryable) == ("StoreMissing", False)


def test_every_call_of_the_s3_store_names_a_missing_bucket(no_bucket: Settings) -> None:
    store = object_store(no_bucket)
    calls = {
        "put": lambda: store.put("a/b", b"x"),
        "get": lambda: store.get("a/b"),
        "scan": lambda: list(store.scan("a/")),
        "delete": lambda: store.delete("a/b"),
        "multipart": lambda: store.put_stream("a/big", [b"x" * (17 << 20)]),
        "probe": store.probe,
    }
    for name, call in calls.items():
        with pytest.raises(StoreMissingError, match="bucket never-made at http") as raised:
            call()
        assert raised.value.__cause__ is not raised.value, name  # a cycle Temporal cannot convert
