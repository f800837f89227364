"""What the cloud sells: GPU types and allocation limits, what each GPU type's nodes must run, and
what they must show in burn-in (pure data)."""

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


def known_gpu_type(name: str) -> str | None:
    """The catalog's spelling of GPU type `name`, matched case-insensitively (`h100` is `H100`),
    or None for a type the cloud does not sell. Request schemas normalise with it at the edge,
    so everything behind them (quotas, placement, prices) compares one spelling."""
    return _BY_FOLDED_NAME.get(name.strip().casefold())


_BY_FOLDED_NAME = {name.casefold(): name for name in GPU_TYPES}

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


# What each GPU type's nodes must run. Every type sold is an NVSwitch system (its fabric manager
# must run); GB200 NVL72 trays are NVLink-switch systems, whose fabric manager needs the IB stack.
_POLICIES = (
    # type, VBIOS, kernel, driver, CUDA, container toolkit, NVLink over IB, IB ports, Gb/s
    ("H100", "96.00.74.00.00", "5.15", "535.104.05", "12.2", "1.14.0", False, 8, 400),
    ("H200", "96.00.9f.00.00", "5.15", "550.54.14", "12.4", "1.14.0", False, 8, 400),
    ("B200", "97.00.00.00.00", "5.15", "570.124.06", "12.8", "1.17.0", False, 8, 400),
    ("GB200", "97.00.00.00.00", "6.8", "570.86.15", "12.8", "1.17.0", True, 4, 400),
    ("A100", "92.00.25.00.00", "5.4", "470.57.02", "11.4", "1.10.0", False, 8, 200),
)
VERSION_POLICY: dict[str, VersionPolicy] = {
    row[0]: VersionPolicy(
        min_vbios=row[1],
        min_kernel=row[2],
        min_driver=row[3],
        min_cuda=row[4],
        min_container_toolkit=row[5],
        fabric_manager=True,
        fabric_needs_infiniband=row[6],
        ib_ports=row[7],
        min_link_rate_gbps=row[8],
    )
    for row in _POLICIES
}


@dataclass(frozen=True, kw_only=True)
class BurnInFloor:
    """What a node of a GPU type must show in burn-in (`gpucloud.agent.tools`) to go back to the pool."""

    min_busbw_gbps: float
    """NCCL `all_reduce_perf` average bus bandwidth across the node's GPUs."""
    min_h2d_gbps_per_gpu: float
    """`nvbandwidth -t host_to_device_memcpy_ce`: host-to-GPU copy bandwidth per GPU."""
    max_temperature_c: int
    """Hottest GPU right after the stress (the thermal soak)."""


# Burn-in floors per GPU type. These are defaults an operator overrides (the agent's
# `BurnInLimits(floors=...)`), set below the published peaks so a healthy node passes with room
# and a degraded link does not: NVLink 4 gives an H100/H200 900 GB/s per GPU and NVLink 5 a
# B200/GB200 1.8 TB/s (an 8 x H100 all-reduce reaches about 450 GB/s bus bandwidth, 8 x B200 about
# 800); a PCIe Gen5 x16 host link about 55 GB/s of its 64, Gen4 about 25; a GB200's Grace CPU
# feeds its GPUs over NVLink-C2C (900 GB/s per Grace, shared by its two GPUs). 87 C is the
# usual slowdown margin of an SXM part under DCGM's stress.
BURN_IN_FLOORS: dict[str, BurnInFloor] = {
    "H100": BurnInFloor(min_busbw_gbps=350.0, min_h2d_gbps_per_gpu=40.0, max_temperature_c=87),
    "H200": BurnInFloor(min_busbw_gbps=360.0, min_h2d_gbps_per_gpu=40.0, max_temperature_c=87),
    "B200": BurnInFloor(min_busbw_gbps=650.0, min_h2d_gbps_per_gpu=40.0, max_temperature_c=87),
    "GB200": BurnInFloor(min_busbw_gbps=600.0, min_h2d_gbps_per_gpu=150.0, max_temperature_c=87),
    "A100": BurnInFloor(min_busbw_gbps=180.0, min_h2d_gbps_per_gpu=20.0, max_temperature_c=85),
}
