"""`gpucloud weights gates`, `evaluate`, `evaluation-command` and `sanity`: a model's promotion
gates and the evaluations behind them, as tables that put each metric beside the gate that holds it
and the tensors or files behind it."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich.filesize import decimal as human_size
from rich.table import Table

from gpucloud.cli import tenant_keys
from gpucloud.cli.common import ApiKey, ApiUrl, Output, err, print_table
from gpucloud.cli.weights import _client, _reported_errors, out, weights_app
from gpucloud.models.registry_names import EvaluatorName

if TYPE_CHECKING:  # numpy and safetensors load only when an evaluator runs
    from gpucloud.registry.sanity import SanityReport


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


def _where(metric: str, details: dict) -> list:
    """The tensors or files behind a sanity metric, from the evaluator's details."""
    if metric == "max_rel_norm_change":
        return [f"{c['tensor']} ({c['rel_change']:g})" for c in details.get("largest_rel_norm_changes", [])[:3]]
    return details.get(_WHERE.get(metric, ""), [])


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
        where = _where(name, details)
        shown = f"[red]{value:g}[/]" if "fails" in verdict else f"{value:g}"
        table.add_row(name, shown, verdict, ", ".join(map(str, where))[:100])
    return table


def gates_table(model: str, gates: list[dict]) -> Table:
    """A model's gates: the evaluator each metric must come from, its range and how far it may
    fall behind production."""
    table = Table("metric", "evaluator", "min", "max", "max regression", "better", title=f"promotion gates of {model}")
    for gate in gates:
        table.add_row(
            gate["metric"],
            gate.get("evaluator") or "",
            _bound(gate.get("min")),
            _bound(gate.get("max")),
            _bound(gate.get("max_regression")),
            "higher" if gate.get("higher_is_better", True) else "lower",
        )
    return table


def _bound(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


PLATFORM_GATES = (
    "the platform's own gates hold besides these: a version whose latest platform evaluation failed, or "
    "that holds a NaN or Inf weight, moves to neither staging nor production; production takes only a "
    "version a platform sanity evaluation passed"
)


def _gates_file(path: Path) -> list[dict]:
    """The gates in a YAML or JSON file: a list of gates, or `{gates: [...]}` as the API takes them."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="--set") from None
    gates = loaded.get("gates") if isinstance(loaded, dict) else loaded
    if not isinstance(gates, list) or not all(isinstance(g, dict) for g in gates):
        raise typer.BadParameter(
            f"{path} holds no list of gates (each: metric, and min, max or max_regression)", param_hint="--set"
        )
    return gates


@weights_app.command("gates")
def gates_command(
    model: str,
    replace: Annotated[
        Path | None,
        typer.Option(
            "--set",
            exists=True,
            dir_okay=False,
            help="replace the model's gates with those in this YAML or JSON file (a list of: metric, evaluator, "
            "min, max, max_regression, higher_is_better); an empty list removes them",
        ),
    ] = None,
    output: Output = "table",
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The promotion gates of a model: what a version's platform evaluations must show before
    `promote --to staging` or `--to production` moves it."""
    gates = _gates_file(replace) if replace is not None else None
    with _reported_errors(), _client(api_url, api_key) as client:
        shown = client.set_gates(model, gates) if gates is not None else client.get(f"/v1/models/{model}")
    if output == "json":
        print(json.dumps({"model": shown["name"], "gates": shown["gates"]}, indent=2))
        return
    if shown["gates"]:
        print_table(gates_table(shown["name"], shown["gates"]), out=out)
    else:
        out.print(f"{shown['name']} has no gates of its own")
    out.print(PLATFORM_GATES)


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
    output: Output = "table",
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
            signer = tenant_keys.signer(tenant_id)
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


@weights_app.command("sanity")
def sanity_command(
    directory: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="a version's files (pulled)")],
    parent: Annotated[
        Path | None, typer.Option(exists=True, file_okay=False, help="its parent version's files, to compare with")
    ] = None,
    threshold: Annotated[float, typer.Option(help="relative change of a tensor's L2 norm worth naming")] = 0.5,
    output: Output = "table",
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
    for name, value in metrics.items():
        bad = name in ("nan_inf_count", "shape_changes") and value > 0
        shown = f"[red]{value:g}[/]" if bad else f"{value:g}"
        table.add_row(name, shown, ", ".join(map(str, _where(name, details)))[:100])
    return table
