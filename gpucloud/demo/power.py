"""The out-of-band part of `gpucloud demo`: a node's host hangs (its kernel, say: the agent stops
answering and heartbeating, the power stays on). Only the node's BMC can help: the control
plane marks the agent unreachable, takes the node out of the pool, power-cycles it through
Redfish (the sushy-tools emulator is every simulated node's BMC), waits for the agent to come
back, and returns the node to the pool through wipe and burn-in. Everything is read through the
operator API; the simulated fleet is only told to hang the host.
"""

from __future__ import annotations

from rich.table import Table

from gpucloud.demo.common import Demo, DemoFailed


def demo_power_cycle(demo: Demo, *, timeout_s: float = 240) -> None:
    spare = next((n for n in demo.operator.nodes.list(state="available") if n.allocation_id is None), None)
    if spare is None:
        raise DemoFailed("the power-cycle demo needs an available node")
    if not spare.bmc_url:
        raise DemoFailed(f"{spare.id} has no BMC: run the fleet with --bmc")
    node_id = spare.id
    boot_before = demo.sim.node(node_id)["boot_id"]
    seen = len(list(demo.operator.nodes.events(node_id)))
    demo.sim.set_unreachable(node_id, True)
    demo.console.print(
        f"[red]{node_id}'s host hangs[/]: its agent stops answering and heartbeating; the BMC "
        f"({spare.bmc_url}) still says power {spare.power_state}"
    )

    def node():
        return demo.operator.nodes.get(node_id)

    def cycled():
        return next((e for e in list(demo.operator.nodes.events(node_id))[seen:] if e.event == "power_cycle"), None)

    def back():
        n = node()
        if n.state in ("rma", "retired"):
            raise DemoFailed(f"{node_id} ended {n.state}: {(n.bmc_last or {}).get('answer', '')}")
        return n if n.state == "available" and n.agent_reachable else None

    _, _, cycle, returned = demo.stages(
        [
            ("the agent is marked unreachable", lambda: not node().agent_reachable),
            ("the node is taken out of the pool", lambda: node().state in ("draining", "quarantined", "repairing")),
            ("power cycle through the BMC (Redfish), agent back", cycled),
            ("wipe and burn-in, back in the pool", back),
        ],
        timeout_s=timeout_s,
    )
    boot_after = demo.sim.node(node_id)["boot_id"]
    if boot_after == boot_before:
        raise DemoFailed(f"{node_id} is back but its host did not reboot")
    table = Table(title=f"{node_id}: events since the hang")
    for column in ("at", "event", "from", "to", "cause"):
        table.add_column(column)
    for e in list(demo.operator.nodes.events(node_id))[seen:]:
        table.add_row(f"{e.at:%H:%M:%S}", e.event, e.from_state, e.to_state, e.cause[:90])
    demo.console.print(table)
    demo.console.print(
        f"{node_id} [green]power-cycled back to health[/] through its BMC: {cycle.cause[:120]}; "
        f"power {returned.power_state}, boot {boot_before} -> {boot_after}"
    )
