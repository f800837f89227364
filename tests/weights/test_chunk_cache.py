"""The node's chunk cache: verified writes and reads, assembly, atomic activation and rollback."""

from __future__ import annotations

import os
import random
from pathlib import Path

import httpx
import pytest

from gpucloud.agent.chunk_cache import ChunkCache, NoPreviousVersionError
from gpucloud.agent.peer import create_peer_app
from gpucloud.registry.manifest import (
    BadSignatureError,
    ChunkCorruptedError,
    ChunkMissingError,
    ChunkRef,
    FileEntry,
    FileMismatchError,
    IntegrityError,
    Keyring,
    Manifest,
    ManifestTamperedError,
    SignedManifest,
    Signer,
    UnknownKeyError,
    digest_bytes,
)

pytestmark = pytest.mark.unit

TENANT = "acme"
CHUNK = 1000


def entry_for(data: bytes) -> tuple[FileEntry, dict[str, bytes]]:
    pieces = {}
    refs = []
    for offset in range(0, len(data), CHUNK):
        piece = data[offset : offset + CHUNK]
        pieces[digest_bytes(piece)] = piece
        refs.append(ChunkRef(id=digest_bytes(piece), offset=offset, size=len(piece)))
    return FileEntry(size=len(data), chunks=refs), pieces


class Version:
    def __init__(self, signer: Signer, files: dict[str, bytes]) -> None:
        self.files = files
        self.chunks: dict[str, bytes] = {}
        entries = {}
        for path, data in files.items():
            entries[path], pieces = entry_for(data)
            self.chunks.update(pieces)
        self.signed: SignedManifest = signer.sign(Manifest.build(model="m", files=entries))
        self.digest = self.signed.digest


@pytest.fixture
def signer() -> Signer:
    return Signer.generate()


@pytest.fixture
def keyring(signer: Signer) -> Keyring:
    keyring = Keyring()
    keyring.trust(TENANT, signer.verify_key)
    return keyring


@pytest.fixture
def cache(tmp_path: Path, keyring: Keyring) -> ChunkCache:
    return ChunkCache(tmp_path / "node", keyring=keyring, tenant=TENANT)


def model_files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "model.safetensors": rng.randbytes(4500),
        "config.json": f'{{"seed": {seed}}}'.encode(),
        "tokenizer/vocab.bin": b"v" * 2500,
        "EMPTY": b"",
    }


@pytest.fixture
def v1(signer: Signer) -> Version:
    return Version(signer, model_files(1))


@pytest.fixture
def v2(signer: Signer) -> Version:
    files = model_files(1)
    files["config.json"] = b'{"seed": 2}'
    files["model.safetensors"] = files["model.safetensors"][:3000] + os.urandom(1500)
    return Version(signer, files)


def stage(cache: ChunkCache, version: Version) -> Path:
    cache.add_manifest(version.signed)
    for chunk_id, data in version.chunks.items():
        cache.put(chunk_id, data)
    return cache.assemble(version.digest)


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# Chunks ----------------------------------------------------------------------------------------


def test_put_refuses_bytes_that_do_not_hash_to_the_id_and_leaves_nothing(cache: ChunkCache) -> None:
    chunk_id = digest_bytes(b"good")
    with pytest.raises(ChunkCorruptedError):
        cache.put(chunk_id, b"evil")
    assert not cache.has(chunk_id)
    assert not cache.chunk_path(chunk_id).exists()
    assert list((cache.root / "tmp").iterdir()) == []
    assert cache.put(chunk_id, b"good") is True
    assert cache.put(chunk_id, b"good") is False
    assert cache.read(chunk_id) == b"good"
    assert cache.held() == {chunk_id}


def test_a_chunk_that_rotted_on_disk_is_dropped_not_returned(cache: ChunkCache) -> None:
    chunk_id = digest_bytes(b"payload")
    cache.put(chunk_id, b"payload")
    cache.chunk_path(chunk_id).write_bytes(b"paylaod")
    with pytest.raises(ChunkCorruptedError, match="dropped"):
        cache.read(chunk_id)
    assert not cache.has(chunk_id)
    assert not cache.chunk_path(chunk_id).exists()
    with pytest.raises(ChunkMissingError):
        cache.read(chunk_id)


def test_leftover_temp_files_are_cleared_and_chunks_found_when_the_cache_reopens(
    tmp_path: Path, keyring: Keyring, cache: ChunkCache
) -> None:
    chunk_id = digest_bytes(b"kept")
    cache.put(chunk_id, b"kept")
    (cache.root / "tmp" / "half-written").write_bytes(b"x")
    reopened = ChunkCache(cache.root, keyring=keyring, tenant=TENANT)
    assert reopened.read(chunk_id) == b"kept"
    assert list((cache.root / "tmp").iterdir()) == []


# Manifests -------------------------------------------------------------------------------------


def test_only_manifests_signed_by_a_trusted_key_are_kept(cache: ChunkCache, v1: Version) -> None:
    stranger = Signer.generate().sign(v1.signed.manifest)
    with pytest.raises(UnknownKeyError):
        cache.add_manifest(stranger)
    forged = v1.signed.model_copy(update={"signature": "0" * 128})
    with pytest.raises(BadSignatureError):
        cache.add_manifest(forged)
    assert cache.add_manifest(v1.signed) == v1.signed.manifest


def test_a_kept_manifest_edited_on_disk_is_refused(cache: ChunkCache, v1: Version) -> None:
    cache.add_manifest(v1.signed)
    path = cache.root / "manifests" / v1.digest
    path.write_bytes(path.read_bytes().replace(b'"model":"m"', b'"model":"x"'))
    with pytest.raises(ManifestTamperedError):
        cache.manifest(v1.digest)


# Assembly, activation, rollback ----------------------------------------------------------------


def test_assembly_needs_every_chunk_and_lays_out_the_files(cache: ChunkCache, v1: Version) -> None:
    cache.add_manifest(v1.signed)
    assert {c.id for c in cache.missing(v1.digest)} == set(v1.chunks)
    with pytest.raises(ChunkMissingError):
        cache.assemble(v1.digest)
    path = stage(cache, v1)
    assert cache.missing(v1.digest) == []
    assert read_tree(path) == v1.files
    assert not os.access(path / "config.json", os.W_OK) or os.geteuid() == 0
    assert cache.assemble(v1.digest) == path  # idempotent
    assert cache.versions() == [v1.digest]


def test_activate_switches_current_and_keeps_the_previous_version(cache: ChunkCache, v1: Version, v2: Version) -> None:
    assert cache.active() is None and cache.previous() is None
    stage(cache, v1)
    cache.activate(v1.digest)
    assert (cache.active(), cache.previous()) == (v1.digest, None)
    assert read_tree(cache.current_path) == v1.files
    stage(cache, v2)
    cache.activate(v2.digest)
    assert (cache.active(), cache.previous()) == (v2.digest, v1.digest)
    assert read_tree(cache.current_path) == v2.files
    assert cache.rollback() == v1.digest
    assert (cache.active(), cache.previous()) == (v1.digest, None)
    assert read_tree(cache.current_path) == v1.files
    with pytest.raises(NoPreviousVersionError):
        cache.rollback()


@pytest.mark.parametrize(
    "damage",
    ["flip a byte", "truncate", "add a file", "remove a file", "replace with a symlink"],
)
def test_a_version_whose_files_do_not_match_the_manifest_never_activates(
    cache: ChunkCache, v1: Version, v2: Version, damage: str
) -> None:
    stage(cache, v1)
    cache.activate(v1.digest)
    root = stage(cache, v2)
    target = root / "model.safetensors"
    target.chmod(0o644)
    if damage == "flip a byte":
        data = bytearray(target.read_bytes())
        data[3100] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    elif damage == "add a file":
        (root / "extra.bin").write_bytes(b"x")
    elif damage == "remove a file":
        target.unlink()
    else:
        target.unlink()
        target.symlink_to(cache.current_path / "model.safetensors")
    with pytest.raises(IntegrityError) as failure:
        cache.activate(v2.digest)
    assert isinstance(failure.value, ChunkCorruptedError | FileMismatchError)
    assert (cache.active(), cache.previous()) == (v1.digest, None)
    assert read_tree(cache.current_path) == v1.files
    cache.discard(v2.digest)
    cache.assemble(v2.digest)  # rebuilt from the verified chunks
    cache.activate(v2.digest)
    assert read_tree(cache.current_path) == v2.files


def test_rollback_refuses_a_previous_version_that_rotted(cache: ChunkCache, v1: Version, v2: Version) -> None:
    stage(cache, v1)
    cache.activate(v1.digest)
    stage(cache, v2)
    cache.activate(v2.digest)
    config = cache.version_path(v1.digest) / "config.json"
    config.chmod(0o644)
    config.write_bytes(b'{"seed": 9}')
    with pytest.raises(IntegrityError):
        cache.rollback()
    assert cache.active() == v2.digest


def test_versions_in_use_cannot_be_discarded(cache: ChunkCache, v1: Version) -> None:
    stage(cache, v1)
    cache.activate(v1.digest)
    with pytest.raises(ValueError, match="in use"):
        cache.discard(v1.digest)


# Serving from version files --------------------------------------------------------------------


def test_prune_keeps_one_copy_and_chunks_are_still_served_verified(
    tmp_path: Path, keyring: Keyring, cache: ChunkCache, signer: Signer, v1: Version, v2: Version
) -> None:
    v3 = Version(signer, model_files(3))
    for version in (v1, v2, v3):
        stage(cache, version)
        cache.activate(version.digest)
    stray = digest_bytes(b"stray")
    cache.put(stray, b"stray")
    result = cache.prune()
    assert result.versions_removed == [v1.digest]
    assert set(cache.versions()) == {v2.digest, v3.digest}
    assert not any((cache.root / "chunks").rglob("*/*"))  # every kept chunk lives in a version file
    assert result.chunks_removed == len(v1.chunks.keys() | v2.chunks.keys() | v3.chunks.keys()) + 1
    assert cache.held() == v2.chunks.keys() | v3.chunks.keys()
    for chunk_id, data in (v2.chunks | v3.chunks).items():
        assert cache.read(chunk_id) == data
    reopened = ChunkCache(cache.root, keyring=keyring, tenant=TENANT)
    assert reopened.held() == cache.held()
    assert cache.rollback() == v2.digest


def test_a_chunk_served_from_a_rotted_version_file_is_refused(cache: ChunkCache, v1: Version) -> None:
    stage(cache, v1)
    cache.activate(v1.digest)
    cache.prune()
    vocab = cache.current_path / "tokenizer" / "vocab.bin"
    vocab.chmod(0o644)
    vocab.write_bytes(b"w" + vocab.read_bytes()[1:])
    first = v1.signed.manifest.files["tokenizer/vocab.bin"].chunks[0].id
    with pytest.raises(ChunkCorruptedError):
        cache.read(first)
    assert not cache.has(first)


async def test_the_peer_app_serves_only_verified_chunks(cache: ChunkCache) -> None:
    good, rotten = digest_bytes(b"good"), digest_bytes(b"rotten")
    cache.put(good, b"good")
    cache.put(rotten, b"rotten")
    cache.chunk_path(rotten).write_bytes(b"rotted")
    transport = httpx.ASGITransport(app=create_peer_app(cache))
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as client:
        response = await client.get(f"/chunks/{good}")
        assert response.status_code == 200 and response.content == b"good"
        assert (await client.get(f"/chunks/{rotten}")).status_code == 404
        assert (await client.get(f"/chunks/{digest_bytes(b'absent')}")).status_code == 404
        assert (await client.get("/chunks/not-a-digest")).status_code == 422
