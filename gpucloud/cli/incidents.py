"""`gpucloud incidents`: the record of each health pull, correlated burst and breaker trip
(`docs/health.md`, "Incidents"): list, show, its write-up, an operator's root cause, and an
operator's resolve of a fleet incident. A tenant's key sees the incidents that touched
its allocations; an operator's token every one."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.table import Table

from gpucloud.cli.common import ApiKey, ApiUrl, Output, api_client, console, print_table, reported_errors
from gpucloud.cli.resources import _table, _when, emit

if TYPE_CHECKING:
    from datetime import datetime

    from gpucloud.models.health_tables import IncidentPublic

incidents_app = typer.Typer(no_args_is_help=True, help="Incidents: each health pull from fault to repair.")

JsonFlag = Annotated[bool, typer.Option("--json", help="print JSON (the same as -o json)")]


def _output(output: str, as_json: bool) -> str:
    return "json" if as_json else output


def _took(incident: IncidentPublic, at: datetime | None) -> str:
    if at is None:
        return ""
    seconds = round((at - incident.detected_at).total_seconds())
    return f"{seconds // 60}m {seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def incident_table(incidents: list[IncidentPublic]) -> Table:
    table = _table(
        "incidents", "id", "status", "phase", "node", "category", "detected", "stabilized", "gated", "gpu-h lost"
    )
    for i in incidents:
        table.add_row(
            i.id,
            i.status,
            i.phase,
            ", ".join(i.node_ids),
            i.category,
            _when(i.detected_at),
            _took(i, i.stabilized_at),
            _took(i, i.gated_at),
            f"{i.gpu_hours_lost:.2f}",
        )
    return table


@incidents_app.command("list")
def incidents_list(
    status: Annotated[str | None, typer.Option(help="only this status: open, resolved, rma, abandoned")] = None,
    node: Annotated[str | None, typer.Option(help="only this node's incidents")] = None,
    kind: Annotated[str | None, typer.Option(help="only this kind: node, or fleet (bursts, breaker trips)")] = None,
    output: Output = "table",
    as_json: JsonFlag = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Incidents, oldest first (a tenant's key: those that touched its allocations)."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        found = list(api.incidents.list(status=status, node_id=node, kind=kind))
    emit(_output(output, as_json), found, incident_table(found))


@incidents_app.command("show")
def incidents_show(
    incident_id: str,
    output: Output = "table",
    as_json: JsonFlag = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """One incident: its phases, impact, signals and actions."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        incident = api.incidents.get(incident_id)
    if _output(output, as_json) == "json":
        emit("json", incident)
        return
    print_table(incident_table([incident]))
    phases = _table("phases", "phase", "at", "after detection")
    for name in ("detected", "pulled", "stabilized", "diagnosed", "repaired", "gated", "closed"):
        at = getattr(incident, f"{name}_at")
        phases.add_row(name, _when(at), _took(incident, at))
    print_table(phases)
    console.print(f"summary: {incident.summary}")
    console.print(
        f"suspected component: {incident.suspected_component or '-'}; fixed by: {incident.repaired_by or '-'}"
    )
    console.print(
        f"tenants: {', '.join(incident.tenant_ids) or '-'}; allocations: {', '.join(incident.allocation_ids) or '-'}"
    )
    actions = _table("actions", "at", "event", "from", "to", "cause")
    for a in incident.actions:
        actions.add_row(
            str(a.get("at", ""))[:19].replace("T", " "),
            a.get("event", ""),
            a.get("from", ""),
            a.get("to", ""),
            a.get("cause", ""),
        )
    print_table(actions)
    console.print(f"root cause: {incident.root_cause or '(not written yet)'}")


@incidents_app.command("write-up")
def incidents_write_up(
    incident_id: str,
    output: Annotated[
        Literal["markdown", "json"], typer.Option("--output", "-o", help="markdown, or json for scripts")
    ] = "markdown",
    as_json: JsonFlag = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """The incident's write-up, as Markdown."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        text = api.incidents.write_up(incident_id)
    if _output(output, as_json) == "json":
        print(json.dumps({"id": incident_id, "write_up": text}, indent=2))
    else:
        print(text, end="")


@incidents_app.command("root-cause")
def incidents_root_cause(
    incident_id: str,
    cause: Annotated[str, typer.Argument(help="what caused the incident")],
    follow_up: Annotated[list[str] | None, typer.Option("--follow-up", help="a follow-up (repeatable)")] = None,
    output: Output = "table",
    as_json: JsonFlag = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Write an incident's root cause and follow-ups (operator)."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        incident = api.incidents.root_cause(incident_id, cause, follow_up or None)
    emit(_output(output, as_json), incident, incident_table([incident]))


@incidents_app.command("resolve")
def incidents_resolve(
    incident_id: str,
    note: Annotated[str, typer.Option(help="what fixed it (the write-up's 'What fixed it')")] = "",
    output: Output = "table",
    as_json: JsonFlag = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """End a fleet incident (operator): a burst's component is fixed, or a breaker trip dealt with."""
    with reported_errors(), api_client(api_url, api_key, operator=True) as api:
        incident = api.incidents.resolve(incident_id, note)
    emit(_output(output, as_json), incident, incident_table([incident]))
