"""What a model version is: its manifest, the manifest's identity and signature, and the errors
raised when anything fails to match it.

A `Manifest` lists every file of a version as an ordered sequence of content-addressed chunks
(BLAKE3 id, offset, size), plus the version's lineage (parent version, base model, training run,
dataset digests) and its creation time. Its canonical serialisation (sorted keys, no whitespace,
UTF-8) is what gets hashed and signed: `Manifest.digest` (BLAKE3 hex of those bytes) *is* the
version's identity, so two readers of the same manifest always agree on which version they hold.

Evaluation results live in separate `EvaluationRecord`s, not in the manifest. They arrive after
the push (an evaluation job runs on the pushed weights), several evaluators may report on one
version over time, and none of that may change which version it is: a record names the version by
digest, carries metric -> float results, and is signed on its own by its evaluator. Putting them
in the manifest but outside the signed body would leave unsigned numbers next to signed ones, and
promotion gates decide on those numbers.

Signatures are Ed25519 (PyNaCl) over a domain tag plus the canonical bytes, so a manifest
signature can never be replayed as an evaluation signature or the other way round. A key id is
the BLAKE3 hex of the raw public key. A `Keyring` holds the public keys each tenant trusts; a key
trusted by one tenant means nothing to another.

`PushLease` is the record a push writes before it uploads anything, so garbage collection treats
the chunks it is about to rely on as referenced (see `gpucloud.registry.gc`).

Every integrity failure is an `IntegrityError` subclass whose message names what failed (file,
chunk id, offset, key id), so callers can fail closed on the base class and report the detail.
A broken transfer (`ChunkTransferError`) is not one: it is retried, and only when the retries run
out does it become `ChunkUnavailableError`, which is.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import blake3
from nacl.exceptions import BadSignatureError as _NaclBadSignature
from nacl.signing import SigningKey, VerifyKey
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from gpucloud.models.registry_names import HEX_DIGEST

_HEX_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_MANIFEST_DOMAIN = b"gpucloud.registry.manifest.v1\n"
_EVALUATION_DOMAIN = b"gpucloud.registry.evaluation.v1\n"
_POSSESSION_DOMAIN = b"gpucloud.registry.key-possession.v1\n"


def possession_message(tenant_id: str, public_key_hex: str) -> bytes:
    """What a key's holder signs to register it for a tenant (bound to that tenant, so a proof
    cannot be replayed to register the key anywhere else)."""
    return _POSSESSION_DOMAIN + f"{tenant_id}\n{public_key_hex}".encode()


def check_possession(tenant_id: str, public_key_hex: str, proof_hex: str) -> bool:
    """Whether `proof_hex` is the key's own signature of `possession_message`."""
    try:
        VerifyKey(bytes.fromhex(public_key_hex)).verify(
            possession_message(tenant_id, public_key_hex), bytes.fromhex(proof_hex)
        )
    except (ValueError, _NaclBadSignature):
        return False
    return True


class IntegrityError(Exception):
    """Something does not match the signed manifest; whatever was being built must be discarded."""


class ChunkError(IntegrityError):
    """A chunk failed verification; `chunk_id`, `path` and `offset` say which one and where."""

    def __init__(
        self,
        detail: str,
        *,
        chunk_id: str,
        path: str | None = None,
        offset: int | None = None,
        actual_id: str | None = None,
    ) -> None:
        where = f"chunk {chunk_id}"
        if path is not None:
            where += f" of file {path!r} at offset {offset}"
        super().__init__(f"{where}: {detail}")
        self.chunk_id, self.path, self.offset = chunk_id, path, offset
        self.actual_id = actual_id  # what the bytes really hashed to, when they were hashed


class ChunkMissingError(ChunkError, LookupError):
    """The store does not have the chunk."""


class ChunkCorruptedError(ChunkError):
    """The chunk's bytes do not hash to its id."""


class ChunkTruncatedError(ChunkError):
    """The store returned fewer bytes than the manifest says the chunk has."""


class ChunkSwappedError(ChunkError):
    """The store returned another chunk of the same version in place of the requested one."""


class ChunkUnavailableError(ChunkError):
    """The chunk's transfer kept breaking (connection reset, cut-off body, server error) until the
    retries ran out: nothing wrong was accepted, but the version could not be fetched."""


class ChunkTransferError(Exception):
    """One transfer of a chunk broke before it could be verified; trying again may succeed.

    Stores and sources raise it for a connection reset, a body cut off mid-way or a 5xx answer;
    `pull` retries it with backoff. It is not an `IntegrityError`: no bytes were judged, and it
    becomes `ChunkUnavailableError` (or the integrity error the bytes point to) when retries end.
    `actual_id` is what the bytes received before the break hashed to, when they were hashed.
    """

    def __init__(self, detail: str, *, chunk_id: str, actual_id: str | None = None) -> None:
        super().__init__(f"chunk {chunk_id}: {detail}")
        self.chunk_id, self.actual_id = chunk_id, actual_id


class FileMismatchError(IntegrityError):
    """An assembled file does not have the size or chunk sequence the manifest lists."""


class ManifestTamperedError(IntegrityError):
    """A stored manifest is unreadable, or its content no longer hashes to its version digest."""


class BadSignatureError(IntegrityError):
    """The signature does not verify against the signer's trusted public key."""


class UnknownKeyError(IntegrityError):
    """The manifest was signed by a key the tenant's keyring does not trust."""


class VersionNotFoundError(LookupError):
    """No manifest is stored under that digest."""


def canonical_json(model: BaseModel) -> bytes:
    """The one byte encoding that is hashed and signed: sorted keys, no whitespace, UTF-8."""
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def digest_bytes(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamps must carry a timezone")
    return value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_utc)]


def validate_relative_path(path: str) -> str:
    """Accept only normalised relative POSIX paths, so a manifest cannot write outside its dir."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or "\0" in path:
        raise ValueError(f"file path {path!r} must be a relative POSIX path")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"file path {path!r} must not contain empty, '.' or '..' segments")
    return path


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChunkRef(_Record):
    """One chunk of a file: its content address and the byte range it covers."""

    id: str = Field(pattern=HEX_DIGEST)
    offset: int = Field(ge=0)
    size: int = Field(ge=1)


class FileEntry(_Record):
    """A file as its ordered chunks; the chunks tile [0, size) with no gap or overlap."""

    size: int = Field(ge=0)
    chunks: list[ChunkRef]

    @model_validator(mode="after")
    def _chunks_tile_the_file(self) -> FileEntry:
        problem = self.tiling_error()
        if problem is not None:
            raise ValueError(problem)
        return self

    def tiling_error(self) -> str | None:
        """What breaks the tiling of [0, size) by the chunks, or None."""
        position = 0
        for chunk in self.chunks:
            if chunk.offset != position:
                return f"chunk {chunk.id} at offset {chunk.offset}, expected {position}"
            position += chunk.size
        if position != self.size:
            return f"chunks cover {position} bytes, file size is {self.size}"
        return None


class Lineage(_Record):
    """Where a version came from."""

    parent: str | None = Field(default=None, pattern=HEX_DIGEST)
    base_model: str | None = None
    training_run: str | None = None
    dataset_digests: list[str] = []


class Manifest(_Record):
    """One immutable model version. Build it with `Manifest.build` so the totals are computed."""

    schema_version: Literal[1] = 1
    model: str = Field(min_length=1, max_length=200)
    created_at: UtcDatetime
    files: dict[str, FileEntry]
    total_size: int = Field(ge=0)
    chunk_count: int = Field(ge=0)
    lineage: Lineage = Lineage()

    @field_validator("files")
    @classmethod
    def _paths_are_safe(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for path in files:
            validate_relative_path(path)
        return files

    @model_validator(mode="after")
    def _totals_match(self) -> Manifest:
        if self.total_size != sum(entry.size for entry in self.files.values()):
            raise ValueError("total_size is not the sum of the file sizes")
        if self.chunk_count != sum(len(entry.chunks) for entry in self.files.values()):
            raise ValueError("chunk_count is not the number of chunks listed")
        return self

    @classmethod
    def build(
        cls,
        *,
        model: str,
        files: dict[str, FileEntry],
        lineage: Lineage | None = None,
        created_at: datetime | None = None,
    ) -> Manifest:
        return cls(
            model=model,
            created_at=created_at or datetime.now(UTC),
            files=dict(sorted(files.items())),
            total_size=sum(entry.size for entry in files.values()),
            chunk_count=sum(len(entry.chunks) for entry in files.values()),
            lineage=lineage or Lineage(),
        )

    def canonical_bytes(self) -> bytes:
        return canonical_json(self)

    @property
    def digest(self) -> str:
        """The version's identity: BLAKE3 of the canonical bytes."""
        return digest_bytes(self.canonical_bytes())

    @property
    def content_digest(self) -> str:
        """What the version holds, whenever its manifest was built: BLAKE3 of the canonical bytes
        without `created_at`. Pushing the same files with the same lineage again builds a manifest
        with another creation time, so another `digest`, and the same `content_digest`: the
        registry answers such a push with the version it already holds."""
        body = self.model_dump(mode="json")
        del body["created_at"]
        return digest_bytes(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())

    def chunk_ids(self) -> set[str]:
        return {chunk.id for entry in self.files.values() for chunk in entry.chunks}

    def unique_size(self) -> int:
        """The bytes of the version's distinct chunks: what its store holds (and its quota counts)."""
        return sum({chunk.id: chunk.size for entry in self.files.values() for chunk in entry.chunks}.values())

    def size_problem(self, *, max_bytes: int, max_amplification: float, amplification_floor: int) -> str | None:
        """Why the version is too large to accept, or None. A manifest is small and cheap to
        post, but its logical size is what evaluation assembles on a worker's disk and every pull
        writes on a node: one 64 MiB chunk listed 60,000 times in a 6.5 MiB manifest declares
        3.66 TiB. So the logical size is bounded outright, and (past `amplification_floor`, where
        small models' repeated zero blocks live) to `max_amplification` times the bytes the
        tenant stored. Real weights repeat little: tied or zero-initialised tensors, a few times."""
        if self.total_size > max_bytes:
            return f"the version declares {self.total_size} bytes, past the limit of {max_bytes} bytes per version"
        unique = self.unique_size()
        if self.total_size > amplification_floor and self.total_size > max_amplification * unique:
            return (
                f"the version declares {self.total_size} bytes from {unique} bytes of distinct chunks "
                f"({self.total_size / max(unique, 1):.0f} times over; at most {max_amplification:g} allowed): "
                "the same chunks are listed again and again"
            )
        return None


class EvaluationRecord(_Record):
    """Evaluation results for one version, recorded after the push; never part of its identity."""

    version: str = Field(pattern=HEX_DIGEST)
    evaluator: str = Field(min_length=1)
    results: dict[str, float]
    recorded_at: UtcDatetime
    failure: str | None = Field(default=None, max_length=2000, description="why the evaluation produced no results")
    details: dict[str, Any] | None = Field(default=None, description="what the evaluator names behind its results")

    @model_serializer(mode="wrap")
    def _without_empty_extras(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A record without a failure or details encodes (and so hashes and signs) as records always have.
        dumped = handler(self)
        for name in ("failure", "details"):
            if dumped.get(name) is None:
                dumped.pop(name, None)
        return dumped

    @field_validator("results")
    @classmethod
    def _finite(cls, results: dict[str, float]) -> dict[str, float]:
        # JSON has no NaN or infinity, and a gate comparing against NaN always passes silently.
        for metric, value in results.items():
            if not math.isfinite(value):
                raise ValueError(f"metric {metric!r} is not a finite number")
        return results

    @property
    def digest(self) -> str:
        return digest_bytes(canonical_json(self))


class PushLease(_Record):
    """A push in progress and the chunks it relies on; GC keeps them while the lease is fresh."""

    lease_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    model: str
    chunk_ids: list[str]
    created_at: UtcDatetime
    renewed_at: UtcDatetime


class SignedManifest(_Record):
    manifest: Manifest
    key_id: str = Field(pattern=HEX_DIGEST)
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @classmethod
    def parse(cls, raw: bytes | str, digest: str, *, source: str) -> SignedManifest:
        """The signed manifest in `raw`, which `source` keeps as version `digest`: unreadable or
        hashing to another digest is `ManifestTamperedError` (the signature is not checked here)."""
        try:
            signed = cls.model_validate_json(raw)
        except ValueError as exc:
            raise ManifestTamperedError(f"the manifest {source} as version {digest} is unreadable: {exc}") from None
        if signed.digest != digest:
            raise ManifestTamperedError(f"the manifest {source} as version {digest} hashes to {signed.digest}")
        return signed


class SignedEvaluation(_Record):
    record: EvaluationRecord
    key_id: str = Field(pattern=HEX_DIGEST)
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")


def key_id_of(verify_key: VerifyKey) -> str:
    return digest_bytes(bytes(verify_key))


class Signer:
    """An Ed25519 private key that signs manifests and evaluation records."""

    def __init__(self, signing_key: SigningKey) -> None:
        self._signing_key = signing_key
        self.verify_key = signing_key.verify_key
        self.key_id = key_id_of(self.verify_key)

    @classmethod
    def generate(cls) -> Signer:
        return cls(SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Signer:
        return cls(SigningKey(seed))

    def _sign(self, domain: bytes, body: bytes) -> str:
        return self._signing_key.sign(domain + body).signature.hex()

    def prove_possession(self, tenant_id: str) -> str:
        """The proof that registers this key for `tenant_id` (`POST /v1/signing-keys`)."""
        public = bytes(self.verify_key).hex()
        return self._signing_key.sign(possession_message(tenant_id, public)).signature.hex()

    def sign(self, manifest: Manifest) -> SignedManifest:
        signature = self._sign(_MANIFEST_DOMAIN, manifest.canonical_bytes())
        return SignedManifest(manifest=manifest, key_id=self.key_id, signature=signature)

    def sign_evaluation(self, record: EvaluationRecord) -> SignedEvaluation:
        signature = self._sign(_EVALUATION_DOMAIN, canonical_json(record))
        return SignedEvaluation(record=record, key_id=self.key_id, signature=signature)


class Keyring:
    """The public keys each tenant trusts to sign its versions and evaluations."""

    def __init__(self) -> None:
        self._trusted: dict[str, dict[str, VerifyKey]] = {}

    def trust(self, tenant: str, verify_key: VerifyKey | bytes) -> str:
        key = verify_key if isinstance(verify_key, VerifyKey) else VerifyKey(verify_key)
        key_id = key_id_of(key)
        self._trusted.setdefault(tenant, {})[key_id] = key
        return key_id

    def revoke(self, tenant: str, key_id: str) -> None:
        self._trusted.get(tenant, {}).pop(key_id, None)

    def _check(self, tenant: str, key_id: str, signature: str, domain: bytes, body: bytes) -> None:
        key = self._trusted.get(tenant, {}).get(key_id)
        if key is None:
            raise UnknownKeyError(f"key {key_id} is not trusted by tenant {tenant!r}")
        try:
            key.verify(domain + body, bytes.fromhex(signature))
        except _NaclBadSignature:
            raise BadSignatureError(f"signature by key {key_id} does not verify") from None

    def verify(self, signed: SignedManifest, *, tenant: str) -> Manifest:
        """Return the manifest if a key the tenant trusts signed exactly these bytes."""
        body = signed.manifest.canonical_bytes()
        try:
            self._check(tenant, signed.key_id, signed.signature, _MANIFEST_DOMAIN, body)
        except (BadSignatureError, UnknownKeyError) as exc:
            raise type(exc)(f"manifest {signed.digest}: {exc}") from None
        return signed.manifest

    def verify_evaluation(self, signed: SignedEvaluation, *, tenant: str) -> EvaluationRecord:
        body = canonical_json(signed.record)
        self._check(tenant, signed.key_id, signed.signature, _EVALUATION_DOMAIN, body)
        return signed.record


def is_digest(value: str) -> bool:
    return bool(_HEX_DIGEST_RE.fullmatch(value))
