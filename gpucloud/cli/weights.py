"""`gpucloud weights`: push, pull, promote and list model versions through the registry API.

The CLI talks to the API over HTTP with the tenant's API key (`--api-key` / `GPUCLOUD_API_KEY`;
the URL from `--api-url` / `GPUCLOUD_API_URL`, else the configured API address), through
`gpucloud.client.registry`.

A push (`gpucloud.registry.push`) chunks and hashes the directory locally, signs the manifest
with the tenant's Ed25519 key, asks the API which chunks its store lacks, uploads only those, then
posts the signed manifest. An interrupted push, run again, uploads only what is still missing.
The signing key lives in `<data dir>/signing-keys/<tenant id>.ed25519` (mode 0600); it is created
on the first push and registered with the API, which checks every manifest against it.

A pull never trusts the API (`gpucloud.client.registry.pull_version`): any mismatch stops it
with an error that names the chunk, file or key, and leaves nothing at the destination.
"""

from __future__ import annotations

import dataclasses
import json
import math
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

from gpucloud.cli.common import console, err, reported_errors
from gpucloud.client.base import ApiError
from gpucloud.client.registry import (
    RegistryClient,
    RegistryPushTarget,
    pull_version,
    signer_for,
    trust_key,
    trusted_keys,
)
from gpucloud.config import get_settings
from gpucloud.models.registry_tables import AliasName, EvaluatorName
from gpucloud.registry.chunking import DEFAULT_POLICY, ChunkPolicy
from gpucloud.registry.manifest import IntegrityError, Lineage, Signer, key_id_of
from gpucloud.registry.pull import PullResult
from gpucloud.registry.push import PushResult, PushStats, push

weights_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Model weights: push, pull, promote and list versions through the registry API.",
)
if TYPE_CHECKING:  # numpy and safetensors load only when an evaluator runs
    from gpucloud.registry.sanity import SanityReport

out = console


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
Output = Annotated[str, typer.Option("--output", "-o", help="table or json (progress then goes to stderr)")]


def _client(api_url: str | None, api_key: str | None) -> RegistryClient:
    if not api_key:
        err.print("[red]error:[/] no API key: set GPUCLOUD_API_KEY or pass --api-key")
        raise typer.Exit(1)
    return RegistryClient(api_url or get_settings().api_url, api_key)


def failing_metrics_table(failures: list[dict]) -> Table:
    table = Table("metric", "evaluator", "value", "production", "why it fails", title="failing evaluation gates")
    for f in failures:
        table.add_row(
            f["metric"], f.get("evaluator", ""), _num(f.get("value")), _num(f.get("production_value")), f["reason"]
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
                        f"the local signing key was revoked: move {get_settings().data_dir / 'signing-keys'}"
                        "/<tenant id>.ed25519 away and push again to create and register a new one"
                    )
                raise
    except IntegrityError as exc:
        err.print(f"[red]integrity check failed ({type(exc).__name__}):[/] {exc}")
        err.print("nothing was written to the destination")
        raise typer.Exit(2) from None
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
    console.print(
        f"pushed {model}@{outcome.digest}\n  {s.chunks_uploaded} of {s.chunks_total} chunks uploaded "
        f"({human_size(s.bytes_uploaded)}), {human_size(s.bytes_skipped)} of "
        f"{human_size(s.bytes_total)} skipped by dedup"
    )
    return outcome


def pull_with_progress(
    client: RegistryClient, model: str, ref: str, dest: Path, *, console: Console, data_dir: Path | None = None
) -> PullResult:
    """`pull_version` with a progress bar of bytes and chunks verified, trusting only this
    machine's keys (its own signing key and its keyring in `data_dir`, `gpucloud weights trust`)."""
    trusted = trusted_keys(data_dir or get_settings().data_dir, client.signing_keys()[0])
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
        signer = signer_for(get_settings().data_dir, client.signing_keys()[0])
        lineage = Lineage(
            parent=_version_digest(client, model, parent) if parent else None,
            base_model=base_model,
            training_run=training_run,
            dataset_digests=dataset or [],
        )
        console = err if output == "json" else out
        pushed = push_with_progress(client, directory, model=model, signer=signer, lineage=lineage, console=console)
    if output == "json":
        print(json.dumps({"version": pushed.version, "stats": dataclasses.asdict(pushed.stats)}, default=str))


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
    """Trust a key for this tenant's versions on this machine: pulls verify against this keyring
    and this machine's own signing key only, never against keys the API serves."""
    with _reported_errors(), _client(api_url, api_key) as client:
        tenant_id = client.signing_keys()[0]
    try:
        key_id = trust_key(get_settings().data_dir, tenant_id, public_key.lower(), label)
    except ValueError as exc:
        raise typer.BadParameter(f"not an Ed25519 public key in hex: {exc}", param_hint="PUBLIC_KEY") from None
    if output == "json":
        print(json.dumps({"key_id": key_id, "tenant_id": tenant_id, "label": label}))
        return
    out.print(f"trusting key {key_id} for {tenant_id} on this machine")


@weights_app.command("keys")
def keys_command(
    output: Annotated[str, typer.Option(help="table or json")] = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The tenant's keys the registry lists, and whether this machine trusts each for pulls."""
    with _reported_errors(), _client(api_url, api_key) as client:
        tenant_id, keys = client.signing_keys()
    trusted = {key_id_of(k) for k in trusted_keys(get_settings().data_dir, tenant_id)}
    rows = [
        {"key_id": k["key_id"], "public_key": k["public_key"], "trusted_here": k["key_id"] in trusted} for k in keys
    ]
    if output == "json":
        out.print_json(data=rows)
        return
    table = Table("key", "public key", "trusted here", title=f"signing keys of {tenant_id}")
    for row in rows:
        table.add_row(row["key_id"], row["public_key"], "yes" if row["trusted_here"] else "no")
    out.print(table)


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
    output: Annotated[str, typer.Option(help="table or json")] = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """List a model's versions, oldest first, with the platform's evaluation results and, apart,
    what the tenant reported (which no gate accepts)."""
    with _reported_errors(), _client(api_url, api_key) as client:
        versions = list(client.versions(model))
    if output == "json":
        out.print_json(data=versions)
        return
    table = Table(
        "version", "created", "size", "parent", "aliases", "platform results", "reported", title=f"{model} versions"
    )
    for v in versions:
        table.add_row(
            v["digest"][:12],
            v["created_at"][:19].replace("T", " "),
            human_size(v["total_size"]),
            (v["parent"] or "")[:12],
            ", ".join(v["aliases"]),
            _metric_list(v["metrics"]),
            _metric_list(v.get("reported_metrics", {})),
        )
    out.print(table)


def _metric_list(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={val:g}" for k, val in sorted(metrics.items()))


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


_WHERE = {
    "nan_inf_count": "nan_or_inf",
    "tensors_over_norm_threshold": "over_norm_threshold",
    "shape_changes": "shape_changed",
    "dtype_changes": "dtype_changed",
    "tensors_added": "added",
    "tensors_removed": "removed",
    "files_added": "files_added",
    "files_removed": "files_removed",
}


def evaluation_table(title: str, record: dict, gates: list[dict]) -> Table:
    """One evaluation's results, each metric beside the gate that holds it and what it names."""
    evaluator, details = record["evaluator"], record.get("details") or {}
    held = {g["metric"]: g for g in gates if g.get("evaluator") == evaluator}
    table = Table(title=title)
    for column in ("metric", "value", "gate", "where"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for name, value in sorted(record["results"].items()):
        gate, verdict = held.get(name), ""
        if gate is not None:
            bounds = [f"min {gate['min']:g}" if gate.get("min") is not None else ""]
            bounds.append(f"max {gate['max']:g}" if gate.get("max") is not None else "")
            verdict = " ".join(b for b in bounds if b) + (
                ": [red]fails[/]" if _fails(gate, record["results"]) else ": passes"
            )
        if name == "max_rel_norm_change":
            where = [f"{c['tensor']} ({c['rel_change']:g})" for c in details.get("largest_rel_norm_changes", [])[:3]]
        else:
            where = details.get(_WHERE.get(name, ""), [])
        shown = f"[red]{value:g}[/]" if "fails" in verdict else f"{value:g}"
        table.add_row(name, shown, verdict, ", ".join(map(str, where))[:100])
    return table


@weights_app.command("evaluate")
def evaluate_command(
    model: str,
    version: Annotated[str, typer.Argument(help="digest, unique prefix, or alias")],
    evaluator: Annotated[
        EvaluatorName,
        typer.Option(
            help="sanity: the platform's weight-sanity evaluator, against the version's parent; command: the "
            "model's registered evaluation command"
        ),
    ] = EvaluatorName.SANITY,
    metric: Annotated[
        list[str] | None,
        typer.Option(help="NAME=VALUE (repeatable): report these results yourself, signed with your key"),
    ] = None,
    reported_as: Annotated[str, typer.Option(help="with --metric: the evaluator name they are reported under")] = "cli",
    wait: Annotated[float, typer.Option(help="how long to wait for the platform's evaluation, seconds")] = 3600.0,
    output: Annotated[str, typer.Option(help="table or json")] = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Have the platform evaluate a version and show its results: the worker pulls and verifies
    the version, runs the evaluator, and signs what it found; only such results open the
    `staging` and `production` gates. Exits 1 when the evaluation failed or a gate on its
    metrics fails. With --metric, report results of your own instead (kept as `reported`)."""
    with _reported_errors(), _client(api_url, api_key) as client:
        if metric:
            results = _metric_values(metric)
            tenant_id = client.signing_keys()[0]
            signer = signer_for(get_settings().data_dir, tenant_id)
            client.register_key(signer, tenant_id)
            recorded = client.record_evaluation(model, version, evaluator=reported_as, results=results, signer=signer)
            out.print(
                f"reported {len(results)} results as {reported_as} for {model}@{recorded['version'][:12]} "
                "(shown as reported; gates hold only the platform's evaluations)"
            )
            return
        with out.status(f"the platform is running the {evaluator.value} evaluator on {model}@{version}"):
            operation, record = client.evaluate_and_wait(model, version, evaluator.value, timeout_s=wait)
        gates = client.get(f"/v1/models/{model}")["gates"]
    if output == "json":
        out.print_json(data={"operation": operation, "evaluation": record})
    else:
        against = (record.get("details") or {}).get("compared_with")
        title = f"{evaluator.value} evaluation of {model}@{record['version'][:12]} (platform-signed)"
        out.print(evaluation_table(title + (f" against {against[:12]}" if against else ""), record, gates))
    if record.get("error"):
        err.print(f"[red]evaluation failed:[/] {record['error']}")
        raise typer.Exit(1)
    failing = [g for g in gates if g.get("evaluator") == evaluator.value and _fails(g, record["results"])]
    if failing:
        err.print("[red]fails its gates:[/] " + ", ".join(g["metric"] for g in failing))
        raise typer.Exit(1)
    out.print(f"recorded {len(record['results'])} platform-signed results of {evaluator.value}")


def _fails(gate: dict, results: dict[str, float]) -> bool:
    value = results.get(gate["metric"])
    if value is None:
        return True
    return (gate.get("min") is not None and value < gate["min"]) or (
        gate.get("max") is not None and value > gate["max"]
    )


@weights_app.command("evaluation-command")
def evaluation_command_command(
    model: str,
    run: Annotated[str | None, typer.Option(help="the program and its arguments (shell words)")] = None,
    image: Annotated[str | None, typer.Option(help="a container image to run it in (the version at /model)")] = None,
    env: Annotated[list[str] | None, typer.Option(help="NAME=VALUE (repeatable) for its environment")] = None,
    timeout: Annotated[float, typer.Option(help="its time limit, seconds")] = 600.0,
    remove: Annotated[bool, typer.Option("--remove", help="remove the model's evaluation command")] = False,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Register the model's evaluation command (the `command` evaluator): the platform runs it on
    the pulled, verified version under the time limit, and it prints its metrics as one JSON
    object on its last line."""
    import shlex

    if not remove and not run:
        raise typer.BadParameter("give --run PROGRAM, or --remove", param_hint="--run")
    if bad := [pair for pair in env or [] if "=" not in pair]:
        raise typer.BadParameter(f"{bad[0]!r} is not NAME=VALUE", param_hint="--env")
    variables = dict(pair.partition("=")[::2] for pair in env or [])
    command = (
        None if remove else {"argv": shlex.split(run or ""), "image": image, "env": variables, "timeout_s": timeout}
    )
    with _reported_errors(), _client(api_url, api_key) as client:
        registered = client.set_evaluation(model, command)["evaluation"]
    if output == "json":
        print(json.dumps({"model": model, "evaluation": registered}))
        return
    if registered is None:
        out.print(f"{model} has no evaluation command")
        return
    where = f"in {registered['image']}" if registered["image"] else "in the host's environment"
    out.print(f"{model} evaluates with {shlex.join(registered['argv'])} {where}, limit {registered['timeout_s']:g} s")


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
    output: Output = "table",
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
    if output == "json":
        print(json.dumps(report))
        return
    out.print(gc_table(report))
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {report['chunks_deleted']} chunks ({human_size(report['bytes_deleted'])})")


@weights_app.command("sanity")
def sanity_command(
    directory: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="a version's files (pulled)")],
    parent: Annotated[
        Path | None, typer.Option(exists=True, file_okay=False, help="its parent version's files, to compare with")
    ] = None,
    threshold: Annotated[float, typer.Option(help="relative change of a tensor's L2 norm worth naming")] = 0.5,
    output: Annotated[str, typer.Option(help="table or json")] = "table",
) -> None:
    """The weight-sanity evaluator on a directory: NaN and Inf counts, L2 norms and their change
    against the parent, tensors and files added, removed or reshaped. Exits 1 when a tensor holds
    NaN or Inf or changed shape."""
    from gpucloud.registry.sanity import SanityError, evaluate

    try:
        report = evaluate(directory, parent, threshold=threshold)
    except SanityError as error:
        err.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    metrics, details = report.metrics(), report.details()
    if output == "json":
        print(json.dumps({"metrics": metrics, "details": details}, indent=2))
    else:
        out.print(sanity_table(report, f"weight sanity: {directory}" + (f" against {parent}" if parent else "")))
        rate = details["read_gb_per_s"]
        out.print(
            f"{len(report.tensors)} tensors, {human_size(report.bytes_read)} read"
            + (f" at {rate} GB/s" if rate else "")
        )
    if metrics["nan_inf_count"] or metrics["shape_changes"]:
        raise typer.Exit(1)


def sanity_table(report: SanityReport, title: str) -> Table:
    """The sanity evaluator's metrics, and the tensors and files behind each."""
    metrics, details = report.metrics(), report.details()
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("where")
    where = {
        "nan_inf_count": details["nan_or_inf"],
        "max_rel_norm_change": [
            f"{c['tensor']} ({c['rel_change']:g})" for c in details["largest_rel_norm_changes"][:3]
        ],
        "tensors_over_norm_threshold": details["over_norm_threshold"],
        "shape_changes": details["shape_changed"],
        "dtype_changes": details["dtype_changed"],
        "tensors_added": details["added"],
        "tensors_removed": details["removed"],
        "files_added": details["files_added"],
        "files_removed": details["files_removed"],
    }
    for name, value in metrics.items():
        bad = name in ("nan_inf_count", "shape_changes") and value > 0
        table.add_row(name, f"[red]{value:g}[/]" if bad else f"{value:g}", ", ".join(where.get(name, []))[:100])
    return table
