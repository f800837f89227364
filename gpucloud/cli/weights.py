"""`gpucloud weights`: push, pull, promote and list model versions through the registry API.

The CLI talks to the API over HTTP with the tenant's API key (`--api-key` / `GPUCLOUD_API_KEY`;
the URL from `--api-url` / `GPUCLOUD_API_URL`, else the configured API address).

A push chunks and hashes the directory locally (`gpucloud.registry.chunking`), signs the manifest
with the tenant's Ed25519 key, asks the API which chunks its store lacks, uploads only those, then
posts the signed manifest. An interrupted push, run again, uploads only what is still missing.
The signing key lives in `<data dir>/signing-keys/<tenant id>.ed25519` (mode 0600); it is created
on the first push and registered with the API, which checks every manifest against it.

A pull never trusts the API: it verifies the manifest's digest and signature against the keys the
registry publishes for the tenant, hashes every chunk as it arrives, checks every file, and only
then renames the finished directory into place (`gpucloud.registry.pull`). Any mismatch stops it
with an error that names the chunk, file or key, and leaves nothing at the destination.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from nacl.signing import SigningKey
from rich.console import Console
from rich.filesize import decimal as human_size
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from gpucloud.config import get_settings
from gpucloud.models.registry_tables import MAX_IDS_PER_QUERY, AliasName
from gpucloud.registry.chunking import DEFAULT_POLICY, ChunkPolicy, MiB, chunk_file, new_hasher
from gpucloud.registry.manifest import (
    ChunkCorruptedError,
    ChunkMissingError,
    ChunkRef,
    ChunkTransferError,
    EvaluationRecord,
    IntegrityError,
    Keyring,
    Lineage,
    Manifest,
    ManifestTamperedError,
    SignedManifest,
    Signer,
    VersionNotFoundError,
)
from gpucloud.registry.pull import PullResult, pull
from gpucloud.registry.push import TransferProgress, source_files

weights_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Model weights: push, pull, promote and list versions through the registry API.",
)
out = Console()
err = Console(stderr=True)

UPLOAD_PIECE = 1 * MiB


class RegistryApiError(Exception):
    """The API refused a request; `type` is the problem type's last segment (e.g. `gates-failed`)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status, self.body = status, body
        self.type = str(body.get("type", "")).rsplit("/", 1)[-1]
        super().__init__(f"{body.get('title', 'HTTP error')} ({status}): {body.get('detail', '')}")

    @classmethod
    def from_response(cls, response: httpx.Response) -> RegistryApiError:
        try:
            body = response.json()
        except ValueError:
            body = {"detail": response.text[:500]}
        return cls(response.status_code, body if isinstance(body, dict) else {"detail": str(body)})


class RegistryClient:
    """The registry API, one method per call the CLI makes."""

    def __init__(self, api_url: str, api_key: str, *, transport: httpx.BaseTransport | None = None) -> None:
        self.http = httpx.Client(
            base_url=api_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(60, connect=10),
            transport=transport,
        )

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise RegistryApiError.from_response(response)
        return response.json()

    def signing_keys(self) -> tuple[str, list[dict]]:
        body = self.call("GET", "/v1/signing-keys")
        return body["tenant_id"], body["items"]

    def register_key(self, signer: Signer) -> dict:
        return self.call("POST", "/v1/signing-keys", json={"public_key": bytes(signer.verify_key).hex()})

    def ensure_model(self, model: str) -> dict:
        try:
            return self.call("GET", f"/v1/models/{model}")
        except RegistryApiError as exc:
            if exc.status != 404:
                raise
        return self.call("POST", "/v1/models", json={"name": model})

    def missing(self, model: str, chunk_ids: list[str]) -> list[str]:
        found: list[str] = []
        for start in range(0, len(chunk_ids), MAX_IDS_PER_QUERY):
            batch = chunk_ids[start : start + MAX_IDS_PER_QUERY]
            found += self.call("POST", f"/v1/models/{model}/chunks:missing", json={"chunk_ids": batch})["missing"]
        return found

    def upload(self, model: str, path: Path, chunk: ChunkRef) -> bool:
        headers = {"Content-Length": str(chunk.size), "Content-Type": "application/octet-stream"}
        body = self.call(
            "PUT",
            f"/v1/models/{model}/chunks/{chunk.id}",
            headers=headers,
            content=_file_pieces(path, chunk.offset, chunk.size),
        )
        return body["stored"]

    def post_version(self, model: str, signed: SignedManifest) -> dict:
        return self.call(
            "POST",
            f"/v1/models/{model}/versions",
            content=signed.model_dump_json(),
            headers={"Content-Type": "application/json"},
        )

    def version(self, model: str, ref: str) -> dict:
        return self.call("GET", f"/v1/models/{model}/versions/{ref}")

    def versions(self, model: str, *, page_size: int = 200) -> Iterator[dict]:
        token = ""
        while True:
            page = self.call(
                "GET",
                f"/v1/models/{model}/versions",
                params={"page_size": page_size, **({"page_token": token} if token else {})},
            )
            yield from page["items"]
            if not (token := page["next_page_token"]):
                return

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
            timeout=httpx.Timeout(None, connect=10),
        )  # a large store takes a while to scan

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


def _file_pieces(path: Path, offset: int, size: int) -> Iterator[bytes]:
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while size:
            piece = f.read(min(UPLOAD_PIECE, size))
            if not piece:
                raise EOFError(f"{path} ended at offset {f.tell()}, inside a chunk: it changed since it was hashed")
            size -= len(piece)
            yield piece


def signer_for(data_dir: Path, tenant_id: str) -> Signer:
    """The tenant's signing key from the data dir, created (mode 0600) on first use."""
    path = data_dir / "signing-keys" / f"{tenant_id}.ed25519"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
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


# ---------------------------------------------------------------- push and pull


@dataclass
class PushStats:
    """What a push did; `bytes_skipped` were not sent because the store (or this push) had them."""

    bytes_total: int = 0
    chunks_total: int = 0
    bytes_hashed: int = 0
    bytes_to_upload: int = 0
    chunks_to_upload: int = 0
    bytes_uploaded: int = 0
    chunks_uploaded: int = 0
    uploaded_ids: list[str] = field(default_factory=list)

    @property
    def bytes_skipped(self) -> int:
        return self.bytes_total - self.bytes_to_upload


PushReport = Callable[[str, PushStats], None]


@dataclass(frozen=True)
class PushOutcome:
    version: dict
    signed: SignedManifest
    stats: PushStats

    @property
    def digest(self) -> str:
        return self.signed.digest


def _upload_all(
    client: RegistryClient,
    model: str,
    sources: list[tuple[Path, ChunkRef]],
    stats: PushStats,
    report: PushReport,
    concurrency: int,
) -> None:
    lock = threading.Lock()

    def one(source: tuple[Path, ChunkRef]) -> None:
        path, chunk = source
        client.upload(model, path, chunk)
        with lock:
            stats.chunks_uploaded += 1
            stats.bytes_uploaded += chunk.size
            stats.uploaded_ids.append(chunk.id)
            report("upload", stats)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one, source) for source in sources]
        try:
            for future in futures:
                future.result()
        except BaseException:
            # The first failure stops the push; the chunks already stored stay for the resume.
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def push_directory(
    client: RegistryClient,
    source_dir: Path,
    *,
    model: str,
    signer: Signer,
    lineage: Lineage | None = None,
    policy: ChunkPolicy = DEFAULT_POLICY,
    concurrency: int = 4,
    report: PushReport = lambda phase, stats: None,
) -> PushOutcome:
    """Push every regular file under source_dir as one signed version of model."""
    files = source_files(Path(source_dir))
    stats = PushStats(bytes_total=sum(path.stat().st_size for _, path in files))

    def hashed(size: int) -> None:
        stats.bytes_hashed += size
        report("hash", stats)

    entries = {relative: chunk_file(path, policy=policy, on_chunk=hashed) for relative, path in files}
    signed = signer.sign(Manifest.build(model=model, files=entries, lineage=lineage))
    stats.chunks_total = signed.manifest.chunk_count
    client.ensure_model(model)
    client.register_key(signer)

    sources: dict[str, tuple[Path, ChunkRef]] = {}
    for relative, path in files:
        for chunk in entries[relative].chunks:
            sources.setdefault(chunk.id, (path, chunk))
    missing = client.missing(model, list(sources))
    stats.chunks_to_upload = len(missing)
    stats.bytes_to_upload = sum(sources[chunk_id][1].size for chunk_id in missing)
    report("upload", stats)
    _upload_all(client, model, [sources[chunk_id] for chunk_id in missing], stats, report, concurrency)
    try:
        version = client.post_version(model, signed)
    except RegistryApiError as exc:
        if exc.type != "chunks-missing":
            raise
        # Removed from the store after we asked (garbage collection of a long-interrupted push):
        # send them again, once.
        _upload_all(
            client, model, [sources[c] for c in client.missing(model, list(sources))], stats, report, concurrency
        )
        version = client.post_version(model, signed)
    return PushOutcome(version=version, signed=signed, stats=stats)


class _ApiSource:
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
            signed = SignedManifest.model_validate_json(
                self.client.http.get(f"/v1/models/{self.model}/versions/{digest}/manifest").raise_for_status().text
            )
        except httpx.HTTPStatusError as exc:
            problem = RegistryApiError.from_response(exc.response)
            if problem.status == 404:
                raise VersionNotFoundError(f"version {digest}: {problem.body.get('detail')}") from None
            if problem.type == "manifest-tampered":
                raise ManifestTamperedError(f"version {digest}: {problem.body.get('detail')}") from None
            raise problem from None
        except ValueError as exc:
            raise ManifestTamperedError(f"the manifest served for version {digest} is unreadable: {exc}") from None
        if signed.digest != digest:
            raise ManifestTamperedError(f"the manifest served for version {digest} hashes to {signed.digest}")
        return signed

    def stream(self, chunk_id: str) -> Iterator[bytes]:
        hasher, broken, received = new_hasher(MiB), None, 0
        try:
            with self.client.http.stream("GET", f"/v1/models/{self.model}/chunks/{chunk_id}") as response:
                if response.status_code == 404:
                    raise ChunkMissingError("not in the registry's store", chunk_id=chunk_id)
                if response.status_code >= 500:  # the API or its store failing: worth another try
                    response.read()
                    raise ChunkTransferError(
                        f"registry answered {response.status_code}: {response.text[:200]}", chunk_id=chunk_id
                    )
                if response.status_code >= 400:
                    response.read()
                    raise RegistryApiError.from_response(response)
                for piece in response.iter_bytes():
                    hasher.update(piece)
                    received += len(piece)
                    yield piece
        except httpx.TransportError as exc:  # a cut connection, or the server aborting a chunk that failed its check
            broken = exc
        actual = hasher.hexdigest()
        if broken is not None:
            # The two look alike from here; `pull` retries, and if every try breaks, reports what
            # the bytes received hashed to (when any arrived at all).
            raise ChunkTransferError(
                f"transfer failed after {received} bytes: {broken!r}",
                chunk_id=chunk_id,
                actual_id=actual if received and actual != chunk_id else None,
            )
        if actual != chunk_id:
            raise ChunkCorruptedError(f"received bytes hash to {actual}", chunk_id=chunk_id, actual_id=actual)
        with self._lock:
            self.chunks_done += 1


def pull_version(
    client: RegistryClient,
    model: str,
    ref: str,
    dest: Path,
    *,
    concurrency: int = 4,
    report: Callable[[TransferProgress, int, int], None] = lambda progress, done, total: None,
) -> PullResult:
    """Pull MODEL@REF into dest (which must not exist), verified against the published keys."""
    version = client.version(model, ref)
    tenant_id, keys = client.signing_keys()
    keyring = Keyring()
    for key in keys:
        keyring.trust(tenant_id, bytes.fromhex(key["public_key"]))
    source = _ApiSource(client, model)
    return pull(
        version["digest"],
        dest,
        chunk_store=source,
        manifest_store=source,  # type: ignore[arg-type]
        keyring=keyring,
        tenant=tenant_id,
        concurrency=concurrency,
        progress=lambda p: report(p, source.chunks_done, version["chunk_count"]),
    )


def parse_target(target: str) -> tuple[str, str]:
    model, sep, ref = target.partition("@")
    if not sep or not model or not ref:
        raise typer.BadParameter(f"{target!r} is not MODEL@VERSION or MODEL@ALIAS", param_hint="TARGET")
    return model, ref


# ---------------------------------------------------------------- commands

ApiUrl = Annotated[
    str | None,
    typer.Option("--api-url", envvar="GPUCLOUD_API_URL", help="registry API; default: the configured API address"),
]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar="GPUCLOUD_API_KEY", help="the tenant's API key")]


def _client(api_url: str | None, api_key: str | None) -> RegistryClient:
    if not api_key:
        err.print("[red]error:[/] no API key: set GPUCLOUD_API_KEY or pass --api-key")
        raise typer.Exit(1)
    return RegistryClient(api_url or get_settings().api_url, api_key)


def failing_metrics_table(failures: list[dict]) -> Table:
    table = Table("metric", "value", "production", "why it fails", title="failing evaluation gates")
    for f in failures:
        table.add_row(f["metric"], _num(f.get("value")), _num(f.get("production_value")), f["reason"])
    return table


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


@contextmanager
def _reported_errors() -> Iterator[None]:
    """Turn the failures a person can act on into one clear line and a non-zero exit."""
    try:
        yield
    except RegistryApiError as exc:
        if exc.type == "gates-failed":
            err.print(failing_metrics_table(exc.body.get("failing_metrics", [])))
        if exc.type == "signing-key-revoked":
            err.print(
                f"the local signing key was revoked: move {get_settings().data_dir / 'signing-keys'}"
                "/<tenant id>.ed25519 away and push again to create and register a new one"
            )
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    except IntegrityError as exc:
        err.print(f"[red]integrity check failed ({type(exc).__name__}):[/] {exc}")
        err.print("nothing was written to the destination")
        raise typer.Exit(2) from None
    except httpx.TransportError as exc:
        err.print(f"[red]error:[/] cannot reach the registry API: {exc}")
        raise typer.Exit(1) from None
    except (httpx.HTTPError, OSError, ValueError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None


def _bars(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<8}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[detail]}"),
        console=console,
        transient=False,
    )


def _version_digest(client: RegistryClient, model: str, ref: str) -> str:
    model, ref = parse_target(ref) if "@" in ref else (model, ref)
    return client.version(model, ref)["digest"]


def push_with_progress(
    client: RegistryClient,
    source: Path,
    *,
    model: str,
    signer: Signer,
    console: Console,
    lineage: Lineage | None = None,
    policy: ChunkPolicy = DEFAULT_POLICY,
) -> PushOutcome:
    """`push_directory` with progress bars: bytes hashed, then bytes and chunks uploaded and bytes skipped."""
    with _bars(console) as bars:
        hashing = bars.add_task("hash", total=None, detail="")
        upload = bars.add_task("upload", total=None, detail="", visible=False)

        def report(phase: str, s: PushStats) -> None:
            if phase == "hash":
                bars.update(hashing, completed=s.bytes_hashed, total=s.bytes_total)
                return
            bars.update(
                upload,
                visible=True,
                completed=s.bytes_uploaded,
                total=s.bytes_to_upload,
                detail=f"{s.chunks_uploaded}/{s.chunks_to_upload} chunks, "
                f"{human_size(s.bytes_skipped)} skipped (dedup)",
            )

        outcome = push_directory(
            client, source, model=model, signer=signer, lineage=lineage, policy=policy, report=report
        )
    s = outcome.stats
    console.print(
        f"pushed {model}@{outcome.digest}\n  {s.chunks_uploaded} of {s.chunks_total} chunks uploaded "
        f"({human_size(s.bytes_uploaded)}), {human_size(s.bytes_skipped)} of "
        f"{human_size(s.bytes_total)} skipped by dedup"
    )
    return outcome


def pull_with_progress(client: RegistryClient, model: str, ref: str, dest: Path, *, console: Console) -> PullResult:
    """`pull_version` with a progress bar of bytes and chunks verified."""
    with _bars(console) as bars:
        task = bars.add_task("pull", total=None, detail="")
        result = pull_version(
            client,
            model,
            ref,
            dest,
            report=lambda p, done, total: bars.update(
                task, completed=p.done, total=p.total, detail=f"{done}/{total} chunks verified"
            ),
        )
    console.print(
        f"pulled {model}@{result.manifest.digest[:12]} into {result.path}: {len(result.manifest.files)} "
        f"files, {human_size(result.bytes_total)}, every chunk and file verified"
    )
    return result


@weights_app.command("push")
def push_command(
    directory: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="the files of one version")],
    model: Annotated[str, typer.Option("--model", help="model name (created on first push)")],
    parent: Annotated[str | None, typer.Option(help="parent: VERSION of this model, or MODEL@VERSION")] = None,
    base_model: Annotated[str | None, typer.Option(help="base model this was trained from")] = None,
    training_run: Annotated[str | None, typer.Option(help="training run id")] = None,
    dataset: Annotated[list[str] | None, typer.Option(help="dataset digest (repeatable)")] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Push DIR as a new signed version of MODEL, uploading only the chunks the registry lacks."""
    with _reported_errors(), _client(api_url, api_key) as client:
        signer = signer_for(get_settings().data_dir, client.signing_keys()[0])
        lineage = Lineage(
            parent=_version_digest(client, model, parent) if parent else None,
            base_model=base_model,
            training_run=training_run,
            dataset_digests=dataset or [],
        )
        push_with_progress(client, directory, model=model, signer=signer, lineage=lineage, console=out)


@weights_app.command("pull")
def pull_command(
    target: Annotated[str, typer.Argument(help="MODEL@VERSION (digest or unique prefix) or MODEL@ALIAS")],
    directory: Annotated[Path, typer.Argument(help="destination; must not exist yet")],
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Pull a version into DIR, verifying every chunk and file against its signed manifest."""
    model, ref = parse_target(target)
    with _reported_errors(), _client(api_url, api_key) as client:
        pull_with_progress(client, model, ref, directory, console=out)


@weights_app.command("promote")
def promote_command(
    model: str,
    version: Annotated[str, typer.Argument(help="digest, unique prefix, or alias")],
    to: Annotated[AliasName, typer.Option("--to", help="the alias to move")],
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Move an alias to a version; staging and production move only when the model's gates pass."""
    with _reported_errors(), _client(api_url, api_key) as client:
        alias = client.promote(model, version, to.value)
    out.print(f"{model}@{to.value} -> {alias['version']}")


@weights_app.command("versions")
def versions_command(model: str, api_url: ApiUrl = None, api_key: ApiKey = None) -> None:
    """List a model's versions, oldest first."""
    table = Table("version", "created", "size", "chunks", "parent", "aliases", "metrics", title=f"{model} versions")
    with _reported_errors(), _client(api_url, api_key) as client:
        for v in client.versions(model):
            metrics = ", ".join(f"{k}={val:g}" for k, val in sorted(v["metrics"].items()))
            table.add_row(
                v["digest"][:12],
                v["created_at"][:19].replace("T", " "),
                human_size(v["total_size"]),
                str(v["chunk_count"]),
                (v["parent"] or "")[:12],
                ", ".join(v["aliases"]),
                metrics,
            )
    out.print(table)


def _metric_values(pairs: list[str]) -> dict[str, float]:
    values = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            values[name] = float(value)
        except ValueError:
            values[name] = math.nan
        if not name or not math.isfinite(values[name]):
            raise typer.BadParameter(f"{pair!r} is not NAME=NUMBER", param_hint="--metric")
    return values


@weights_app.command("evaluate")
def evaluate_command(
    model: str,
    version: Annotated[str, typer.Argument(help="digest, unique prefix, or alias")],
    metric: Annotated[list[str], typer.Option(help="NAME=VALUE (repeatable)")],
    evaluator: Annotated[str, typer.Option(help="who measured these results")] = "cli",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Record evaluation results for a version, signed with the tenant's key."""
    results = _metric_values(metric)
    with _reported_errors(), _client(api_url, api_key) as client:
        signer = signer_for(get_settings().data_dir, client.signing_keys()[0])
        client.register_key(signer)
        recorded = client.record_evaluation(model, version, evaluator=evaluator, results=results, signer=signer)
    out.print(f"recorded {len(results)} results for {model}@{recorded['version'][:12]}")


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """`90s`, `30m`, `24h`, `7d` (or plain seconds) as seconds."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _DURATION_UNITS else (text, "s")
    if not number.isdigit():
        raise typer.BadParameter(f"{text!r} is not a duration like 30m, 24h or 7d", param_hint="--grace")
    return int(number) * _DURATION_UNITS[unit]


def gc_table(report: dict) -> Table:
    verb = "would remove" if report["dry_run"] else "removed"
    table = Table(
        "tenant",
        "chunks scanned",
        "referenced",
        "young",
        verb,
        "bytes",
        "leases expired",
        title=f"registry garbage collection (grace {report['grace_period_seconds']}s)",
    )
    for t in report["tenants"]:
        table.add_row(
            t["tenant_id"],
            str(t["chunks_scanned"]),
            str(t["chunks_referenced"]),
            str(t["chunks_young"]),
            str(t["chunks_deleted"]),
            human_size(t["bytes_deleted"]),
            str(t["leases_expired"]),
        )
    return table


@weights_app.command("gc")
def gc_command(
    grace: Annotated[str, typer.Option(help="keep unreferenced chunks younger than this (30m, 24h, 7d)")] = "24h",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list what would be removed, remove nothing")] = False,
    tenant: Annotated[str | None, typer.Option(help="one tenant id; default: every tenant")] = None,
    api_url: ApiUrl = None,
    operator_token: Annotated[
        str | None,
        typer.Option(
            "--operator-token", envvar="GPUCLOUD_API__OPERATOR_TOKEN", help="default: the configured operator token"
        ),
    ] = None,
) -> None:
    """Operators: remove chunks no version references, older than the grace period (never a push's)."""
    grace_seconds = parse_duration(grace)
    with _reported_errors(), _client(api_url, operator_token or get_settings().operator_token) as client:
        report = client.collect_garbage(grace_seconds=grace_seconds, dry_run=dry_run, tenant_id=tenant)
    out.print(gc_table(report))
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {report['chunks_deleted']} chunks ({human_size(report['bytes_deleted'])})")
