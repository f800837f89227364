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
