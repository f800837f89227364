"""The incident part of `gpucloud demo`: the XID the health part injected opened an incident
(`docs/health.md`, "Incidents"). Once the pulled node is back in the pool through the repair
ladder and burn-in, the demo shows the incident's six phases as the node's history dated them,
what the tenant lost, the operator's root cause, and the generated write-up.

Everything is read through the operator API; the tenant's view of the same incident is checked
to hold no other tenant's data and to be the same incident.
"""

from __future__ import annotations

from datetime import datetime

from rich.markdown import Markdown
from rich.table import Table

from gpucloud.client.api import Gpucloud
from gpucloud.demo.common import Demo, DemoFailed
from gpucloud.models.health_tables import IncidentPublic

_PHASES = (
    ("detected", "detected_at"),
    ("stabilized", "stabilized_at"),
    ("diagnosed", "diagnosed_at"),
    ("repaired", "repaired_at"),
    ("gated", "gated_at"),
    ("written up", "closed_at"),
)


def _phase_table(incident: IncidentPublic) -> Table:
    table = Table(title=f"incident {incident.id} ({incident.category}): {incident.status}")
    for column in ("phase", "at", "after detection"):
        table.add_column(column)
    for name, field in _PHASES:
        at: datetime | None = getattr(incident, field)
        since = "" if at is None else f"{(at - incident.detected_at).total_seconds():.1f}s"
        table.add_row(name, "" if at is None else f"{at:%H:%M:%S}", since)
    return table


def demo_incident(demo: Demo, tenant: Gpucloud, node_id: str, *, timeout_s: float = 240) -> IncidentPublic:
    """Follow the incident of `node_id`'s pull to its write-up; `timeout_s` bounds the wait."""

    def opened() -> IncidentPublic | None:
        return next(iter(demo.operator.incidents.list(node_id=node_id)), None)

    def closed() -> IncidentPublic | None:
        found = opened()
        if found is not None and found.status in ("rma", "abandoned"):
            raise DemoFailed(f"incident {found.id} ended {found.status}; expected the node back through burn-in")
        return found if found is not None and found.status == "resolved" and found.closed_at else None

    first, incident = demo.stages(
        [
            (f"an incident opened for {node_id}", opened),
            ("repaired, gated by burn-in, written up", closed),
        ],
        timeout_s=timeout_s,
    )
    demo.console.print(
        f"incident [bold]{first.id}[/] opened for {node_id}: {incident.summary}; "
        f"{incident.gpu_hours_lost:.3f} GPU-hours lost, repaired by {incident.repaired_by or 'burn-in alone'}"
    )
    missing = [name for name, field in _PHASES if getattr(incident, field) is None]
    if missing:
        raise DemoFailed(f"incident {incident.id} is resolved but has no time for: {', '.join(missing)}")
    demo.console.print(_phase_table(incident))

    seen_by_tenant = [i.id for i in tenant.incidents.list()]
    if incident.id not in seen_by_tenant:
        raise DemoFailed(f"the tenant whose allocation lost {node_id} does not see incident {incident.id}")

    demo.operator.incidents.root_cause(
        incident.id,
        "demo: the GPU fell off the bus (XID 79); the reset rung brought it back and burn-in passed",
        ["watch the node's next burn-in", "RMA the GPU if XID 79 repeats within 30 days"],
    )
    write_up = demo.operator.incidents.write_up(incident.id)
    if "Root cause" not in write_up or incident.id not in write_up:
        raise DemoFailed(f"the write-up of {incident.id} lacks its id or root cause section")
    demo.console.print(Markdown(write_up))
    return incident
