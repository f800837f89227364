"""Issue 14: the simulated fleet fails like a real one. Faults drawn from the Llama 3 405B model
at a time scale land on the nodes by the paper's mix, leave hardware faults that only the right
repair rung clears, and their XIDs are reported as the node's agent reports them."""

from __future__ import annotations

import asyncio
import json
import random
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from gpucloud.health.categories import FaultCategory
from gpucloud.protocol.reporter import ReportClient
from gpucloud.sim.fault_injection import FIXED_BY, FleetFaults
from gpucloud.sim.faults import INTERRUPTIONS_PER_NODE_DAY, LLAMA3_405B_MIX, FaultModel
from gpucloud.sim.nodes import Fleet, FleetSpec

pytestmark = pytest.mark.unit


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


def _control_plane(sent: list[tuple[str, str, dict]]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, request.headers.get("authorization", ""), json.loads(request.content)))
        return httpx.Response(200, json={"accepted": 1})

    return httpx.MockTransport(handle)


def _run(coroutine_fn, transport: httpx.MockTransport) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            await coroutine_fn(ReportClient(client, "http://cp"))

    asyncio.run(go())


def test_xids_are_reported_with_the_nodes_own_credential():
    fleet = _fleet(16)
    for node in fleet.nodes.values():
        node.credential = f"gpa_{node.id}.secret"
    sent: list[tuple[str, str, dict]] = []
    now = datetime(2026, 12, 4, tzinfo=UTC)
    faults = FleetFaults(fleet.nodes, time_scale=5e7, seed=1, control_plane_url="http://cp", clock=lambda: now)
    drawn = [f for f in faults.step(1.0) if f.xids]
    assert drawn
    _run(faults.report, _control_plane(sent))
    by_node: dict[str, list[int]] = {}
    for fault in drawn:
        by_node.setdefault(fault.node_id, []).extend(fault.xids)
    assert {body["events"][0]["node_id"] for _, _, body in sent} == set(by_node)
    for path, authorization, body in sent:
        node_id = body["events"][0]["node_id"]
        assert path == "/v1/agents/events" and authorization == f"Bearer gpa_{node_id}.secret"
        assert [e["xid"] for e in body["events"]] == by_node[node_id]
        assert all(e["timestamp"].startswith("2026-12-04") for e in body["events"])
    assert faults.summary()["xids_reported"] == sum(len(f.xids) for f in drawn)


def test_a_degrading_part_shows_in_the_readings_until_the_repair_clears_it():
    fleet = _fleet(4)
    clock = [datetime(2026, 12, 4, tzinfo=UTC)]
    faults = FleetFaults(fleet.nodes, time_scale=1000.0, seed=1, control_plane_url="http://cp", clock=lambda: clock[0])
    hbm = next(  # an HBM3 fault whose remapper is exhausted: corrected ECC errors keep rising
        f for f in FaultModel(mix={FaultCategory.HBM3: 1}).next_faults(["n-00001"], 1e9, random.Random(5)) if f.drifts
    )
    faults._apply(hbm)
    node = fleet.nodes["n-00001"]
    assert node.hardware_fault.startswith("hbm3") and node.fault_fixed_by == "reset"
    sent: list[tuple[str, str, dict]] = []
    _run(faults.push_readings, _control_plane(sent))
    clock[0] += timedelta(minutes=1)  # a minute here is 1,000 minutes of the part's drift
    _run(faults.push_readings, _control_plane(sent))
    first, second = (body["readings"][0] for _, _, body in sent)
    gpu = hbm.gpu_index
    assert second["gpus"][gpu]["ecc"]["volatile_corrected"] > first["gpus"][gpu]["ecc"]["volatile_corrected"]
    assert second["gpus"][gpu]["ecc"]["volatile_corrected"] - first["gpus"][gpu]["ecc"]["volatile_corrected"] >= 3000
    node.hardware_fault = node.fault_fixed_by = None  # the repair ladder's reset ran
    assert faults.repaired() == ["n-00001"] and not faults.probes


def _host_condition_fault(category: FaultCategory, node_id: str):
    return FaultModel(mix={category: 1}).next_faults([node_id], 1e9, random.Random(2))[0]


@pytest.mark.parametrize(
    ("category", "condition", "signals"),
    [
        (FaultCategory.NIC, "nic_down", ["nic_error", "ib_link_down"]),
        (FaultCategory.HOST_MAINTENANCE, "host_maintenance", ["host_maintenance"]),
        (FaultCategory.SILENT_DATA_CORRUPTION, "silent_data_corruption", ["sdc_suspect"]),
        (FaultCategory.OTHER, "host_hardware", ["thermal", "pcie_aer_uncorrectable"]),
        (FaultCategory.NCCL_WATCHDOG, "nccl_watchdog_timeout", ["nccl_timeout", "workload_hang"]),
    ],
)
def test_host_conditions_are_reported_as_the_signals_a_host_agent_sees(category, condition, signals):
    fleet = _fleet(4)
    node = fleet.nodes["n-00002"]
    node.credential = "gpa_n-00002.secret"
    now = datetime(2026, 12, 4, tzinfo=UTC)
    faults = FleetFaults(fleet.nodes, seed=1, control_plane_url="http://cp", clock=lambda: now)
    fault = _host_condition_fault(category, node.id)
    assert fault.host_condition == condition and not fault.xids
    faults._apply(fault)
    sent: list[tuple[str, str, dict]] = []
    _run(faults.report, _control_plane(sent))
    assert sent == []  # no XID to report
    _run(faults.report_signals, _control_plane(sent))
    ((path, authorization, body),) = sent
    assert path == "/v1/agents/signals" and authorization == "Bearer gpa_n-00002.secret"
    ((report),) = body["reports"]
    assert report["node_id"] == node.id and report["at"].startswith("2026-12-04")
    assert [o["signal"] for o in report["observations"]] == signals
    assert faults.summary()["signals_reported"] == len(signals)
    _run(faults.report_signals, _control_plane(sent))
    assert len(sent) == 1  # reported once


def test_a_fabric_link_down_is_reported_on_the_port_of_the_gpus_rail():
    fleet = _fleet(2)
    faults = FleetFaults(fleet.nodes, seed=1, control_plane_url="http://cp", operator_token="op-token")
    fault = next(
        f
        for f in FaultModel(mix={FaultCategory.NETWORK: 1}).next_faults(["n-00001"], 1e9, random.Random(4))
        if f.host_condition == "fabric_link_down"
    )
    faults._apply(fault)
    sent: list[tuple[str, str, dict]] = []
    _run(faults.report_signals, _control_plane(sent))
    ((_, authorization, body),) = sent
    assert authorization == "Bearer op-token"  # no wipe handed the node a credential yet
    port = f"mlx5_{fault.gpu_index}/1"
    assert [(o["signal"], o["source"]) for o in body["reports"][0]["observations"]] == [
        ("ib_link_down", port),
        ("ib_link_downed", port),
    ]


def test_every_fault_is_recorded_with_its_time_node_and_whom_the_node_served():
    fleet = _fleet(64)
    fleet.nodes["n-00003"].tenant_id, fleet.nodes["n-00003"].workload_running = "ten_a", True
    at = datetime(2026, 1, 1, tzinfo=UTC)
    faults = FleetFaults(fleet.nodes, time_scale=5e6, seed=3, clock=lambda: at)
    drawn = faults.step(1.0) + faults.step(1.0)
    record = faults.summary()["injections"]
    assert [(r["node_id"], r["category"]) for r in record] == [(f.node_id, f.category.value) for f in drawn]
    assert all(r["at"] == at.isoformat() and 0 <= r["fleet_s"] <= 1e7 and not r["forced"] for r in record)
    # A hardware fault is one a pull is for; software leaves the node as it was, and so does a
    # second fault on a node already faulty (drawn in the same step).
    for index, r in enumerate(record):
        earlier = any(e["hardware"] and e["node_id"] == r["node_id"] for e in record[:index])
        assert r["hardware"] == (FaultCategory(r["category"]) in FIXED_BY and not earlier), r
    served = [r for r in record if r["node_id"] == "n-00003"]
    assert all(r["tenant_id"] == "ten_a" and r["workload_running"] for r in served)


def test_a_top_up_injects_every_category_short_of_the_minimum_at_its_checkpoint():
    fleet = _fleet(8)
    # Too few nodes and too little time for the rare categories to come up by chance.
    faults = FleetFaults(fleet.nodes, time_scale=100.0, seed=1)
    faults.top_up(1, over_fleet_s=1200.0)
    for _ in range(12):
        faults.step(1.0)
        for node in fleet.nodes.values():
            node.hardware_fault = node.fault_fixed_by = None
    summary = faults.summary()
    assert all(row["injected"] >= 1 for row in summary["by_category"].values()), summary["by_category"]
    assert summary["minimum_per_category"] == 1
    assert sum(summary["forced"].values()) == sum(1 for r in summary["injections"] if r["forced"]) >= 1
    forced = [r for r in summary["injections"] if r["forced"]]
    # The commonest category's checkpoint comes first, the rarest's last (11/12 of the span).
    assert forced[-1]["category"] == FaultCategory.SILENT_DATA_CORRUPTION.value
    assert forced[-1]["fleet_s"] >= 1100.0
    # Once each category has its minimum, nothing more is forced.
    faults.top_up(0, over_fleet_s=100.0)
    faults.step(2.0)
    assert sum(summary["forced"].values()) == sum(faults.summary()["forced"].values())
