"""Per-tenant quota on the bytes a tenant's registry store holds.

Usage is a counter per tenant (`StorageUsage`): an upload that stores a new chunk adds its
size; every garbage collection of the tenant measures the store again (what it listed, less
what it deleted), which also corrects any drift. An upload that would take the tenant past its
quota is refused with a 409 naming the quota and the usage, before anything is written.
Uploads running at the same moment are admitted against the same count, so a tenant can pass
its quota by at most its concurrent uploads' sizes.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlmodel import Session, col

from gpucloud.db import read_scope, rowcount, session_scope
from gpucloud.models.registry_tables import StorageUsage
from gpucloud.models.tables import utcnow
from gpucloud.web.problems import Problem


def usage(db_url: str, tenant_id: str) -> int:
    with read_scope(db_url) as session:
        return usage_in(session, tenant_id)


def usage_in(session: Session, tenant_id: str) -> int:
    row = session.get(StorageUsage, tenant_id)
    return row.bytes if row is not None else 0


def admit(session: Session, tenant_id: str, size: int, quota: int) -> None:
    """Raise a 409 if storing `size` more bytes would take the tenant past `quota`."""
    used = usage_in(session, tenant_id)
    if used + size > quota:
        raise Problem(
            409,
            "storage-quota-exceeded",
            "Storage quota exceeded",
            f"this chunk ({size} bytes) would take the registry storage to {used + size} bytes, past the "
            f"quota of {quota} bytes (in use: {used}); delete versions and run gc, or ask for a larger quota",
            quota_bytes=quota,
            usage_bytes=used,
        )


def add(db_url: str, tenant_id: str, size: int) -> None:
    """Count `size` more bytes stored for the tenant."""
    _write(db_url, tenant_id, sa.update(StorageUsage).values(bytes=col(StorageUsage.bytes) + size), size, None)


def measured(db_url: str, tenant_id: str, size: int) -> None:
    """The store, as a garbage collection just measured it, holds `size` bytes."""
    now = utcnow()
    _write(db_url, tenant_id, sa.update(StorageUsage).values(bytes=size, measured_at=now), size, now)


def _write(db_url: str, tenant_id: str, update, size: int, measured_at) -> None:
    for _ in range(3):  # the row is made by whichever writer comes first
        with session_scope(db_url) as session:
            if rowcount(session.execute(update.where(col(StorageUsage.tenant_id) == tenant_id))) == 1:
                return
            try:
                with session.begin_nested():
                    session.add(StorageUsage(tenant_id=tenant_id, bytes=size, measured_at=measured_at))
                return
            except sa.exc.IntegrityError:
                continue
