"""Push and pull through a local store: round trip, dedup, resume, and failing closed."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpucloud.registry import push as push_module
from gpucloud.registry.chunking import chunk_file
from gpucloud.registry.manifest import (
    BadSignatureError,
    ChunkCorruptedError,
    ChunkMissingError,
    ChunkRef,
    ChunkSwappedError,
    ChunkTruncatedError,
    IntegrityError,
    Keyring,
    Lineage,
    ManifestTamperedError,
    Signer,
    UnknownKeyError,
)
from gpucloud.registry.pull import pull
from gpucloud.registry.push import PushResult, PushStats, StoreTarget, push
from gpucloud.registry.store import LocalChunkStore, LocalManifestStore
from support.models import POLICY, SIZES, random_tensors, same_tree
from support.models import write_model as _write_model

pytestmark = pytest.mark.unit


@dataclass
class Registry:
    root: Path
    chunks: LocalChunkStore
    manifests: LocalManifestStore
    signer: Signer
    keyring: Keyring

    def push(self, source: Path, *, chunk_store: LocalChunkStore | None = None, **options) -> PushResult:
        target = StoreTarget(chunk_store or self.chunks, self.manifests, settle_seconds=0)
        return push(source, model="tiny", target=target, policy=POLICY, **{"signer": self.signer} | options)

    def pull(self, digest: str, dest: Path, **options):
        return pull(
            digest,
            dest,
            chunk_store=self.chunks,
            manifest_store=self.manifests,
            keyring=self.keyring,
            tenant="acme",
            **options,
        )

    def stored(self) -> set[str]:
        return {info.id for info in self.chunks.list()}


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    signer, keyring = Signer.generate(), Keyring()
    keyring.trust("acme", signer.verify_key)
    root = tmp_path / "registry"
    return Registry(root, LocalChunkStore(root, read_size=1000), LocalManifestStore(root), signer, keyring)


def test_push_then_pull_round_trip(registry: Registry, tmp_path: Path) -> None:
    source = write_model(tmp_path / "v1", random_tensors())
    events: list[tuple[str, int]] = []

    def report(phase: str, stats: PushStats) -> None:
        events.append((phase, stats.bytes_hashed if phase == "hash" else stats.bytes_uploaded))

    result = registry.push(source, report=report, lineage=Lineage(base_model="llama-3"))
    pulled = registry.pull(result.digest, tmp_path / "out" / "v1")

    assert same_tree(source, pulled.path)
    assert result.bytes_total == sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    assert result.chunks_uploaded == len(registry.stored()) == len(result.signed.manifest.chunk_ids())
    assert result.bytes_skipped == result.bytes_total - result.bytes_uploaded
    for phase in ("hash", "upload"):
        done = [bytes_done for event_phase, bytes_done in events if event_phase == phase]
        assert done == sorted(done) and done[-1] == result.bytes_total
    assert list((registry.root / "leases").iterdir()) == []


def test_uploads_start_while_hashing_goes_on(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(push_module, "ASK_BATCH", 2)
    source = write_model(tmp_path / "v1", random_tensors(SIZES * 3))
    uploading = threading.Event()
    overlapped: list[bool] = []

    class Recording(StoreTarget):
        def upload(self, model: str, chunk: ChunkRef, path: Path) -> None:
            uploading.set()
            super().upload(model, chunk, path)

    def report(phase: str, stats: PushStats) -> None:
        if phase == "hash" and stats.bytes_hashed == stats.bytes_total:  # the last chunk is hashed
            overlapped.append(uploading.wait(timeout=10))

    target = Recording(registry.chunks, registry.manifests, settle_seconds=0)
    result = push(source, model="tiny", target=target, policy=POLICY, signer=registry.signer, report=report)
    assert overlapped == [True]
    assert result.chunks_uploaded == len(registry.stored()) == len(result.signed.manifest.chunk_ids())
    assert same_tree(source, registry.pull(result.digest, tmp_path / "out").path)


def test_second_version_uploads_exactly_the_changed_tensors(registry: Registry, tmp_path: Path) -> None:
    tensors = random_tensors()
    v1 = registry.push(write_model(tmp_path / "v1", tensors))
    before = registry.stored()
    tuned = dict(tensors, **{"layer.3": os.urandom(9000), "layer.1": os.urandom(300)})
    source = write_model(tmp_path / "v2", tuned)
    old_ids = {c.id for c in chunk_file(tmp_path / "v1" / "model.safetensors", policy=POLICY).chunks}
    new_chunks = [c for c in chunk_file(source / "model.safetensors", policy=POLICY).chunks if c.id not in old_ids]

    v2 = registry.push(source, lineage=Lineage(parent=v1.digest))

    # layer.3 is three pieces; layer.1 shares a pack with layer.2; the header did not change.
    assert len(new_chunks) == 4
    assert registry.stored() - before == {c.id for c in new_chunks}
    assert v2.chunks_uploaded == 4 and v2.bytes_uploaded == 9000 + 300 + 200
    assert v2.bytes_skipped == v2.bytes_total - 9500
    assert same_tree(source, registry.pull(v2.digest, tmp_path / "out").path)


class FlakyStore(LocalChunkStore):
    """Fails every put after `limit` chunks were written, like a connection that drops."""

    def __init__(self, root: Path, limit: int) -> None:
        super().__init__(root, read_size=1000)
        self.limit, self.writes, self._lock = limit, 0, threading.Lock()

    def put(self, chunk_id, data) -> bool:
        with self._lock:
            if self.writes >= self.limit and not self.has(chunk_id):
                raise ConnectionError("link dropped")
        written = super().put(chunk_id, data)
        with self._lock:
            self.writes += written
        return written


def test_interrupted_push_resumes_with_only_the_missing_chunks(registry: Registry, tmp_path: Path) -> None:
    source = write_model(tmp_path / "v1", random_tensors())
    with pytest.raises(ConnectionError):
        registry.push(source, chunk_store=FlakyStore(registry.root, limit=5), concurrency=2)
    survived = registry.stored()
    assert len(survived) >= 5
    assert list(registry.manifests.digests()) == []
    assert list((registry.root / "leases").iterdir()) == []

    result = registry.push(source)

    unique = len(result.signed.manifest.chunk_ids())
    assert result.chunks_uploaded == unique - len(survived) > 0
    assert same_tree(source, registry.pull(result.digest, tmp_path / "out").path)


def test_a_chunk_deleted_after_the_push_saw_it_is_uploaded_again(registry: Registry, tmp_path: Path) -> None:
    source = write_model(tmp_path / "v1", random_tensors())
    registry.push(source)
    victim = chunk_file(source / "model.safetensors", policy=POLICY).chunks[1].id

    class RacingGc(LocalChunkStore):
        """Deletes one chunk right after the push found it present, as a concurrent GC might."""

        deleted = False

        def has(self, chunk_id) -> bool:
            present = super().has(chunk_id)
            if chunk_id == victim and present and not self.deleted:
                self.deleted = True
                self.delete(chunk_id)
            return present

    result = registry.push(source, chunk_store=RacingGc(registry.root), created_at=None)

    assert result.chunks_uploaded == 1
    assert same_tree(source, registry.pull(result.digest, tmp_path / "out").path)


def test_a_file_changed_during_the_push_is_refused(registry: Registry, tmp_path: Path) -> None:
    source = write_model(tmp_path / "v1", random_tensors())

    class EditingStore(LocalChunkStore):
        def put(self, chunk_id, data) -> bool:
            (source / "config.json").write_bytes(b'{"layers": 3}')
            return super().put(chunk_id, data)

    with pytest.raises(ChunkCorruptedError, match=r"config\.json.*changed"):
        registry.push(source, chunk_store=EditingStore(registry.root), concurrency=1)
    assert list(registry.manifests.digests()) == []


def _chunk(registry: Registry, digest: str, index: int):
    return registry.manifests.get(digest).manifest.files["model.safetensors"].chunks[index]


def _rewrite(registry: Registry, digest: str, edit: Callable[[bytes], bytes]) -> None:
    path = registry.chunks.path(_chunk(registry, digest, 2).id)
    path.write_bytes(edit(path.read_bytes()))


def _edit_manifest(registry: Registry, digest: str, edit: Callable[[dict], None]) -> None:
    path = registry.root / "manifests" / f"{digest}.json"
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


def _flip_signature(document: dict) -> None:
    signature = document["signature"]
    document["signature"] = ("1" if signature[0] == "0" else "0") + signature[1:]


CORRUPTIONS = {
    "corrupted": (
        lambda r, d: _rewrite(r, d, lambda b: b[:10] + bytes([b[10] ^ 1]) + b[11:]),
        ChunkCorruptedError,
    ),
    "truncated": (lambda r, d: _rewrite(r, d, lambda b: b[:-7]), ChunkTruncatedError),
    "swapped": (
        lambda r, d: _rewrite(r, d, lambda b: r.chunks.get(_chunk(r, d, 4).id)),
        ChunkSwappedError,
    ),
    "missing": (lambda r, d: r.chunks.delete(_chunk(r, d, 2).id), ChunkMissingError),
    "tampered-manifest": (
        lambda r, d: _edit_manifest(r, d, lambda m: m["manifest"].update(model="evil")),
        ManifestTamperedError,
    ),
    "bad-signature": (lambda r, d: _edit_manifest(r, d, _flip_signature), BadSignatureError),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_every_corruption_is_refused_and_nothing_appears(registry: Registry, tmp_path: Path, corruption: str) -> None:
    result = registry.push(write_model(tmp_path / "v1", random_tensors()))
    damage, expected = CORRUPTIONS[corruption]
    target = _chunk(registry, result.digest, 2)
    damage(registry, result.digest)
    dest = tmp_path / "out" / "v1"

    with pytest.raises(expected) as caught:
        registry.pull(result.digest, dest)

    assert isinstance(caught.value, IntegrityError)
    if corruption not in ("tampered-manifest", "bad-signature"):
        message = str(caught.value)
        assert target.id in message and "model.safetensors" in message and f"offset {target.offset}" in message
    assert not dest.exists()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_version_signed_by_an_untrusted_key_is_refused(registry: Registry, tmp_path: Path) -> None:
    result = registry.push(write_model(tmp_path / "v1", random_tensors()), signer=Signer.generate())
    with pytest.raises(UnknownKeyError):
        registry.pull(result.digest, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pull_refuses_an_existing_destination(registry: Registry, tmp_path: Path) -> None:
    result = registry.push(write_model(tmp_path / "v1", random_tensors()))
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        registry.pull(result.digest, tmp_path / "out")


def test_push_refuses_symlinks(registry: Registry, tmp_path: Path) -> None:
    source = write_model(tmp_path / "v1", random_tensors())
    (source / "link").symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match="link"):
        registry.push(source)


def write_model(directory: Path, tensors: dict[str, bytes], config: bytes = b'{"layers": 2}') -> Path:
    return _write_model(directory, tensors, config=config, empty_file=True)
