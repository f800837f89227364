"""Garbage collection: references, grace period, push leases, the lease re-read while deleting."""

from __future__ import annotations

import itertools
import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import blake3
import pytest

from gpucloud.registry.chunking import ChunkPolicy
from gpucloud.registry.gc import LEASE_SETTLE_SECONDS, collect_garbage, holding
from gpucloud.registry.manifest import Keyring, ManifestTamperedError, PushLease, Signer
from gpucloud.registry.pull import pull
from gpucloud.registry.push import StoreTarget, push
from gpucloud.registry.store import LocalChunkStore, LocalManifestStore

pytestmark = pytest.mark.unit

POLICY = ChunkPolicy(max_chunk_size=2048, pack_size=512, fixed_chunk_size=2048, read_size=1024)
GRACE = timedelta(hours=1)
NOW = datetime.now(UTC)
LONG_AGO = (NOW - 2 * GRACE).timestamp()


@pytest.fixture
def stores(tmp_path: Path) -> tuple[LocalChunkStore, LocalManifestStore]:
    return LocalChunkStore(tmp_path / "reg"), LocalManifestStore(tmp_path / "reg")


def orphan(store: LocalChunkStore, *, old: bool) -> str:
    data = os.urandom(3000)
    chunk_id = blake3.blake3(data).hexdigest()
    store.put(chunk_id, data)
    if old:
        os.utime(store.path(chunk_id), (LONG_AGO, LONG_AGO))
    return chunk_id


def age_everything(store: LocalChunkStore) -> None:
    for info in store.list():
        os.utime(store.path(info.id), (LONG_AGO, LONG_AGO))


def lease(chunk_ids: list[str], renewed: datetime) -> PushLease:
    return PushLease(
        lease_id=uuid.uuid4().hex,
        model="m",
        chunk_ids=chunk_ids,
        created_at=renewed,
        renewed_at=renewed,
    )


def pushed_version(tmp_path: Path, stores, signer: Signer) -> str:
    source = tmp_path / "src"
    source.mkdir()
    (source / "weights.bin").write_bytes(os.urandom(7000))
    chunks, manifests = stores
    result = push(
        source,
        model="m",
        target=StoreTarget(chunks, manifests, settle_seconds=0),
        signer=signer,
        policy=POLICY,
    )
    return result.digest


def test_deletes_old_unreferenced_chunks_and_keeps_the_rest(tmp_path: Path, stores) -> None:
    chunks, manifests = stores
    signer = Signer.generate()
    digest = pushed_version(tmp_path, stores, signer)
    age_everything(chunks)
    old, young = orphan(chunks, old=True), orphan(chunks, old=False)
    referenced = {info.id for info in chunks.list()} - {old, young}

    result = collect_garbage(chunks, manifests, grace_period=GRACE, now=NOW)

    assert {info.id for info in chunks.list()} == referenced | {young}
    assert result.deleted_ids == [old] and result.bytes_deleted == 3000
    assert result.chunks_referenced == len(referenced) and result.chunks_young == 1
    keyring = Keyring()
    keyring.trust("acme", signer.verify_key)
    pull(
        digest,
        tmp_path / "out",
        chunk_store=chunks,
        manifest_store=manifests,
        keyring=keyring,
        tenant="acme",
    )


def test_dry_run_reports_without_deleting(stores) -> None:
    chunks, manifests = stores
    old = orphan(chunks, old=True)
    result = collect_garbage(chunks, manifests, grace_period=GRACE, now=NOW, dry_run=True)
    assert result.deleted_ids == [old] and chunks.has(old)


def test_a_live_lease_protects_its_chunks_and_an_expired_one_does_not(stores) -> None:
    chunks, manifests = stores
    leased, abandoned = orphan(chunks, old=True), orphan(chunks, old=True)
    live = lease([leased], NOW - timedelta(minutes=1))
    dead = lease([abandoned], NOW - timedelta(hours=3))
    manifests.put_lease(live)
    manifests.put_lease(dead)

    result = collect_garbage(chunks, manifests, grace_period=GRACE, lease_ttl=timedelta(minutes=30), now=NOW)

    assert chunks.has(leased) and not chunks.has(abandoned)
    assert result.leases_expired == 1
    assert [kept.lease_id for kept in manifests.leases()] == [live.lease_id]


def test_a_lease_written_while_gc_deletes_is_seen_before_the_next_batch(stores) -> None:
    chunks, manifests = stores
    doomed = sorted(orphan(chunks, old=True) for _ in range(6))
    late_push = lease(doomed[3:], NOW)

    class LateLeases(LocalManifestStore):
        """The push writes its lease just after GC's first read of the leases."""

        reads = 0

        def leases(self):
            self.reads += 1
            if self.reads == 2:
                self.put_lease(late_push)
            return super().leases()

    ticks = itertools.count(step=0.4)  # every third delete falls past the batch bound
    collect_garbage(
        chunks,
        LateLeases(manifests.objects.root),
        grace_period=GRACE,
        now=NOW,
        clock=lambda: next(ticks),
    )

    assert [c for c in doomed if chunks.has(c)] == doomed[3:]


def test_an_unreadable_manifest_stops_gc(stores, tmp_path: Path) -> None:
    chunks, manifests = stores
    digest = pushed_version(tmp_path, stores, Signer.generate())
    old = orphan(chunks, old=True)
    (manifests.objects.root / "manifests" / f"{digest}.json").write_text("{}")

    with pytest.raises(ManifestTamperedError):
        collect_garbage(chunks, manifests, grace_period=GRACE, now=NOW)
    assert chunks.has(old)


def test_abandoned_temp_files_are_removed_after_the_grace_period(stores) -> None:
    chunks, manifests = stores
    stale, fresh = chunks.root / "tmp" / "stale.part", chunks.root / "tmp" / "fresh.part"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(stale, (LONG_AGO, LONG_AGO))

    result = collect_garbage(chunks, manifests, grace_period=GRACE, now=NOW)

    assert result.uploads_aborted == 1 and not stale.exists() and fresh.exists()


def test_a_deleting_run_marks_itself_running_and_a_dry_run_does_not(stores) -> None:
    chunks, manifests = stores
    seen: list[int] = []

    class Watching(LocalChunkStore):
        def list(self):
            seen.append(len(manifests.gc_runs()))  # the mark is there before anything is listed
            return super().list()

    watching = Watching(chunks.root)
    collect_garbage(watching, manifests, grace_period=GRACE, now=NOW, dry_run=True)
    collect_garbage(watching, manifests, grace_period=GRACE, now=NOW)
    assert seen == [0, 1]
    assert manifests.gc_runs() == []


def test_holding_leases_the_chunks_and_waits_only_while_gc_runs(stores) -> None:
    chunks, manifests = stores
    kept = orphan(chunks, old=True)
    waits: list[float] = []

    with holding(manifests, [kept, kept], model="m", sleep=waits.append):
        assert [held.chunk_ids for held in manifests.leases()] == [[kept]]
        collect_garbage(chunks, manifests, grace_period=GRACE, now=NOW)
        assert chunks.has(kept)
    assert waits == [] and manifests.leases() == []

    manifests.put_gc_run("a" * 32, datetime.now(UTC))
    with holding(manifests, [kept], model="m", sleep=waits.append):
        pass
    assert len(waits) == 1 and 0 < waits[0] <= LEASE_SETTLE_SECONDS

    manifests.delete_gc_run("a" * 32)
    manifests.put_gc_run("b" * 32, datetime.now(UTC) - timedelta(hours=2))  # a run that died
    with holding(manifests, [kept], model="m", sleep=waits.append):
        pass
    assert len(waits) == 1
