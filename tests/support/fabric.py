"""The simulated fabric managers (UFM, NMX-M, SDN) for a test harness: served on a loopback port
in the test process, reached over real HTTP by the worker's activities and by the tests."""

from __future__ import annotations

import secrets

import httpx

from gpucloud.fabric.http_clients import HttpFabricController
from gpucloud.fabric.interface import FabricSnapshot, FabricTokens, Membership, NvlPartition, PKey, Vpc
from gpucloud.fabric.membership import read_snapshot, resource_name
from gpucloud.sim.fabric_managers import FabricManagersServer, create_app, register_nvl_domains


class FabricManagers:
    """The managers, each with an API token of its own, which every client here sends."""

    def __init__(self) -> None:
        self.tokens = FabricTokens(*(secrets.token_urlsafe(16) for _ in range(3)))
        self.server = FabricManagersServer(create_app(tokens=self.tokens))
        self.url = self.server.start()

    def controller(self) -> HttpFabricController:
        return HttpFabricController.for_simulator(self.url, tokens=self.tokens)

    def register_domains(self, inventory: list[dict]) -> int:
        """Tell the simulated NMX-M the NVL72 racks of a fleet (real NMX-M discovers them)."""
        return register_nvl_domains(self.url, inventory, nmx_token=self.tokens.nmx)

    def set_fault(self, mode: str | None) -> None:
        """`unavailable` (every manager answers 503), `stale_reads` (reads leave members out), None."""
        auth = {"Authorization": f"Bearer {self.tokens.ufm}"}
        httpx.put(f"{self.url}/sim/v1/fault", json={"mode": mode}, headers=auth).raise_for_status()

    def snapshot(self) -> FabricSnapshot:
        with self.controller() as c:
            return read_snapshot(c)

    def pkey_of(self, allocation_id: str) -> PKey | None:
        found = [p for p in self.snapshot().pkeys if p.name == resource_name(allocation_id)]
        return found[0] if found else None

    def full_members(self, allocation_id: str) -> set[str]:
        pkey = self.pkey_of(allocation_id)
        return set() if pkey is None else pkey.guids(Membership.FULL)

    def nvl_partitions_of(self, allocation_id: str) -> list[NvlPartition]:
        return [p for p in self.snapshot().nvl_partitions if p.name == resource_name(allocation_id)]

    def vpc_of(self, tenant_id: str) -> Vpc | None:
        found = [v for v in self.snapshot().vpcs if v.tenant_id == tenant_id]
        return found[0] if found else None

    def stop(self) -> None:
        self.server.stop()
