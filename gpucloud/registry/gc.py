"""Garbage collection: delete the chunks no version needs, and only those.

A chunk is deleted when all of these hold:
- no stored manifest references it (a manifest that cannot be read stops the run: GC fails safe);
- no live push lease lists it (a lease is live while renewed within `lease_ttl`);
- it is older than the grace period, by the store's own clock (file mtime, S3 LastModified).

Leases close the race with a push that reuses a chunk GC is about to delete. A push writes its
lease before it asks whether any chunk exists and removes it only after its manifest landed, and
GC reads the leases *before* the manifests, so every push is visible to GC as a lease, a
manifest, or both. A push that starts after GC read the leases is caught by two rules: GC
re-reads leases and new manifests at least every `GC_BATCH_SECONDS` while it deletes, and a push
that reused chunks waits until `LEASE_SETTLE_SECONDS` (twice that bound) have passed since it
wrote its lease, then checks those chunks are still there and uploads any that are not, before
it writes its manifest. The remaining assumption is that a GC process is not paused for longer
than the settle margin between its last re-read and a delete.

A writer that cannot wait the settle time on every call (the API registering a version pushed
over HTTP) uses `holding` instead: it writes its lease, and waits only if a deleting GC run has
marked itself as running. A run writes that mark before it lists anything, so a writer that sees
no mark wrote its lease before the run's first read of the leases.

GC also removes expired leases (pushes that died) and abandoned partial writes older than the
grace period (temp files, S3 multipart uploads).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from gpucloud.registry.manifest import PushLease
from gpucloud.registry.store import ChunkStore, ManifestStore

GC_BATCH_SECONDS = 1.0
"""Longest GC deletes between two reads of the leases and manifests."""
LEASE_SETTLE_SECONDS = 2 * GC_BATCH_SECONDS
"""How long after writing its lease a push waits before re-checking the chunks it reused."""
LEASE_RENEW_SECONDS = 60.0
"""How often a running push renews its lease."""
LEASE_TTL = timedelta(minutes=30)
"""A lease not renewed for this long belongs to a dead push."""
GRACE_PERIOD = timedelta(hours=24)
"""Unreferenced chunks younger than this are kept (a push may be about to reference them)."""


@dataclass
class GcResult:
    """What a run found and did. `chunks_young` counts every chunk inside the grace period,
    referenced or not; `chunks_referenced` counts the older ones some manifest or lease kept."""

    chunks_scanned: int = 0
    bytes_scanned: int = 0
    chunks_referenced: int = 0
    chunks_young: int = 0
    chunks_deleted: int = 0
    bytes_deleted: int = 0
    leases_expired: int = 0
    uploads_aborted: int = 0
    dry_run: bool = False
    deleted_ids: list[str] = field(default_factory=list)


class _References:
    """Chunk ids held by live leases and by every manifest seen so far."""

    def __init__(self, manifest_store: ManifestStore, *, now: datetime, lease_ttl: timedelta) -> None:
        self._store, self._now, self._ttl = manifest_store, now, lease_ttl
        self.chunk_ids: set[str] = set()
        self.expired: list[PushLease] = []
        self._manifests_seen: set[str] = set()

    def refresh(self) -> None:
        # Leases first, then manifests: a push drops its lease only after its manifest landed.
        self.expired = []
        for lease in self._store.leases():
            if lease.renewed_at >= self._now - self._ttl:
                self.chunk_ids.update(lease.chunk_ids)
            else:
                self.expired.append(lease)
        for digest in self._store.digests():
            if digest not in self._manifests_seen:
                self.chunk_ids.update(self._store.get(digest).manifest.chunk_ids())
                self._manifests_seen.add(digest)


def collect_garbage(
    chunk_store: ChunkStore,
    manifest_store: ManifestStore,
    *,
    grace_period: timedelta = GRACE_PERIOD,
    lease_ttl: timedelta = LEASE_TTL,
    now: datetime | None = None,
    dry_run: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> GcResult:
    """Delete unreferenced chunks older than grace_period; see the module doc for the rules."""
    now = now or datetime.now(UTC)
    if dry_run:
        return _collect(chunk_store, manifest_store, grace_period, lease_ttl, now, True, clock)
    run_id = uuid.uuid4().hex
    manifest_store.put_gc_run(run_id, now)  # before anything is listed: see `holding`
    try:
        return _collect(chunk_store, manifest_store, grace_period, lease_ttl, now, False, clock)
    finally:
        manifest_store.delete_gc_run(run_id)


def _collect(
    chunk_store: ChunkStore,
    manifest_store: ManifestStore,
    grace_period: timedelta,
    lease_ttl: timedelta,
    now: datetime,
    dry_run: bool,
    clock: Callable[[], float],
) -> GcResult:
    cutoff = now - grace_period
    result = GcResult(dry_run=dry_run)

    # Listing the chunks comes first: a chunk written after this point is not even considered.
    old = {}
    for info in chunk_store.list():
        result.chunks_scanned += 1
        result.bytes_scanned += info.size
        if info.modified < cutoff:
            old[info.id] = info
        else:
            result.chunks_young += 1

    references = _References(manifest_store, now=now, lease_ttl=lease_ttl)
    references.refresh()
    refreshed = clock()
    for chunk_id in sorted(old):
        if clock() - refreshed >= GC_BATCH_SECONDS:
            references.refresh()
            refreshed = clock()
        if chunk_id in references.chunk_ids:
            result.chunks_referenced += 1
            continue
        if not dry_run:
            chunk_store.delete(chunk_id)
        result.chunks_deleted += 1
        result.bytes_deleted += old[chunk_id].size
        result.deleted_ids.append(chunk_id)

    result.leases_expired = len(references.expired)
    if not dry_run:
        for lease in references.expired:
            manifest_store.delete_lease(lease.lease_id)
        result.uploads_aborted = chunk_store.abort_incomplete(older_than=cutoff)
    return result


@contextmanager
def holding(
    manifest_store: ManifestStore,
    chunk_ids: Iterable[str],
    *,
    model: str,
    lease_ttl: timedelta = LEASE_TTL,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[None]:
    """Keep GC away from chunk_ids while the block runs (check they exist, write the manifest).

    The lease is written first; if a deleting GC run is marked as running, the block starts only
    after `LEASE_SETTLE_SECONDS`, once that run has re-read the leases and finished the batch it
    had begun without ours. A run marked longer ago than lease_ttl is taken for a dead one.
    """
    now = datetime.now(UTC)
    lease = PushLease(
        lease_id=uuid.uuid4().hex, model=model, chunk_ids=sorted(set(chunk_ids)), created_at=now, renewed_at=now
    )
    manifest_store.put_lease(lease)
    leased_at = time.monotonic()
    try:
        if any(started >= now - lease_ttl for started in manifest_store.gc_runs()):
            sleep(max(0.0, leased_at + LEASE_SETTLE_SECONDS - time.monotonic()))
        yield
    finally:
        manifest_store.delete_lease(lease.lease_id)
