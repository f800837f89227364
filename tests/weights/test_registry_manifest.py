"""Manifests: canonical bytes and identity, validation, signatures, keyrings, evaluation records."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import blake3
import pytest
from pydantic import ValidationError

from gpucloud.registry.manifest import (
    BadSignatureError,
    ChunkRef,
    EvaluationRecord,
    FileEntry,
    Keyring,
    Lineage,
    Manifest,
    ManifestTamperedError,
    Signer,
    UnknownKeyError,
    VersionNotFoundError,
)
from gpucloud.registry.store import LocalManifestStore

pytestmark = pytest.mark.unit

WHEN = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def chunk_id(n: int) -> str:
    return blake3.blake3(str(n).encode()).hexdigest()


def entry(*sizes: int, seed: int = 0) -> FileEntry:
    chunks, offset = [], 0
    for i, size in enumerate(sizes):
        chunks.append(ChunkRef(id=chunk_id(seed * 100 + i), offset=offset, size=size))
        offset += size
    return FileEntry(size=offset, chunks=chunks)


def manifest(**overrides) -> Manifest:
    fields = {
        "model": "llama-tiny",
        "files": {"model.safetensors": entry(100, 50), "config.json": entry(10, seed=1)},
        "lineage": Lineage(base_model="llama-3", training_run="run-7", dataset_digests=["sha256:ab"]),
        "created_at": WHEN,
    }
    return Manifest.build(**(fields | overrides))


def test_digest_is_blake3_of_sorted_compact_json_whatever_the_insertion_order() -> None:
    a = manifest()
    b = manifest(files=dict(reversed(list(a.files.items()))))

    body = a.canonical_bytes()
    assert body == b.canonical_bytes()
    assert a.digest == b.digest == blake3.blake3(body).hexdigest()
    assert body == json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
    assert Manifest.model_validate_json(body).digest == a.digest
    assert a.total_size == 160 and a.chunk_count == 3


@pytest.mark.parametrize(
    "change",
    [
        {"model": "llama-tiny-2"},
        {"created_at": WHEN + timedelta(microseconds=1)},
        {"lineage": Lineage(base_model="llama-3", training_run="run-8", dataset_digests=["sha256:ab"])},
        {"files": {"model.safetensors": entry(100, 50), "config.json": entry(10, seed=2)}},
        {"files": {"model.safetensors": entry(100, 50)}},
    ],
)
def test_any_change_changes_the_identity(change: dict) -> None:
    assert manifest(**change).digest != manifest().digest


def test_timestamps_are_normalised_to_utc_and_must_be_aware() -> None:
    shifted = WHEN.astimezone(timezone(timedelta(hours=5)))
    assert manifest(created_at=shifted).digest == manifest().digest
    with pytest.raises(ValidationError):
        manifest(created_at=datetime(2025, 3, 1, 12, 0))


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a//b", "./a", "a/..", "a\\b", ""])
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(ValidationError):
        manifest(files={path: entry(10)})


def test_chunks_must_tile_the_file() -> None:
    with pytest.raises(ValidationError, match="expected 100"):
        FileEntry(
            size=150,
            chunks=[
                ChunkRef(id=chunk_id(1), offset=0, size=100),
                ChunkRef(id=chunk_id(2), offset=101, size=49),
            ],
        )
    with pytest.raises(ValidationError, match="file size"):
        FileEntry(size=150, chunks=[ChunkRef(id=chunk_id(1), offset=0, size=100)])
    with pytest.raises(ValidationError):
        ChunkRef(id="not-a-digest", offset=0, size=1)


def test_totals_must_match_the_files() -> None:
    good = manifest()
    with pytest.raises(ValidationError, match="total_size"):
        Manifest.model_validate(good.model_dump() | {"total_size": 1})
    with pytest.raises(ValidationError):
        Manifest.model_validate(good.model_dump() | {"surprise": 1})


def test_signature_verifies_only_for_the_trusted_tenant_and_exact_bytes() -> None:
    signer, keyring = Signer.generate(), Keyring()
    assert keyring.trust("acme", signer.verify_key) == signer.key_id
    signed = signer.sign(manifest())

    assert keyring.verify(signed, tenant="acme") == signed.manifest
    with pytest.raises(UnknownKeyError, match=signer.key_id):
        keyring.verify(signed, tenant="globex")

    tampered = signed.model_copy(update={"manifest": manifest(model="llama-evil")})
    with pytest.raises(BadSignatureError, match=tampered.digest):
        keyring.verify(tampered, tenant="acme")

    flipped = signed.signature[:-1] + ("0" if signed.signature[-1] != "0" else "1")
    with pytest.raises(BadSignatureError):
        keyring.verify(signed.model_copy(update={"signature": flipped}), tenant="acme")

    keyring.revoke("acme", signer.key_id)
    with pytest.raises(UnknownKeyError):
        keyring.verify(signed, tenant="acme")


def test_a_key_id_naming_another_trusted_key_does_not_verify() -> None:
    alice, mallory, keyring = Signer.generate(), Signer.generate(), Keyring()
    keyring.trust("acme", alice.verify_key)
    forged = mallory.sign(manifest()).model_copy(update={"key_id": alice.key_id})
    with pytest.raises(BadSignatureError):
        keyring.verify(forged, tenant="acme")


def test_evaluations_are_signed_apart_and_leave_the_identity_alone() -> None:
    signer, keyring = Signer.generate(), Keyring()
    keyring.trust("acme", signer.verify_key)
    version = manifest()
    before = version.digest
    early = EvaluationRecord(
        version=before, evaluator="mmlu-job", results={"mmlu": 0.61, "gsm8k": 0.4}, recorded_at=WHEN
    )
    late = EvaluationRecord(
        version=before,
        evaluator="mmlu-job",
        results={"mmlu": 0.63},
        recorded_at=WHEN + timedelta(hours=1),
    )

    signed = signer.sign_evaluation(early)

    assert keyring.verify_evaluation(signed, tenant="acme") == early
    assert version.digest == before
    assert late.digest != early.digest
    # A manifest signature can never pass for an evaluation signature (domain separation).
    cross = signed.model_copy(update={"signature": signer.sign(version).signature})
    with pytest.raises(BadSignatureError):
        keyring.verify_evaluation(cross, tenant="acme")
    with pytest.raises(ValidationError, match="finite"):
        EvaluationRecord(version=before, evaluator="x", results={"loss": float("nan")}, recorded_at=WHEN)


def test_manifest_store_round_trip_and_tamper_detection(tmp_path: Path) -> None:
    store, signer = LocalManifestStore(tmp_path), Signer.generate()
    signed = signer.sign(manifest())

    digest = store.put(signed)

    assert store.get(digest) == signed
    assert list(store.digests()) == [digest]
    with pytest.raises(VersionNotFoundError):
        store.get(chunk_id(99))

    stored = tmp_path / "manifests" / f"{digest}.json"
    document = json.loads(stored.read_text())
    document["manifest"]["files"]["config.json"]["chunks"][0]["id"] = chunk_id(42)
    stored.write_text(json.dumps(document))
    with pytest.raises(ManifestTamperedError, match=digest):
        store.get(digest)

    stored.write_text("{not json")
    with pytest.raises(ManifestTamperedError, match="unreadable"):
        store.get(digest)


def test_evaluations_are_stored_per_version(tmp_path: Path) -> None:
    store, signer = LocalManifestStore(tmp_path), Signer.generate()
    version = manifest().digest
    record = EvaluationRecord(version=version, evaluator="e", results={"acc": 1.0}, recorded_at=WHEN)

    store.add_evaluation(signer.sign_evaluation(record))

    assert [s.record for s in store.evaluations(version)] == [record]
    assert store.evaluations(chunk_id(5)) == []


def test_a_stored_version_keeps_its_first_signature(tmp_path: Path) -> None:
    store, first, second = LocalManifestStore(tmp_path), Signer.generate(), Signer.generate()
    version = manifest()

    store.put(first.sign(version))
    store.put(second.sign(version))

    assert store.get(version.digest).key_id == first.key_id


def test_a_versions_logical_size_is_bounded_outright_and_by_its_distinct_chunks() -> None:
    """Issue 37, item 6: the bytes a version declares are what evaluation and pulls write."""
    one = blake3.blake3(b"a").hexdigest()
    two = blake3.blake3(b"b").hexdigest()

    def version(*sizes_and_ids: tuple[str, int]) -> Manifest:
        refs, offset = [], 0
        for chunk_id, size in sizes_and_ids:
            refs.append(ChunkRef(id=chunk_id, offset=offset, size=size))
            offset += size
        return Manifest.build(model="m", files={"w": FileEntry(size=offset, chunks=refs)})

    limits = {"max_bytes": 100 << 30, "max_amplification": 16, "amplification_floor": 1 << 30}
    gib = 1 << 30
    assert version((one, gib), (two, gib)).unique_size() == 2 * gib
    assert version((one, gib), (two, gib)).size_problem(**limits) is None
    # Repeated a little (tied or zeroed tensors), or small whatever it repeats: accepted.
    assert version(*[(one, gib)] * 16).size_problem(**limits) is None
    assert version(*[(one, 1 << 20)] * 1000).size_problem(**limits) is None  # under the floor
    bomb = version(*[(one, gib)] * 17).size_problem(**limits)
    assert bomb is not None and "17 times over; at most 16" in bomb
    huge = version(*[(one, 40 * gib), (two, 40 * gib), (blake3.blake3(b"c").hexdigest(), 40 * gib)])
    assert "past the limit of 107374182400 bytes" in (huge.size_problem(**limits) or "")
