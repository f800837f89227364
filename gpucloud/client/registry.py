"""The registry part of the public API's client: models, signing keys, chunks, versions,
aliases, gates, evaluations and GC, plus a push target and a pull source over them.

A pull through the API never trusts the API: `pull_version` verifies the manifest's digest and
signature against the keys the registry publishes for the tenant, hashes every chunk as it
arrives, checks every file, and only then renames the finished directory into place
(`gpucloud.registry.pull`). The tenant's signing key lives on the tenant's side
(`signer_for`: `<dir>/signing-keys/<tenant id>.ed25519`, mode 0600, created on first use).
"""

from __future__ import annotations

import http.client
import os
import ssl
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from nacl.signing import SigningKey, VerifyKey

from gpucloud.client.base import ApiClient, ApiError
from gpucloud.client.bulk import BROKEN, BulkConnections
from gpucloud.models.registry_names import MAX_IDS_PER_QUERY
from gpucloud.registry.integrity import ChunkCheck
from gpucloud.registry.manifest import (
    ChunkMissingError,
    ChunkRef,
    ChunkTransferError,
    EvaluationRecord,
    Keyring,
    ManifestTamperedError,
    SignedManifest,
    Signer,
    VersionNotFoundError,
    key_id_of,
)
from gpucloud.registry.pull import PullResult, pull
from gpucloud.registry.push import ChunksMissing, TransferProgress

# What a chunk upload retries besides busy answers: the connection failed, timed out or was garbled
# (not a file that changed under it, nor any other local error).
UPLOAD_BROKEN = (ConnectionError, TimeoutError, http.client.HTTPException, ssl.SSLEOFError, ssl.SSLZeroReturnError)


class RegistryClient(ApiClient):
    """The registry API, one method per call."""

    def __init__(self, base_url: str, token: str, *, transport: httpx.BaseTransport | None = None) -> None:
        # A chunk is up to 64 MiB: a write may take a while on a slow link.
        super().__init__(base_url, token, timeout_s=60.0, transport=transport)
        self.bulk = BulkConnections(self.base_url, token, timeout_s=60.0)

    def close(self) -> None:
        self.bulk.close()
        super().close()

    def signing_keys(self) -> tuple[str, list[dict]]:
        body = self.get("/v1/signing-keys")
        return body["tenant_id"], body["items"]

    def register_key(self, signer: Signer, tenant_id: str | None = None) -> dict:
        """Register the key, proving the caller holds its private half (for its own tenant)."""
        tenant_id = tenant_id or self.signing_keys()[0]
        body = {"public_key": bytes(signer.verify_key).hex(), "proof": signer.prove_possession(tenant_id)}
        return self.call("POST", "/v1/signing-keys", json=body)

    def ensure_model(self, model: str) -> dict:
        try:
            return self.get(f"/v1/models/{model}")
        except ApiError as exc:
            if exc.status != 404:
                raise
        return self.call("POST", "/v1/models", json={"name": model})

    def missing(self, model: str, chunk_ids: list[str]) -> list[str]:
        found: list[str] = []
        for start in range(0, len(chunk_ids), MAX_IDS_PER_QUERY):
            batch = chunk_ids[start : start + MAX_IDS_PER_QUERY]
            found += self.call("POST", f"/v1/models/{model}/chunks:missing", json={"chunk_ids": batch}, retry=True)[
                "missing"
            ]
        return found

    def upload(self, model: str, path: Path, chunk: ChunkRef) -> bool:
        """Send the chunk's bytes from the file; True if the store did not have them yet. A PUT of
        content under its own hash is idempotent, so a busy API or a cut connection is retried."""
        body = self.retried(
            lambda: self.bulk.upload(f"/v1/models/{model}/chunks/{chunk.id}", path, chunk.offset, chunk.size),
            broken=UPLOAD_BROKEN,
        )
        return body["stored"]

    def chunk_pieces(self, model: str, chunk_id: str) -> Iterator[memoryview]:
        """A chunk's bytes as served, unchecked (`BulkConnections.download`: each piece is valid
        until the next is asked for; an error answer is `ApiError`, a cut connection `BROKEN`)."""
        return self.bulk.download(f"/v1/models/{model}/chunks/{chunk_id}")

    def post_version(self, model: str, signed: SignedManifest) -> tuple[dict, bool]:
        """The version the manifest registers, and whether this call registered it (201) or the
        registry already held it (200: the same manifest, or the same files and lineage built at
        another time, answered with the version registered first)."""
        response = self.request(
            "POST",
            f"/v1/models/{model}/versions",
            content=signed.model_dump_json(),
            headers={"Content-Type": "application/json"},
        )
        return response.json(), response.status_code == 201

    def version(self, model: str, ref: str) -> dict:
        return self.get(f"/v1/models/{model}/versions/{ref}")

    def versions(self, model: str, *, page_size: int = 200) -> Iterator[dict]:
        return self.pages(f"/v1/models/{model}/versions", page_size=page_size)

    def promote(self, model: str, ref: str, alias: str) -> dict:
        return self.call("PUT", f"/v1/models/{model}/aliases/{alias}", json={"version": ref})

    def set_gates(self, model: str, gates: list[dict]) -> dict:
        return self.call("PUT", f"/v1/models/{model}/gates", json={"gates": gates})

    def collect_garbage(self, *, grace_seconds: int, dry_run: bool, tenant_id: str | None = None) -> dict:
        """Operator only: `POST /v1/registry/gc` (the client must hold the operator token)."""
        return self.call(
            "POST",
            "/v1/registry/gc",
            json={"grace_period_seconds": grace_seconds, "dry_run": dry_run, "tenant_id": tenant_id},
            timeout=httpx.Timeout(None, connect=10),  # a large store takes a while to scan
        )

    def set_evaluation(self, model: str, command: dict[str, Any] | None) -> dict:
        """Register the model's evaluation command (None removes it)."""
        if command is None:
            return self.call("DELETE", f"/v1/models/{model}/evaluation")
        return self.call("PUT", f"/v1/models/{model}/evaluation", json=command)

    def evaluate(self, model: str, ref: str, evaluator: str) -> dict:
        """Have the platform evaluate a version: the started evaluation and its operation."""
        return self.call("POST", f"/v1/models/{model}/versions/{ref}/evaluate", json={"evaluator": evaluator})

    def evaluations(self, model: str, ref: str) -> list[dict]:
        return self.get(f"/v1/models/{model}/versions/{ref}/evaluations")["items"]

    def operation(self, operation_id: str) -> dict:
        return self.get(f"/v1/operations/{operation_id}")

    def evaluate_and_wait(self, model: str, ref: str, evaluator: str, *, timeout_s: float) -> tuple[dict, dict]:
        """Have the platform evaluate a version and wait for it: the finished operation, and the
        record it kept (the newest platform record of that evaluator)."""
        started = self.evaluate(model, ref, evaluator)
        operation = self.wait_for(
            lambda: self.operation(started["operation"]["id"]),
            lambda op: op["status"] != "running",
            timeout_s=timeout_s,
            interval_s=0.3,
            what=f"{evaluator} evaluation of {model}@{ref}",
        )
        kept = [
            e
            for e in self.evaluations(model, started["version"])
            if e["source"] == "platform" and e["evaluator"] == evaluator
        ]
        if not kept:
            raise ApiError(500, {"type": "evaluation-missing", "detail": f"operation {operation['id']}: no record"})
        return operation, kept[-1]

    def evaluator_key(self) -> dict:
        return self.get("/v1/registry/evaluator-key")

    def record_evaluation(
        self, model: str, ref: str, *, evaluator: str, results: dict[str, float], signer: Signer
    ) -> dict:
        digest = self.version(model, ref)["digest"]
        record = EvaluationRecord(version=digest, evaluator=evaluator, results=results, recorded_at=datetime.now(UTC))
        return self.call(
            "POST",
            f"/v1/models/{model}/versions/{digest}/evaluations",
            content=signer.sign_evaluation(record).model_dump_json(),
            headers={"Content-Type": "application/json"},
        )


class RegistryPushTarget:
    """A push over the API (`gpucloud.registry.push.push`): the API's store keeps fresh uploads
    through its GC grace period, and a manifest whose chunks went missing meanwhile is refused
    with `chunks-missing`, after which the push sends what is gone again."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client

    def begin(self, model: str, signer: Signer) -> None:
        self.client.ensure_model(model)
        self.client.register_key(signer)

    def missing(self, model: str, chunk_ids: list[str]) -> list[str]:
        return self.client.missing(model, chunk_ids)

    def upload(self, model: str, chunk: ChunkRef, path: Path) -> None:
        self.client.upload(model, path, chunk)

    def keep_alive(self) -> None:
        return None

    def commit(self, model: str, signed: SignedManifest) -> dict[str, Any]:
        try:
            version, created = self.client.post_version(model, signed)
        except ApiError as exc:
            if exc.type != "chunks-missing":
                raise
            raise ChunksMissing(self.client.missing(model, sorted(signed.manifest.chunk_ids()))) from exc
        return {**version, "existed": not created}

    def end(self) -> None:
        return None


class RegistryPullSource:
    """The two calls `registry.pull` makes (`get` a manifest, `stream` a chunk), served by the API.

    `pull` needs nothing else of a chunk or manifest store, so this is passed as both. Every byte
    is hashed here, whatever the server claims; the error raised for bad bytes carries what they
    really hashed to, so `pull` can tell a swapped chunk from a truncated or corrupted one.
    """

    def __init__(self, client: RegistryClient, model: str) -> None:
        self.client, self.model = client, model
        self.chunks_done = 0
        self._lock = threading.Lock()

    def get(self, digest: str) -> SignedManifest:
        try:
            raw = self.client.request("GET", f"/v1/models/{self.model}/versions/{digest}/manifest").text
        except ApiError as problem:
            if problem.status == 404:
                raise VersionNotFoundError(f"version {digest}: {problem.detail}") from None
            if problem.type == "manifest-tampered":
                raise ManifestTamperedError(f"version {digest}: {problem.detail}") from None
            raise
        signed = SignedManifest.parse(raw, digest, source="served")
        return signed

    def stream(self, chunk_id: str) -> Iterator[memoryview]:
        # Pieces of up to 1 MiB, hashed on one thread: the download, the write and the API
        # serving it already keep every core busy.
        check, broken, received = ChunkCheck(chunk_id, size_hint=1), None, 0
        try:
            for piece in self.client.chunk_pieces(self.model, chunk_id):
                check.update(piece)
                received += len(piece)
                yield piece
        except ApiError as problem:
            if problem.status == 404:
                raise ChunkMissingError("not in the registry's store", chunk_id=chunk_id) from None
            if problem.status >= 500 or problem.status == 429:  # the API busy or its store failing: try again
                raise ChunkTransferError(f"registry answered {problem}", chunk_id=chunk_id) from None
            raise
        except BROKEN as exc:  # a cut connection, or the server aborting a chunk that failed its check
            broken = exc
        if broken is not None:
            actual = check.actual
            # The two look alike from here; `pull` retries, and if every try breaks, reports what
            # the bytes received hashed to (when any arrived at all).
            raise ChunkTransferError(
                f"transfer failed after {received} bytes: {broken!r}",
                chunk_id=chunk_id,
                actual_id=actual if received and actual != chunk_id else None,
            )
        check.verify(source="received bytes")
        with self._lock:
            self.chunks_done += 1


def pull_version(
    client: RegistryClient,
    model: str,
    ref: str,
    dest: Path,
    *,
    trusted: Iterable[VerifyKey | bytes],
    concurrency: int = 4,
    report: Callable[[TransferProgress, int, int], None] = lambda progress, done, total: None,
) -> PullResult:
    """Pull MODEL@REF into dest (which must not exist), verified against the keys the puller
    trusts (`trusted`: its own, and those in its local keyring) that the registry has not
    revoked; the keys the API serves are never enough, since the API could serve its own key
    with its own manifest and bytes."""
    version = client.version(model, ref)
    tenant_id, listed = client.signing_keys()
    # A key the registry no longer lists (revoked) is dropped: the API can take trust away
    # (which it could by refusing to answer anyway), never add it.
    live = {key["public_key"] for key in listed}
    keyring = Keyring()
    for key in trusted:
        raw = bytes(key) if isinstance(key, VerifyKey) else key
        if raw.hex() in live:
            keyring.trust(tenant_id, raw)
    source = RegistryPullSource(client, model)
    return pull(
        version["digest"],
        dest,
        chunk_store=source,  # type: ignore[arg-type]
        manifest_store=source,  # type: ignore[arg-type]
        keyring=keyring,
        tenant=tenant_id,
        concurrency=concurrency,
        progress=lambda p: report(p, source.chunks_done, version["chunk_count"]),
    )


def trusted_keys(data_dir: Path, tenant_id: str) -> list[VerifyKey]:
    """The keys this machine trusts for the tenant's versions: its own signing key (if it has
    one) and those added to its keyring (`<data dir>/trusted-keys/<tenant id>`, one hex public
    key a line; `gpucloud weights trust`)."""
    keys = []
    own = data_dir / "signing-keys" / f"{tenant_id}.ed25519"
    if own.exists():
        keys.append(signer_for(data_dir, tenant_id).verify_key)
    ring = data_dir / "trusted-keys" / tenant_id
    if ring.exists():
        keys += [VerifyKey(bytes.fromhex(line.split()[0])) for line in ring.read_text().splitlines() if line.strip()]
    return keys


def trust_key(data_dir: Path, tenant_id: str, public_key_hex: str, label: str = "") -> str:
    """Add a public key to the local keyring for the tenant; its key id."""
    key = VerifyKey(bytes.fromhex(public_key_hex))  # raises ValueError for anything else
    ring = data_dir / "trusted-keys" / tenant_id
    ring.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    known = ring.read_text().split() if ring.exists() else []
    if public_key_hex not in known:
        with ring.open("a") as f:
            f.write(f"{public_key_hex} {label}".rstrip() + "\n")
    return key_id_of(key)


def signer_for(data_dir: Path, tenant_id: str) -> Signer:
    """The tenant's signing key from `data_dir` (the CLI's: `cli.tenant_keys`), created (mode
    0600) on first use."""
    path = data_dir / "signing-keys" / f"{tenant_id}.ed25519"
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".new-key-")  # mkstemp creates it 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(SigningKey.generate().encode().hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # atomic create-if-absent: of two first pushes, one key wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return Signer.from_seed(bytes.fromhex(path.read_text().strip()))
