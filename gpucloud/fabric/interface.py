"""What the control plane asks of the three fabric managers, and the records they answer with.

Three adapter families sit behind `FabricController`:

- `InfiniBandPartitions`, modelled on NVIDIA UFM's PKey REST API: a partition key in
  0x0001-0x7ffe holds port GUIDs as full or limited members; 0x7fff is the default partition.
- `NvLinkPartitions`, modelled on NMX-M: a partition holds GPUs of one NVL72 domain, and a GPU is
  in at most one partition.
- `EthernetVpcs`, modelled on an SDN controller: one VXLAN VNI per tenant, nodes attached to it.

The real adapters point the HTTP clients (`gpucloud.fabric.http_clients`) at UFM, NMX-M and the
SDN controller; the tests and `gpucloud up` point them at `gpucloud.sim.fabric_managers`.
Every call is blocking; async callers (Temporal activities) run them with `asyncio.to_thread`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_PKEY = 0x7FFF
"""The default partition: every port may sit in it, but only as a limited member."""
MIN_PKEY, MAX_PKEY = 0x0001, 0x7FFE
"""The range an allocation's partition key is taken from."""
MIN_VNI, MAX_VNI = 1, (1 << 24) - 1
"""A VXLAN network identifier is 24 bits; 0 is reserved."""


class Membership(StrEnum):
    FULL = "full"
    LIMITED = "limited"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PortMember(_Record):
    guid: str = Field(description="port GUID, 0x followed by 16 hex digits")
    membership: Membership


class PKey(_Record):
    pkey: int
    name: str = ""
    members: tuple[PortMember, ...] = ()

    def guids(self, membership: Membership | None = None) -> set[str]:
        return {m.guid for m in self.members if membership is None or m.membership == membership}


class NvlPartition(_Record):
    partition_id: int
    name: str
    domain_id: str
    gpu_uids: tuple[str, ...]


class Vpc(_Record):
    vni: int
    tenant_id: str
    nodes: tuple[str, ...] = ()


class FabricNode(_Record):
    """A node's endpoints on the three fabrics, as the inventory knows them."""

    node_id: str
    port_guids: tuple[str, ...] = ()
    nvl_domain: str | None = Field(default=None, description="the NVL72 domain (rack) of its GPUs")
    gpu_uids: tuple[str, ...] = ()


class FabricSnapshot(_Record):
    """Everything the three managers hold, read at one moment (manager by manager)."""

    pkeys: tuple[PKey, ...]
    nvl_partitions: tuple[NvlPartition, ...]
    vpcs: tuple[Vpc, ...]


class FabricError(Exception):
    """A manager refused a request; `constraint` names the rule it would have broken."""

    def __init__(self, status_code: int, constraint: str, message: str) -> None:
        super().__init__(f"{status_code} {constraint}: {message}")
        self.status_code = status_code
        self.constraint = constraint
        self.message = message


class FabricVerificationError(Exception):
    """Membership read back from a manager differs from what was applied."""

    def __init__(self, allocation_id: str, differences: list[str]) -> None:
        super().__init__(f"allocation {allocation_id}: " + "; ".join(differences))
        self.allocation_id = allocation_id
        self.differences = differences


class InfiniBandPartitions(Protocol):
    def create_pkey(self, pkey: int, *, name: str) -> PKey: ...
    def add_ports(self, pkey: int, guids: list[str], *, membership: Membership) -> None: ...
    def remove_ports(self, pkey: int, guids: list[str]) -> None: ...
    def get_pkey(self, pkey: int) -> PKey | None: ...
    def list_pkeys(self, *, members: bool = False) -> list[PKey]:
        """Every pkey; with `members` each with its ports, else names only (members empty)."""
        ...

    def delete_pkey(self, pkey: int) -> None: ...


class NvLinkPartitions(Protocol):
    def create_partition(self, *, name: str, domain_id: str, gpu_uids: list[str]) -> NvlPartition: ...
    def update_partition(self, partition_id: int, *, gpu_uids: list[str]) -> NvlPartition: ...
    def get_partition(self, partition_id: int) -> NvlPartition | None: ...
    def list_partitions(self, *, domain_id: str | None = None) -> list[NvlPartition]: ...
    def delete_partition(self, partition_id: int) -> None: ...


class EthernetVpcs(Protocol):
    def create_vpc(self, *, tenant_id: str, vni: int | None = None) -> Vpc: ...
    def get_vpc(self, vni: int) -> Vpc | None: ...
    def list_vpcs(self, *, tenant_id: str | None = None) -> list[Vpc]: ...
    def attach(self, vni: int, node_id: str) -> Vpc: ...
    def detach(self, vni: int, node_id: str) -> Vpc: ...
    def delete_vpc(self, vni: int) -> None: ...


class FabricController(Protocol):
    """One handle on the three managers of a site."""

    @property
    def infiniband(self) -> InfiniBandPartitions: ...
    @property
    def nvlink(self) -> NvLinkPartitions: ...
    @property
    def ethernet(self) -> EthernetVpcs: ...


class FabricTokens(NamedTuple):
    """Each fabric manager's own API token: one manager's token opens no other manager."""

    ufm: str
    nmx: str
    sdn: str
