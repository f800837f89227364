"""`gpucloud weights`: push, pull, promote and list model versions through the registry API.

The CLI talks to the API over HTTP with the tenant's API key, through `gpucloud.client.registry`;
the URL and the key come as for every command (`--api-url`, `--api-key`, their variables, else the
CLI's context: `gpucloud.cli.contexts`).

A push (`gpucloud.registry.push`) chunks and hashes the directory locally, signs the manifest
with the tenant's Ed25519 key, asks the API which chunks its store lacks, uploads only those, then
posts the signed manifest. An interrupted push, run again, uploads only what is still missing.
The signing key lives in the CLI's per-user config folder (`gpucloud.cli.tenant_keys`:
`~/.config/gpucloud/signing-keys/<tenant id>.ed25519`, mode 0600); it is created on the first push
and registered with the API, which checks every manifest against it.

A pull never trusts the API (`gpucloud.client.registry.pull_version`): any mismatch stops it
with an error that names the chunk, file or key, and leaves nothing at the destination. It trusts
this user's own signing key and the keys `gpucloud weights trust` added, nothing the API serves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import httpx
import typer
from rich.console import Console
from rich.filesize import decimal as human_size
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from gpucloud.cli import tenant_keys
from gpucloud.cli.common import (
    ApiKey,
    ApiUrl,
    Output,
    WideOutput,
    connect,
    console,
    err,
    id_column,
    parse_duration,
    print_table,
    reported_errors,
)
from gpucloud.client.base import ApiError
from gpucloud.client.registry import RegistryClient, RegistryPushTarget, pull_version, trusted_keys
from gpucloud.models.registry_names import AliasName, split_ref
from gpucloud.registry.chunking import DEFAULT_POLICY, ChunkPolicy
from gpucloud.registry.manifest import IntegrityError, Lineage, Signer, UnknownKeyError, key_id_of
from gpucloud.registry.pull import PullResult
from gpucloud.registry.push import PushResult, PushStats, push

weights_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Model weights: push, pull, promote and list versions through the registry API.",
)
if TYPE_CHECKING:  # numpy and safetensors load only when an evaluator runs
    pass

out = console


def parse_target(target: str) -> tuple[str, str]:
    """MODEL@REF, read as the API reads it (`names.split_ref`)."""
    try:
        model, ref = split_ref(target)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="TARGET") from None
    if model is None:
        raise typer.BadParameter(f"{target!r} is not MODEL@VERSION or MODEL@ALIAS", param_hint="TARGET")
    return model, ref


# ---------------------------------------------------------------- commands


def _client(
    api_url: str | None, api_key: str | None, *, operator: bool = False, key_option: str = "--api-key"
) -> RegistryClient:
    """The registry API through the CLI's one resolution (`cli.common.connect`)."""
    connection = connect(api_url, api_key, operator=operator, key_option=key_option)
    return RegistryClient(connection.api_url, connection.token)


def failing_metrics_table(failures: list[dict]) -> Table:
    table = Table("metric", "evaluator", "value", "production", "why it fails", title="failing evaluation gates")
    for f in failures:
        table.add_row(
            f["metric"] or "(the run)",
            f.get("evaluator", ""),
            _num(f.get("value")),
            _num(f.get("production_value")),
            f["reason"],
        )
    return table


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


@contextmanager
def _reported_errors() -> Iterator[None]:
    """Turn the failures a person can act on into one clear line and a non-zero exit (2: the
    bytes failed their integrity check and nothing was written)."""
    try:
        with reported_errors(what="the registry API"):
            try:
                yield
            except ApiError as exc:
                if exc.type == "gates-failed":
                    err.print(failing_metrics_table(exc.body.get("failing_metrics", [])))
                if exc.type == "signing-key-revoked":
                    err.print(
                        f"the local signing key was revoked: move {tenant_keys.keys_dir() / 'signing-keys'}"
                        "/<tenant id>.ed25519 away and push again to create and register a new one",
                        highlight=False,
                    )
                raise
    except IntegrityError as exc:
        err.print(f"[red]integrity check failed ({type(exc).__name__}):[/] {exc}")
        if isinstance(exc, UnknownKeyError):
            err.print(UNTRUSTED_KEY_HINT.format(folder=tenant_keys.keys_dir()), highlight=False)
        err.print("nothing was written to the destination")
        raise typer.Exit(2) from None
    except (httpx.HTTPError, OSError, ValueError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None


UNTRUSTED_KEY_HINT = (
    "a pull trusts only this user's own signing key and the keys trusted here ({folder}), never one "
    "the API serves: `gpucloud weights keys -o wide` lists the tenant's keys, their ids, and which are "
    "trusted here; if you know the key is yours, `gpucloud weights trust PUBLIC_KEY` trusts it, then pull "
    "again"
)


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
) -> PushResult:
    """`push` over the API with progress bars: bytes hashed, then bytes and chunks uploaded and skipped."""
    with _bars(console) as bars:
        hashing = bars.add_task("hash", total=None, detail="")
        upload = bars.add_task("upload", total=None, detail="", visible=False)

        def report(phase: Literal["hash", "upload"], s: PushStats) -> None:
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

        outcome = push(
            source,
            model=model,
            target=RegistryPushTarget(client),
            signer=signer,
            lineage=lineage,
            policy=policy,
            report=report,
        )
    s = outcome.stats
    headline = (
        f"{model}@{outcome.digest} already existed (the same files and lineage): nothing new was registered"
        if outcome.existed
        else f"pushed {model}@{outcome.digest}"
    )
    console.print(
        f"{headline}\n  {s.chunks_uploaded} of {s.chunks_total} chunks uploaded "
        f"({human_size(s.bytes_uploaded)}), {human_size(s.bytes_skipped)} of "
        f"{human_size(s.bytes_total)} skipped by dedup"
    )
    return outcome


def pull_with_progress(
    client: RegistryClient, model: str, ref: str, dest: Path, *, console: Console, keys_dir: Path | None = None
) -> PullResult:
    """`pull_version` with a progress bar of bytes and chunks verified, trusting only this
    user's keys (its own signing key and its keyring, `gpucloud weights trust`: `cli.tenant_keys`,
    or those in `keys_dir`)."""
    tenant_id = client.signing_keys()[0]
    trusted = tenant_keys.trusted(tenant_id) if keys_dir is None else trusted_keys(keys_dir, tenant_id)
    with _bars(console) as bars:
        task = bars.add_task("pull", total=None, detail="")
        result = pull_version(
            client,
            model,
            ref,
            dest,
            trusted=trusted,
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
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Push DIR as a new signed version of MODEL, uploading only the chunks the registry lacks."""
    with _reported_errors(), _client(api_url, api_key) as client:
        signer = tenant_keys.signer(client.signing_keys()[0])
        lineage = Lineage(
            parent=_version_digest(client, model, parent) if parent else None,
            base_model=base_model,
            training_run=training_run,
            dataset_digests=dataset or [],
        )
        console = err if output == "json" else out
        pushed = push_with_progress(client, directory, model=model, signer=signer, lineage=lineage, console=console)
    if output == "json":
        body = {"version": pushed.version, "existed": pushed.existed, "stats": pushed.stats.as_dict()}
        print(json.dumps(body, default=str))


@weights_app.command("pull")
def pull_command(
    target: Annotated[str, typer.Argument(help="MODEL@VERSION (digest or unique prefix) or MODEL@ALIAS")],
    directory: Annotated[Path, typer.Argument(help="destination; must not exist yet")],
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Pull a version into DIR, verifying every chunk and file against its signed manifest."""
    model, ref = parse_target(target)
    with _reported_errors(), _client(api_url, api_key) as client:
        pulled = pull_with_progress(client, model, ref, directory, console=err if output == "json" else out)
    if output == "json":
        body = {"digest": pulled.manifest.digest, "path": str(pulled.path), "bytes": pulled.bytes_total}
        print(json.dumps(body | {"chunks": pulled.chunks_total}))


@weights_app.command("trust")
def trust_command(
    public_key: Annotated[str, typer.Argument(help="an Ed25519 public key, 64 hex digits (`weights keys` shows them)")],
    label: Annotated[str, typer.Option(help="who holds it (kept beside it)")] = "",
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Trust a key for this tenant's versions for this user: pulls verify against this keyring
    (in the CLI's config folder) and this user's own signing key only, never against keys the API
    serves."""
    with _reported_errors(), _client(api_url, api_key) as client:
        tenant_id = client.signing_keys()[0]
    try:
        key_id = tenant_keys.trust(tenant_id, public_key.lower(), label)
    except ValueError as exc:
        raise typer.BadParameter(f"not an Ed25519 public key in hex: {exc}", param_hint="PUBLIC_KEY") from None
    if output == "json":
        print(json.dumps({"key_id": key_id, "tenant_id": tenant_id, "label": label}))
        return
    out.print(f"trusting key {key_id} for {tenant_id} (in {tenant_keys.keys_dir()})", highlight=False)


@weights_app.command("keys")
def keys_command(
    output: WideOutput = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The tenant's keys the registry lists (the public key `weights trust` takes), and whether
    this user trusts each for pulls; `-o wide` adds each key's id (what refusals name)."""
    with _reported_errors(), _client(api_url, api_key) as client:
        tenant_id, keys = client.signing_keys()
    trusted = {key_id_of(k) for k in tenant_keys.trusted(tenant_id)}
    rows = [
        {"key_id": k["key_id"], "public_key": k["public_key"], "trusted_here": k["key_id"] in trusted} for k in keys
    ]
    if output == "json":
        print(json.dumps(rows, indent=2))
        return
    wide = output == "wide"
    key_id = (id_column("key id"),) if wide else ()
    table = Table(id_column("public key"), "trusted here", *key_id, title=f"signing keys of {tenant_id}")
    for row in rows:
        table.add_row(row["public_key"], "yes" if row["trusted_here"] else "no", *((row["key_id"],) if wide else ()))
    print_table(table, out=out)


@weights_app.command("promote")
def promote_command(
    model: str,
    version: Annotated[str, typer.Argument(help="digest, unique prefix, or alias")],
    to: Annotated[AliasName, typer.Option("--to", help="the alias to move")],
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Move an alias to a version; staging and production move only when the model's gates pass."""
    with _reported_errors(), _client(api_url, api_key) as client:
        alias = client.promote(model, version, to.value)
    if output == "json":
        print(json.dumps(alias))
        return
    out.print(f"{model}@{to.value} -> {alias['version']}")


@weights_app.command("versions")
def versions_command(
    model: str,
    output: WideOutput = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """List a model's versions, oldest first, digests in full, with the platform's evaluation
    results and, apart, what the tenant reported (which no gate accepts); `-o wide` adds each
    version's parent."""
    with _reported_errors(), _client(api_url, api_key) as client:
        versions = list(client.versions(model))
    if output == "json":
        print(json.dumps(versions, indent=2))
        return
    wide = output == "wide"
    parent = (id_column("parent"),) if wide else ()
    table = Table(
        id_column("version"),
        "created",
        "size",
        *parent,
        "aliases",
        "platform results",
        "reported",
        title=f"{model} versions",
    )
    for v in versions:
        table.add_row(
            v["digest"],
            v["created_at"][:19].replace("T", " "),
            human_size(v["total_size"]),
            *((v["parent"] or "",) if wide else ()),
            ", ".join(v["aliases"]),
            _metric_list(v["metrics"]),
            _metric_list(v.get("reported_metrics", {})),
        )
    print_table(table, out=out)


def _metric_list(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={val:g}" for k, val in sorted(metrics.items()))


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
    output: Output = "table",
    api_url: ApiUrl = None,
    operator_token: Annotated[
        str | None,
        typer.Option(
            "--operator-token",
            help="an operator's token; else GPUCLOUD_API__OPERATOR_TOKEN, else the context's (`gpucloud config view`)",
        ),
    ] = None,
) -> None:
    """Operators: remove chunks no version references, older than the grace period (never a push's)."""
    grace_seconds = parse_duration(grace, option="--grace")
    with _reported_errors(), _client(api_url, operator_token, operator=True, key_option="--operator-token") as client:
        report = client.collect_garbage(grace_seconds=grace_seconds, dry_run=dry_run, tenant_id=tenant)
    if output == "json":
        print(json.dumps(report))
        return
    out.print(gc_table(report))
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {report['chunks_deleted']} chunks ({human_size(report['bytes_deleted'])})")
