"""Per-tenant quota on the bytes a tenant's registry store holds.

Usage is a counter per tenant (`StorageUsage`). An upload of a chunk the store lacks reserves
its size before any byte of the body is read, in one conditional UPDATE (`bytes = bytes + n
WHERE bytes + n <= quota`): the check and the add are one statement, so uploads racing each other
can never take the count past the quota together (Postgres re-checks the condition on the row it
waited for; SQLite has one writer at a time). An upload that stores nothing (the bytes did not
hash to the id, the client went away, the chunk arrived meanwhile from another upload) gives its
reservation back. An upload that would pass the quota is refused with a 409 naming the quota and
the usage, before anything is written.

Every garbage collection of the tenant measures the store again (what it listed, less what it
deleted), which also corrects any drift, such as a reservation a crashed API process never gave back.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlmodel import Session, col

from gpucloud.db import Database, rowcount
from gpucloud.models.registry_tables import StorageUsage
from gpucloud.models.tables import utcnow
from gpucloud.services.errors import QuotaExceeded

_RETRIES = 3  # the row is made by whichever writer comes first; a loser of that race tries again


def usage(db: Database, tenant_id: str) -> int:
    with db.reads() as session:
        return usage_in(session, tenant_id)


def usage_in(session: Session, tenant_id: str) -> int:
    row = session.get(StorageUsage, tenant_id)
    return row.bytes if row is not None else 0


def reserve(db: Database, tenant_id: str, size: int, quota: int) -> None:
    """Count `size` more bytes for the tenant, or raise a 409 (counting nothing) if they would
    take it past `quota`."""
    used = col(StorageUsage.bytes)
    fits = sa.update(StorageUsage).where(col(StorageUsage.tenant_id) == tenant_id, used + size <= quota)
    for _ in range(_RETRIES):
        with db.session() as session:
            if rowcount(session.execute(fits.values(bytes=used + size))) == 1:
                return
            row = session.get(StorageUsage, tenant_id)
            in_use = row.bytes if row is not None else 0
            if in_use + size > quota:
                raise _over_quota(size, quota, in_use)
            if row is not None:  # made (or given back to) by another upload since the UPDATE
                continue
            try:
                with session.begin_nested():
                    session.add(StorageUsage(tenant_id=tenant_id, bytes=size))
                return
            except sa.exc.IntegrityError:
                continue
    raise RuntimeError(f"the storage usage row of tenant {tenant_id} could not be written")


def release(db: Database, tenant_id: str, size: int) -> None:
    """Give back a reservation of `size` bytes whose upload stored nothing."""
    used = col(StorageUsage.bytes)
    with db.session() as session:
        # Never below zero: a garbage collection may have measured the store since the reservation.
        less = sa.case((used >= size, used - size), else_=0)
        session.execute(sa.update(StorageUsage).where(col(StorageUsage.tenant_id) == tenant_id).values(bytes=less))


def _over_quota(size: int, quota: int, used: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"this chunk ({size} bytes) would take the registry storage to {used + size} bytes, past the "
        f"quota of {quota} bytes (in use: {used}); delete versions and run gc, or ask for a larger quota",
        type_="storage-quota-exceeded",
        title="Storage quota exceeded",
        quota_bytes=quota,
        usage_bytes=used,
    )


def measured(db: Database, tenant_id: str, size: int) -> None:
    """The store, as a garbage collection just measured it, holds `size` bytes."""
    now = utcnow()
    _write(db, tenant_id, sa.update(StorageUsage).values(bytes=size, measured_at=now), size, now)


def _write(db: Database, tenant_id: str, update, size: int, measured_at) -> None:
    for _ in range(_RETRIES):
        with db.session() as session:
            if rowcount(session.execute(update.where(col(StorageUsage.tenant_id) == tenant_id))) == 1:
                return
            try:
                with session.begin_nested():
                    session.add(StorageUsage(tenant_id=tenant_id, bytes=size, measured_at=measured_at))
                return
            except sa.exc.IntegrityError:
                continue
