"""What the simulated fleet's host conditions look like to a host agent: the signals beyond XIDs
(`health/signals.py`) that each one shows as.

The fault model (`sim/faults.py`) names a host condition for every fault NVML cannot see: a
switch or cable, a NIC, the host's maintenance, an NCCL watchdog timeout, silent data
corruption, the tail of other hardware. A real host shows each as one or more signals, the most
telling first: a cable that fails takes the port out of ACTIVE and bumps `link_downed`; a NIC's
firmware reports itself broken and its link drops.
"""

from __future__ import annotations

from gpucloud.protocol.reports import Signal

HOST_CONDITION_SIGNALS: dict[str, tuple[Signal, ...]] = {
    "fabric_link_down": (Signal.IB_LINK_DOWN, Signal.IB_LINK_DOWNED),
    "nic_down": (Signal.NIC_ERROR, Signal.IB_LINK_DOWN),
    "host_maintenance": (Signal.HOST_MAINTENANCE,),
    "nccl_watchdog_timeout": (Signal.NCCL_TIMEOUT, Signal.WORKLOAD_HANG),
    "silent_data_corruption": (Signal.SDC_SUSPECT,),
    # The paper's tail: thermal interface first, then the PCIe side (IO board, SSD, CPU).
    "host_hardware": (Signal.THERMAL, Signal.PCIE_AER_UNCORRECTABLE),
}
