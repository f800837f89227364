"""Placement of NVL72 slices (pure) and the simulated fleet's NVL72 racks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpucloud.services.allocations import pick_slice
from gpucloud.sim.fabric_managers import nvl_domains
from gpucloud.sim.nodes import Fleet, FleetSpec

pytestmark = pytest.mark.unit


def _tray(i: int, domain: str | None):
    return SimpleNamespace(id=f"n{i:03d}", nvlink_domain=domain)


def test_pick_slice_takes_the_tightest_rack_that_fits():
    trays = (
        [_tray(i, "rack-a") for i in range(10)]
        + [_tray(20 + i, "rack-b") for i in range(5)]
        + [_tray(40 + i, None) for i in range(8)]
    )  # no NVLink domain: never part of a slice
    assert {t.nvlink_domain for t in pick_slice(trays, 4)} == {"rack-b"}
    assert [t.id for t in pick_slice(trays, 6)] == [f"n{i:03d}" for i in range(6)]
    assert pick_slice(trays, 11) is None  # 15 trays in all, but no rack has 11


def test_fleet_adds_nvl72_racks_after_the_default_pool():
    fleet = Fleet(FleetSpec(nodes=2, nvl72_racks=2, nvl72_trays_per_rack=3, id_prefix="p"))
    inventory = fleet.inventory("http://sim")
    assert [n["gpu_type"] for n in inventory] == ["H100"] * 2 + ["GB200"] * 6
    assert all(n["nvlink_domain"] is None and n["gpu_uids"] == [] for n in inventory[:2])
    domains = nvl_domains(inventory)
    assert sorted(domains) == ["p-nvl72-000", "p-nvl72-001"]
    assert all(len(gpus) == 12 for gpus in domains.values())  # 3 trays of 4 GPUs
    gpus = [g for n in inventory for g in n["gpu_uids"]]
    ports = [p for n in inventory for p in n["ib_port_guids"]]
    assert len(set(gpus)) == len(gpus) and len(set(ports)) == len(ports)
    # A rack's trays share one pod and one rack name (one InfiniBand domain, one NVLink domain).
    for domain in domains:
        trays = [n for n in inventory if n["nvlink_domain"] == domain]
        assert len({(n["pod"], n["rack"]) for n in trays}) == 1
    assert len(Fleet(FleetSpec(nodes=2)).nodes) == 2  # none unless asked for
