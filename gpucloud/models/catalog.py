"""What the cloud sells: GPU types and allocation limits, and what each GPU type's nodes must run
(pure data)."""

from dataclasses import dataclass

GPU_TYPES: dict[str, int] = {
    # GPU type -> GPUs per node
    "H100": 8,
    "H200": 8,
    "B200": 8,
    "GB200": 4,  # one NVL72 compute tray
    "A100": 8,
}

MAX_NODES_PER_ALLOCATION = 1024

# GPU types sold in NVL72 racks: 18 compute trays whose 72 GPUs share one NVLink domain. An
# allocation may ask for a slice of one rack (`nvl72_trays`): one NVLink partition.
NVL72_GPU_TYPES = frozenset({"GB200"})
NVL72_TRAYS_PER_RACK = 18

# List prices per GPU per hour, in micro-units of currency (2_490_000 = 2.49); the default price
# book `gpucloud up` gives a new ledger. Billed per millisecond (see ledger/pricing.py).
LIST_PRICE_PER_GPU_HOUR_MICRO: dict[str, int] = {
    "H100": 2_490_000,
    "H200": 3_190_000,
    "B200": 5_990_000,
    "GB200": 6_490_000,
    "A100": 1_290_000,
}


@dataclass(frozen=True, kw_only=True)
class VersionPolicy:
    """What a node of a GPU type must run before it is burnt in (`gpucloud.agent.inspection`):
    minimum versions of each layer of the stack, and what its fabric needs."""

    min_vbios: str
    min_kernel: str
    min_driver: str
    min_cuda: str
    min_container_toolkit: str
    # HGX boards route NVLink through NVSwitches that nvidia-fabricmanager configures; on
    # NVLink-switch systems (GB200 NVL72) it works through the InfiniBand stack (NVLSM).
    fabric_manager: bool
    fabric_needs_infiniband: bool
    ib_ports: int
    min_link_rate_gbps: int


VERSION_POLICY: dict[str, VersionPolicy] = {
    "H100": VersionPolicy(
        min_vbios="96.00.74.00.00",
        min_kernel="5.15",
        min_driver="535.104.05",
        min_cuda="12.2",
        min_container_toolkit="1.14.0",
        fabric_manager=True,
        fabric_needs_infiniband=False,
        ib_ports=8,
        min_link_rate_gbps=400,
    ),
    "H200": VersionPolicy(
        min_vbios="96.00.9f.00.00",
        min_kernel="5.15",
        min_driver="550.54.14",
        min_cuda="12.4",
        min_container_toolkit="1.14.0",
        fabric_manager=True,
        fabric_needs_infiniband=False,
        ib_ports=8,
        min_link_rate_gbps=400,
    ),
    "B200": VersionPolicy(
        min_vbios="97.00.00.00.00",
        min_kernel="5.15",
        min_driver="570.124.06",
        min_cuda="12.8",
        min_container_toolkit="1.17.0",
        fabric_manager=True,
        fabric_needs_infiniband=False,
        ib_ports=8,
        min_link_rate_gbps=400,
    ),
    "GB200": VersionPolicy(
        min_vbios="97.00.00.00.00",
        min_kernel="6.8",
        min_driver="570.86.15",
        min_cuda="12.8",
        min_container_toolkit="1.17.0",
        fabric_manager=True,
        fabric_needs_infiniband=True,
        ib_ports=4,
        min_link_rate_gbps=400,
    ),
    "A100": VersionPolicy(
        min_vbios="92.00.25.00.00",
        min_kernel="5.4",
        min_driver="470.57.02",
        min_cuda="11.4",
        min_container_toolkit="1.10.0",
        fabric_manager=True,
        fabric_needs_infiniband=False,
        ib_ports=8,
        min_link_rate_gbps=200,
    ),
}
