"""Activities over the object store that holds tenant storage (S3 or a local directory).

Onboarding gives the tenant its prefix (`tenants/<tenant id>/`) and data key, and proves both
work by sealing a small record there and opening it again. Offboarding marks the storage for
deletion after the retention period and purges it when due; undoing a failed onboarding purges
at once. Every step is idempotent: the data key is created only if missing, and deleting what is
already gone is no error. The store's errors are transient (retried); a store that does not
exist (its bucket never made) is retried too, as `StoreMissing`, whose message names the bucket
and `gpucloud prepare` (see `_store_missing`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from temporalio import activity
from temporalio.exceptions import ApplicationError

from gpucloud.activities import ActivityGroup
from gpucloud.activities.faults import FaultHook, reach
from gpucloud.models.tables import utcnow
from gpucloud.models.tenant_messages import (
    StorageDeletion,
    StorageDeletionInput,
    TenantRef,
    TenantStorageResult,
)
from gpucloud.storage import retention
from gpucloud.storage.objects import StoreMissingError
from gpucloud.storage.tenant import TenantStore

TENANT_RECORD = ".gpucloud/tenant.json"


@contextmanager
def _store_missing(tenant_id: str) -> Iterator[None]:
    """A missing bucket as the failure Temporal records: what is missing and what makes it.

    Retryable, unlike a refusal for good: the bucket is the deployment's, not the tenant's, and
    the fix is an operator's `gpucloud prepare`, after which the next attempt succeeds and the
    onboarding carries on where it was (within its deadline) instead of being undone and sent
    again. Until then every attempt fails with this message, which the Web UI shows on the
    pending activity, so the wait is never a silent one."""
    try:
        yield
    except StoreMissingError as exc:
        raise ApplicationError(f"tenant {tenant_id}'s storage: {exc}", type="StoreMissing") from exc


class TenantStorageActivities(ActivityGroup):
    def __init__(self, store: TenantStore, *, fault_hook: FaultHook | None = None) -> None:
        self.store = store
        self.fault_hook = fault_hook

    @activity.defn
    def provision_tenant_storage(self, req: TenantRef) -> TenantStorageResult:
        reach(self.fault_hook, "provision_tenant_storage", "before", req.tenant_id)
        storage = self.store.tenant(req.tenant_id)
        record = json.dumps({"tenant_id": req.tenant_id}).encode()
        with _store_missing(req.tenant_id):
            version = self.store.keys.ensure(req.tenant_id)
            storage.put_encrypted(TENANT_RECORD, record)
            read_back = storage.get_encrypted(TENANT_RECORD)
        if read_back != record:
            raise ApplicationError(
                f"tenant {req.tenant_id}'s storage does not read back what was written",
                type="StorageVerificationFailed",
            )
        reach(self.fault_hook, "provision_tenant_storage", "after", req.tenant_id)
        return TenantStorageResult(tenant_id=req.tenant_id, prefix=storage.prefix, data_key_version=version)

    @activity.defn
    def delete_tenant_storage(self, req: TenantRef) -> StorageDeletion:
        """Undo `provision_tenant_storage` now: data key first, then the objects."""
        reach(self.fault_hook, "delete_tenant_storage", "before", req.tenant_id)
        with _store_missing(req.tenant_id):
            deleted = retention.purge_tenant(self.store.backend, self.store.keys, req.tenant_id)
        reach(self.fault_hook, "delete_tenant_storage", "after", req.tenant_id)
        return StorageDeletion(tenant_id=req.tenant_id, objects_deleted=deleted)

    @activity.defn
    def schedule_tenant_storage_deletion(self, req: StorageDeletionInput) -> StorageDeletion:
        with _store_missing(req.tenant_id):
            due = retention.mark_for_deletion(
                self.store.backend, req.tenant_id, now=utcnow(), retention=timedelta(seconds=req.retention_s)
            )
        return StorageDeletion(tenant_id=req.tenant_id, due_at=due)

    @activity.defn
    def purge_tenant_storage(self, req: TenantRef) -> StorageDeletion:
        """Delete the storage once its mark is due (a retry until then); nothing once it is gone."""
        with _store_missing(req.tenant_id):
            due = retention.deletion_due(self.store.backend, req.tenant_id)
        if due is None:
            return StorageDeletion(tenant_id=req.tenant_id)
        if due > utcnow():
            raise ApplicationError(
                f"tenant {req.tenant_id}'s storage is kept until {due.isoformat()}", type="NotDueYet"
            )
        with _store_missing(req.tenant_id):
            deleted = retention.purge_tenant(self.store.backend, self.store.keys, req.tenant_id)
        return StorageDeletion(tenant_id=req.tenant_id, due_at=due, objects_deleted=deleted)
