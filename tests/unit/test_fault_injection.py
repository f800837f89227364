"""Issue 14: the simulated fleet fails like a real one. Faults drawn from the Llama 3 405B model
at a time scale land on the nodes by the paper's mix, leave hardware faults that only the right
repair rung clears, and their XIDs are reported as the node's agent reports them."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import httpx

from gpucloud.sim.fault_injection import FIXED_BY, FleetFaults
from gpucloud.sim.faults import INTERRUPTIONS_PER_NODE_DAY, LLAMA3_405B_MIX
from gpucloud.sim.fleet import Fleet, FleetSpec


def _fleet(nodes: int = 2048) -> Fleet:
    return Fleet(FleetSpec(nodes=nodes, latency_scale=0, id_prefix="n"))


def test_a_compressed_llama3_run_injects_the_papers_mix_at_its_rate():
    fleet = _fleet()
    faults = FleetFaults(fleet.nodes, time_scale=86_400.0, seed=7)  # one fleet day a second
    drawn = []
    for _ in range(54):  # 54 days of a 2,048-node fleet, as in the paper
        drawn += faults.step(1.0)
        for node in fleet.nodes.values():  # repaired at once, so every node stays in the draw
            node.hardware_fault = node.fault_fixed_by = None
    summary = faults.summary()
    assert abs(summary["fleet_days"] - 54) < 1e-6
    expected = INTERRUPTIONS_PER_NODE_DAY * 2048 * 54  # 419
    assert 0.8 * expected < summary["injected"] < 1.2 * expected, summary["injected"]
    for category, row in summary["by_category"].items():
        assert abs(row["share"] - row["paper_share"]) < 0.06, (category, row)
    assert summary["by_category"]["faulty_gpu"]["injected"] > summary["by_category"]["nic"]["injected"]
    assert len(drawn) == summary["injected"]


def test_hardware_faults_stay_until_the_rung_that_fixes_them_and_software_ones_leave_no_trace():
    fleet = _fleet(64)
    faults = FleetFaults(fleet.nodes, time_scale=5e6, seed=3)
    drawn = faults.step(1.0)
    assert drawn
    hardware = {f.node_id for f in drawn if f.category in FIXED_BY}
    software_only = {f.node_id for f in drawn} - hardware
    assert all(fleet.nodes[n].hardware_fault is not None for n in hardware)
    assert all(fleet.nodes[n].hardware_fault is None for n in software_only)
    faulty = [n for n in fleet.nodes.values() if n.hardware_fault]
    assert faulty and all(n.fault_fixed_by in FIXED_BY.values() for n in faulty)
    # A faulty node is not drawn again until it is repaired.
    again = faults.step(1.0)
    assert not {f.node_id for f in again} & {n.id for n in faulty}
    assert sum(LLAMA3_405B_MIX.values()) == 419


def test_xids_are_reported_with_the_nodes_own_credential():
    fleet = _fleet(16)
    for node in fleet.nodes.values():
        node.credential = f"gpa_{node.id}.secret"
    sent: list[tuple[str, dict]] = []

    def control_plane(request: httpx.Request) -> httpx.Response:
        sent.append((request.headers["authorization"], json.loads(request.content)))
        return httpx.Response(200, json={"accepted": 1})

    now = datetime(2026, 12, 4, tzinfo=UTC)
    faults = FleetFaults(fleet.nodes, time_scale=5e7, seed=1, control_plane_url="http://cp", clock=lambda: now)
    drawn = [f for f in faults.step(1.0) if f.xids]
    assert drawn

    async def report() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(control_plane)) as client:
            await faults.report(client, drawn)

    asyncio.run(report())
    assert len(sent) == len(drawn)
    for (authorization, body), fault in zip(sent, drawn, strict=True):
        assert authorization == f"Bearer gpa_{fault.node_id}.secret"
        assert [e["xid"] for e in body["events"]] == list(fault.xids)
        assert all(e["node_id"] == fault.node_id and e["gpu_index"] == fault.gpu_index for e in body["events"])
    assert faults.summary()["xids_reported"] == sum(len(f.xids) for f in drawn)
