"""What the cloud sells: GPU types and allocation limits (pure data)."""

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
