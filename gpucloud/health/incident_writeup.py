"""An incident's write-up: Markdown an operator (or the tenant it touched) reads afterwards.

Pure: the incident's record in, text out. Sections: summary, timeline (the six phases and the
actions between them), impact (tenants and allocations touched, GPU-hours lost, time to
stabilize, time to repair), signals, actions, what fixed it, root cause and follow-ups (the
operator's, or a note that none is written yet). A fleet incident's phases mean its own
moments (`health.incidents`): a correlated burst's component and its nodes, which their tenants
kept (correlation cordons, it replaces nothing); a breaker trip's pool and the pulls it refused.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from gpucloud.models.health_tables import IncidentPublic

_PHASES = (
    ("detected", "detected_at", "the first fault"),
    ("stabilized", "stabilized_at", "pulled, and its allocation whole again"),
    ("diagnosed", "diagnosed_at", "the repair ladder took the node"),
    ("repaired", "repaired_at", "the rung that ran last"),
    ("gated", "gated_at", "burn-in passed, back in the pool"),
    ("closed", "closed_at", "the incident ended"),
)


_BURST_PHASES = (
    ("detected", "detected_at", "the burst's first fault"),
    ("stabilized", "stabilized_at", "its nodes cordoned (no new tenant; tenants kept their nodes)"),
    ("diagnosed", "diagnosed_at", "the shared component suspected (the faults correlated)"),
    ("repaired", "repaired_at", "an operator resolved it"),
    ("gated", "gated_at", "every node back to normal judgement"),
    ("closed", "closed_at", "the incident ended"),
)
_TRIP_PHASES = (
    ("detected", "detected_at", "the first pull the circuit breaker refused"),
    ("stabilized", "stabilized_at", "the breaker held the pool's nodes in"),
    ("diagnosed", "diagnosed_at", "the alert named the pool and the share pulled"),
    ("repaired", "repaired_at", "the window let pulls through again, or an operator resolved it"),
    ("gated", "gated_at", "the refused nodes judged normally again"),
    ("closed", "closed_at", "the incident ended"),
)


def _phases_of(incident: IncidentPublic) -> tuple[tuple[str, str, str], ...]:
    if incident.kind != "fleet":
        return _PHASES
    return _TRIP_PHASES if incident.trigger == "breaker_trip" else _BURST_PHASES


def duration(span: timedelta | None) -> str:
    """`1h 02m 03s`, `4m 05s`, `12s`; `-` for none."""
    if span is None:
        return "-"
    seconds = max(0, round(span.total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {seconds:02d}s"
    if minutes:
        return f"{minutes}m {seconds:02d}s"
    return f"{seconds}s"


def _when(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S UTC") if at is not None else "-"


def _since(start: datetime, end: datetime | None) -> timedelta | None:
    return None if end is None else end - start


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _outcome(incident: IncidentPublic) -> str:
    if incident.kind == "fleet" and incident.status == "resolved":
        if incident.trigger == "breaker_trip":
            return "resolved: automatic pulls go through again in the pool"
        return "resolved: the component was fixed and every node is back to normal judgement"
    if incident.kind == "fleet" and incident.status == "abandoned":
        return "abandoned: it had not ended when the incident stopped waiting"
    if incident.status == "resolved":
        return "resolved: the node passed burn-in and is back in the pool"
    if incident.status == "rma":
        return "ended in RMA: the node left the fleet for hardware repair"
    if incident.status == "abandoned":
        return "abandoned: the node had not come back when the incident stopped waiting"
    return f"open (waiting to {incident.phase.replace('_', ' ')})"


def _idle(incident: IncidentPublic) -> str:
    if incident.kind == "fleet":
        return "none (no allocation held its nodes)"
    return "none (the node was idle)"


def _replacements(incident: IncidentPublic) -> str:
    if incident.kind == "fleet" and incident.trigger != "breaker_trip":
        return "none: correlation replaces no node, so tenants kept their nodes (cordoned, no new tenant)"
    if incident.kind == "fleet":
        return "none: the breaker refused the pulls, so the refused nodes stayed where they were"
    return ", ".join(incident.replacement_node_ids) or "none"


def _fleet_fix(incident: IncidentPublic) -> str:
    if incident.repaired_at is None:
        return "Not fixed yet."
    fix = incident.repaired_by or "-"
    if incident.trigger == "breaker_trip":
        if fix == "breaker window":
            return "The breaker's window let pulls through again (the pulls that tripped it aged out)."
        return f"An operator resolved it: {fix}"
    return f"An operator resolved it once the component was dealt with: {fix}"


def write_up(incident: IncidentPublic) -> str:
    nodes = ", ".join(f"`{n}`" for n in incident.node_ids) or "-"
    lines = [
        f"# Incident {incident.id}: {incident.summary or incident.category}",
        "",
        "## Summary",
        "",
        f"- **What**: {incident.summary or '-'}",
        f"- **Kind**: {incident.kind}; **nodes**: {nodes}",
        f"- **Category**: {incident.category}; **suspected component**: {incident.suspected_component or '-'}",
        f"- **Outcome**: {_outcome(incident)}",
        "",
        "## Timeline",
        "",
        "| phase | at | after detection | what |",
        "|---|---|---|---|",
    ]
    for name, field, meaning in _phases_of(incident):
        at = getattr(incident, field)
        lines.append(f"| {name} | {_when(at)} | {duration(_since(incident.detected_at, at))} | {meaning} |")
    if incident.pulled_at is not None and incident.pulled_at != incident.stabilized_at:
        lines.append("")
        lines.append(
            f"Pulled (cordoned) at {_when(incident.pulled_at)}, "
            f"{duration(_since(incident.detected_at, incident.pulled_at))} after detection."
        )
    lines += [
        "",
        "## Impact",
        "",
        f"- **Tenants touched**: {', '.join(incident.tenant_ids) or _idle(incident)}",
        f"- **Allocations touched**: {', '.join(incident.allocation_ids) or 'none'}",
        f"- **Replacement nodes**: {_replacements(incident)}",
        f"- **GPU-hours lost**: {incident.gpu_hours_lost:.2f} ({incident.gpu_count} GPUs)",
        f"- **Time to stabilize**: {duration(_since(incident.detected_at, incident.stabilized_at))}",
        f"- **Time to repair**: {duration(_since(incident.detected_at, incident.gated_at or incident.repaired_at))}",
        "",
        "## Signals",
        "",
    ]
    if incident.signals:
        lines += ["| signal | since | health | action | reason |", "|---|---|---|---|---|"]
        for s in incident.signals:
            lines.append(
                f"| {_cell(s.get('name', '-'))} | {_cell(s.get('since', '-'))} | {_cell(s.get('health', '-'))}"
                f" | {_cell(s.get('action', '-'))} | {_cell(s.get('reason', ''))} |"
            )
    else:
        lines.append("No signal recorded.")
    lines += ["", "## Actions", ""]
    if incident.actions and incident.kind == "fleet":
        lines += ["| at | node | event | from | to | by | cause |", "|---|---|---|---|---|---|---|"]
        for a in incident.actions:
            lines.append(
                f"| {_cell(a.get('at', '-'))} | {_cell(a.get('node') or '-')} | {_cell(a.get('event', ''))}"
                f" | {_cell(a.get('from', ''))} | {_cell(a.get('to', ''))} | {_cell(a.get('actor', ''))}"
                f" | {_cell(a.get('cause', ''))} |"
            )
    elif incident.actions:
        lines += ["| at | event | from | to | by | cause |", "|---|---|---|---|---|---|"]
        for a in incident.actions:
            lines.append(
                f"| {_cell(a.get('at', '-'))} | {_cell(a.get('event', ''))} | {_cell(a.get('from', ''))}"
                f" | {_cell(a.get('to', ''))} | {_cell(a.get('actor', ''))} | {_cell(a.get('cause', ''))} |"
            )
    else:
        lines.append("No action recorded.")
    lines += ["", "## What fixed it", ""]
    if incident.kind == "fleet":
        lines.append(_fleet_fix(incident))
    elif incident.status == "resolved":
        if incident.repaired_by:
            lines.append(f"The `{incident.repaired_by}` rung of the repair ladder; then burn-in passed.")
        else:
            lines.append("The wipe and burn-in alone (no repair rung ran).")
    elif incident.status == "rma":
        lines.append("Nothing on the repair ladder: the node went to RMA.")
    else:
        lines.append("Not fixed yet.")
    lines += ["", "## Root cause and follow-ups", ""]
    if incident.root_cause:
        who = f" ({incident.root_cause_by}, {_when(incident.root_cause_at)})" if incident.root_cause_by else ""
        lines.append(f"**Root cause**{who}: {incident.root_cause}")
    else:
        lines.append("**Root cause**: not written yet (`gpucloud incidents root-cause`).")
    lines.append("")
    if incident.follow_ups:
        lines += ["**Follow-ups**:", ""] + [f"- [ ] {item}" for item in incident.follow_ups]
    else:
        lines.append("**Follow-ups**: none recorded.")
    return "\n".join(lines) + "\n"
