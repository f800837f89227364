"""Node readings for tests: eight healthy-looking GPUs, with the counters a test wants to move."""

from __future__ import annotations

from datetime import datetime

from gpucloud.protocol.reports import EccCounts, GpuReading, NodeReading, NvLinkReading, ProbeFatal


def node_reading(
    node_id: str, at: datetime, *, corrected: int = 0, link0_active: bool = True, fatal: ProbeFatal | None = None
) -> NodeReading:
    """`corrected` is GPU 2's volatile corrected ECC count; `link0_active` every GPU's NVLink 0."""
    gpus = tuple(
        GpuReading(
            index=i,
            uuid=f"GPU-{node_id}-{i}",
            name="H100",
            temperature_c=60,
            power_w=500.0,
            ecc=EccCounts(volatile_corrected=corrected if i == 2 else 0, volatile_uncorrected=0),
            nvlinks=tuple(
                NvLinkReading(link=link, active=link0_active or link != 0, replay=0, recovery=0, crc_flit=0, crc_data=0)
                for link in range(4)
            ),
            pcie_replay=0,
            clock_event_reasons=0,
        )
        for i in range(8)
    )
    return NodeReading(node_id=node_id, timestamp=at, is_gpu_node=True, gpus=gpus, fatal_error=fatal)
