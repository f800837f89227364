"""The simulator's host conditions map to the signals a host agent would see."""

from __future__ import annotations

import pytest

from gpucloud.health.categories import FaultCategory
from gpucloud.health.signals import SIGNAL_TABLE
from gpucloud.sim.faults import MANIFESTATIONS
from gpucloud.sim.host_signals import HOST_CONDITION_SIGNALS

pytestmark = pytest.mark.unit

INJECTED: dict[FaultCategory, set[str]] = {
    category: {m.host_condition for m in ways if m.host_condition is not None}
    for category, ways in MANIFESTATIONS.items()
}


def test_the_table_names_exactly_the_host_conditions_the_simulator_injects():
    assert set(HOST_CONDITION_SIGNALS) == set().union(*INJECTED.values())
    assert all(HOST_CONDITION_SIGNALS.values())


@pytest.mark.parametrize("category", [c for c, conditions in INJECTED.items() if conditions])
def test_every_non_xid_category_injected_shows_a_signal_of_its_own_category(category: FaultCategory):
    for condition in INJECTED[category]:
        shown = {SIGNAL_TABLE[signal].category for signal in HOST_CONDITION_SIGNALS[condition]}
        assert category in shown, (condition, shown)


def test_the_categories_without_an_xid_are_all_covered():
    assert {c for c, conditions in INJECTED.items() if conditions} == {
        FaultCategory.NETWORK,
        FaultCategory.HOST_MAINTENANCE,
        FaultCategory.NIC,
        FaultCategory.NCCL_WATCHDOG,
        FaultCategory.SILENT_DATA_CORRUPTION,
        FaultCategory.OTHER,
    }
