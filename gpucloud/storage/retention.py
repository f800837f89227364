"""Tenant deletion after a retention period: offboarding marks the tenant's storage, and a
periodic purge deletes every object under its prefix and its data key once the mark is due.

Marks are small records under `control/deletions/`, outside every tenant prefix. Deleting the
key record last would leave readable data if the purge died midway, so it goes first: whatever
objects remain are then unreadable ciphertext (for sealed blobs) until the next purge run.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from gpucloud.storage.envelope import TenantKeys
from gpucloud.storage.objects import ObjectMissingError, ObjectStore
from gpucloud.storage.tenant import tenant_prefix

DELETION_MARKS = "control/deletions/"


def _mark_key(tenant_id: str) -> str:
    tenant_prefix(tenant_id)
    return f"{DELETION_MARKS}{tenant_id}.json"


def mark_for_deletion(
    backend: ObjectStore,
    tenant_id: str,
    *,
    now: datetime,
    retention: timedelta,
) -> datetime:
    """Schedule the tenant's storage for deletion; idempotent, keeps the first due time."""
    due = deletion_due(backend, tenant_id)
    if due is None:
        due = now + retention
        backend.put(_mark_key(tenant_id), json.dumps({"tenant_id": tenant_id, "due_at": due.isoformat()}).encode())
    return due


def cancel_deletion(backend: ObjectStore, tenant_id: str) -> None:
    backend.delete(_mark_key(tenant_id))


def pending_deletions(backend: ObjectStore) -> dict[str, datetime]:
    marks = (json.loads(backend.get(key)) for key in backend.list_keys(DELETION_MARKS))
    return {mark["tenant_id"]: datetime.fromisoformat(mark["due_at"]) for mark in marks}


def purge_due(backend: ObjectStore, keys: TenantKeys, *, now: datetime) -> list[str]:
    """Delete the storage of every tenant whose mark is due; the tenants purged."""
    purged = []
    for tenant_id, due in sorted(pending_deletions(backend).items()):
        if due > now:
            continue
        purge_tenant(backend, keys, tenant_id)
        purged.append(tenant_id)
    return purged


def deletion_due(backend: ObjectStore, tenant_id: str) -> datetime | None:
    """When the tenant's storage is due for deletion; None when it is not marked."""
    try:
        return datetime.fromisoformat(json.loads(backend.get(_mark_key(tenant_id)))["due_at"])
    except ObjectMissingError:
        return None


def purge_tenant(backend: ObjectStore, keys: TenantKeys, tenant_id: str) -> int:
    """Delete the tenant's data key, every object under its prefix, then its mark (idempotent);
    the number of objects deleted. Also what undoing a failed onboarding runs."""
    keys.forget(tenant_id)
    objects = backend.list_keys(tenant_prefix(tenant_id))
    for key in objects:
        backend.delete(key)
    cancel_deletion(backend, tenant_id)
    return len(objects)
