"""The fault model (rate and mix of the Llama 3 405B run) and the simulated probe it drives."""

from __future__ import annotations

import math
import random
import threading
from datetime import UTC, datetime, timedelta

import pytest

from gpucloud.health.categories import FaultCategory
from gpucloud.health.rules import evaluate_node
from gpucloud.health.verdict import Action
from gpucloud.health.xid import XID_TABLE, XidClass, classify_xid
from gpucloud.protocol.reports import FatalKind
from gpucloud.sim.faults import (
    INTERRUPTIONS_PER_NODE_DAY,
    LLAMA3_405B_MIX,
    MANIFESTATIONS,
    Counter,
    CounterDrift,
    Fault,
    FaultModel,
    next_faults,
)
from gpucloud.sim.probe import SimulatedProbe

pytestmark = pytest.mark.unit

NODES = [f"node-{i:04d}" for i in range(2_048)]
DAY = 86_400.0


def test_the_mix_adds_up_to_the_419_interruptions_at_3_8e_3_per_node_day():
    assert sum(LLAMA3_405B_MIX.values()) == 419
    assert LLAMA3_405B_MIX[FaultCategory.OTHER] == 22
    assert pytest.approx(3.8e-3, rel=0.01) == INTERRUPTIONS_PER_NODE_DAY


@pytest.fixture(scope="module")
def llama3_run_x50() -> list[Fault]:
    """The whole Llama 3 run (2,048 nodes x 54 days) at 50x the rate: ~21,000 faults."""
    return next_faults(NODES, 54 * DAY, random.Random(405), model=FaultModel(rate_multiplier=50))


def test_the_category_mix_matches_llama3(llama3_run_x50):
    total = len(llama3_run_x50)
    for category, count in LLAMA3_405B_MIX.items():
        share = count / 419
        observed = sum(f.category is category for f in llama3_run_x50)
        sigma = math.sqrt(total * share * (1 - share))
        assert abs(observed - total * share) < 4 * sigma, (category, observed, total * share)


def test_the_rate_matches_3_8e_3_per_node_day_times_the_multiplier(llama3_run_x50):
    expected = 419 * 50
    assert abs(len(llama3_run_x50) - expected) < 4 * math.sqrt(expected)


@pytest.mark.parametrize("multiplier", [1, 20, 300])
def test_the_rate_scales_with_the_multiplier(multiplier):
    node_days = 20_000 / (INTERRUPTIONS_PER_NODE_DAY * multiplier)  # about 20,000 faults expected
    nodes = NODES[:512]
    faults = next_faults(
        nodes, node_days / len(nodes) * DAY, random.Random(multiplier), model=FaultModel(rate_multiplier=multiplier)
    )

    rate = len(faults) / node_days / multiplier
    assert rate == pytest.approx(INTERRUPTIONS_PER_NODE_DAY, rel=4 / math.sqrt(20_000))


def test_many_small_steps_give_the_same_rate_as_one_long_one():
    model = FaultModel(rate_multiplier=1_000)
    rng = random.Random(3)
    steps = [next_faults(NODES[:100], 60.0, rng, model=model) for _ in range(1_440 * 5)]  # 5 days, minute steps

    expected = INTERRUPTIONS_PER_NODE_DAY * 1_000 * 100 * 5
    count = sum(len(step) for step in steps)
    assert abs(count - expected) < 4 * math.sqrt(expected)
    assert all(0 <= f.offset_s < 60.0 for step in steps for f in step)


def test_faults_are_seeded_and_in_time_order():
    model = FaultModel(rate_multiplier=100)
    first = next_faults(NODES, DAY, random.Random(1), model=model)

    assert first == next_faults(NODES, DAY, random.Random(1), model=model)
    assert first != next_faults(NODES, DAY, random.Random(2), model=model)
    assert [f.offset_s for f in first] == sorted(f.offset_s for f in first)
    assert next_faults(NODES, DAY, random.Random(1), model=FaultModel(rate_multiplier=0)) == []


def test_every_manifestation_speaks_the_xid_table():
    for category, options in MANIFESTATIONS.items():
        for shown in options:
            assert all(x in XID_TABLE for x in shown.xids), category
            assert shown.xids or shown.host_condition, category
            application = {classify_xid(x).xid_class is XidClass.APPLICATION for x in shown.xids}
            assert application <= {category is FaultCategory.SOFTWARE}, category


def test_categories_map_to_their_xids(llama3_run_x50):
    seen: dict[FaultCategory, set[tuple[int, ...]]] = {}
    for fault in llama3_run_x50:
        seen.setdefault(fault.category, set()).add(fault.xids)
    assert seen[FaultCategory.FAULTY_GPU] == {(79,), (119,), (120,)}
    assert seen[FaultCategory.HBM3] == {(48,), (63, 64)}
    assert seen[FaultCategory.GSP] == {(119,), (120,)}
    assert seen[FaultCategory.SOFTWARE] == {(13,), (31,), (43,)}
    assert (74,) in seen[FaultCategory.NETWORK]
    assert seen[FaultCategory.NIC] == {()}


# ------------------------------------------------------------------ the simulated probe


class Clock:
    def __init__(self):
        self.now = datetime(2025, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta) -> None:
        self.now += timedelta(**delta)


def test_the_simulated_probe_reads_like_nvml_and_is_seeded():
    clock = Clock()
    one, two = (SimulatedProbe("node-1", gpu_count=8, seed=9, clock=clock) for _ in range(2))

    reading = one.read()

    assert reading == two.read()
    assert reading.is_gpu_node and len(reading.gpus) == 8 and reading.fatal_error is None
    gpu = reading.gpus[0]
    assert len(gpu.nvlinks) == 18 and gpu.ecc.volatile_corrected == 0 and gpu.remapped_rows.pending is False
    assert gpu.clock_event_reason_names == ["gpu_idle"]
    assert len({g.uuid for g in reading.gpus}) == 8
    assert SimulatedProbe("node-2", seed=9, clock=clock).read().gpus[0].uuid != gpu.uuid


def test_injected_xids_and_drifts_show_up_and_a_reset_clears_what_a_reset_clears():
    clock = Clock()
    probe = SimulatedProbe("node-1", seed=1, clock=clock)
    probe.inject_drift(CounterDrift(counter=Counter.ECC_CORRECTED, per_hour=120, gpu_index=3))
    probe.inject_drift(CounterDrift(counter=Counter.NVLINK_CRC_FLIT, per_hour=60, gpu_index=3, link=7))
    event = probe.inject_xid(74, gpu_index=3)

    clock.advance(minutes=30)
    gpu = probe.read().gpus[3]

    assert probe.wait_events(0) == [event] and probe.wait_events(0) == []
    assert gpu.ecc.volatile_corrected == 60 and gpu.ecc.aggregate_corrected == 60
    assert gpu.nvlinks[7].crc_flit == 30 and gpu.nvlinks[6].crc_flit == 0

    probe.reset()
    clock.advance(minutes=30)
    gpu = probe.read().gpus[3]
    assert gpu.ecc.volatile_corrected == 60 and gpu.ecc.aggregate_corrected == 120  # drift continues

    probe.repair()
    clock.advance(hours=1)
    assert probe.read().gpus[3].ecc.volatile_corrected == 0


def test_a_lost_gpu_disappears_from_the_readings():
    probe = SimulatedProbe("node-1", clock=Clock())
    probe.set_fatal(FatalKind.GPU_LOST, gpu_index=5)

    reading = probe.read()

    assert reading.fatal_error.kind is FatalKind.GPU_LOST
    assert [g.index for g in reading.gpus] == [0, 1, 2, 3, 4, 6, 7]


def test_wait_events_wakes_when_an_xid_is_injected():
    probe = SimulatedProbe("node-1", clock=Clock())
    threading.Timer(0.05, probe.inject_xid, args=(79,)).start()

    events = probe.wait_events(5.0)

    assert [e.xid for e in events] == [79]


def test_a_probe_driven_by_the_fault_model_breaks_as_the_model_says():
    clock = Clock()
    probe = SimulatedProbe("node-1", seed=4, clock=clock, fault_model=FaultModel(rate_multiplier=20_000))

    clock.advance(days=1)  # about 76 faults
    reading = probe.read()
    events = probe.wait_events(0)

    applied = probe.faults_applied
    assert len(applied) > 30
    assert [e.xid for e in events] == [x for f in applied for x in f.xids]
    assert all(clock.now - timedelta(days=1) <= e.timestamp <= clock.now for e in events)
    assert evaluate_node(events=events, readings=[reading], now=clock.now).action in {Action.DRAIN_NOW, Action.RMA}


@pytest.mark.parametrize(
    ("category", "xids", "actions"),
    [
        (FaultCategory.SOFTWARE, (13,), {Action.NONE}),
        (FaultCategory.FAULTY_GPU, (79,), {Action.DRAIN_NOW}),
        (FaultCategory.HBM3, (48,), {Action.DRAIN}),
        (FaultCategory.HBM3, (63, 64), {Action.RMA}),
        (FaultCategory.NETWORK, (74,), {Action.DRAIN}),
    ],
)
def test_a_drawn_fault_applied_to_a_probe_gets_its_action(category, xids, actions):
    clock = Clock()
    probe = SimulatedProbe("node-1", clock=clock)
    faults = [
        f
        for f in next_faults(NODES, 54 * DAY, random.Random(405), model=FaultModel(rate_multiplier=5))
        if f.category is category and f.xids == xids
    ]

    events = probe.apply_fault(faults[0].model_copy(update={"node_id": "node-1"}))
    clock.advance(minutes=1)
    verdict = evaluate_node(events=events, readings=[probe.read()], now=clock.now, expected_gpu_count=8)

    assert verdict.action in actions, verdict.conditions
