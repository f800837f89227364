"""The cleaning part of `gpucloud demo`: when a tenant's allocation ends, each of its nodes boots
once from the known clean image through its BMC (Redfish virtual media and a one-time boot
override, served over loopback), its agent's new boot and image digest are checked against what
was inserted, and only then is it wiped (GPU reset, disk sanitize), burned in and handed to the
next tenant. Everything is read through the operator API.
"""

from __future__ import annotations

from rich.table import Table

from gpucloud.demo.common import Demo, DemoFailed

# The node's events that make a re-image out of band, in the order they must happen.
REIMAGE_STEPS = ("image_inserted", "power_cycle", "image_verified", "enrollment_handed", "agent_enrolled")


def show_reimage(demo: Demo, node_id: str, *, seen: int, tenant: str) -> None:
    """The node's events since `seen` (its count before the allocation ended): the re-image and
    the cleaning after it, as the control plane recorded them; DemoFailed if it was not re-imaged."""
    events = list(demo.operator.nodes.events(node_id))[seen:]
    kinds = [e.event for e in events]
    missing = [k for k in REIMAGE_STEPS if k not in kinds]
    if missing:
        raise DemoFailed(f"{node_id} was not re-imaged out of band (no {', '.join(missing)} in {kinds})")
    at = [kinds.index(k) for k in REIMAGE_STEPS]
    if at != sorted(at):
        raise DemoFailed(f"{node_id}'s re-image ran out of order: {kinds}")
    if events[-1].to_state != "available":
        raise DemoFailed(f"{node_id} is {events[-1].to_state} after its re-image, not available")
    table = Table(title=f"{node_id}: cleaned between tenants (was {tenant}'s)")
    for column in ("at", "event", "from", "to", "answer"):
        table.add_column(column)
    for e in events:
        table.add_row(f"{e.at:%H:%M:%S}", e.event, e.from_state, e.to_state, e.cause[:100])
    demo.console.print(table)
