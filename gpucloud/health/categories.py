"""The causes a GPU fleet's interruptions are filed under, as Meta's Llama 3 405B run counted them.

One vocabulary for the simulator (`sim/faults.py` draws faults by category, with the paper's mix)
and for the health rules (`health/signals.py` files each signal under the category it reveals),
so that what is injected and what is detected can be compared category by category.
"""

from __future__ import annotations

from enum import StrEnum


class FaultCategory(StrEnum):
    FAULTY_GPU = "faulty_gpu"
    HBM3 = "hbm3"
    SOFTWARE = "software"
    NETWORK = "network"
    HOST_MAINTENANCE = "host_maintenance"
    GPU_SRAM = "gpu_sram"
    GSP = "gsp"
    NIC = "nic"
    NCCL_WATCHDOG = "nccl_watchdog"
    SILENT_DATA_CORRUPTION = "silent_data_corruption"
    OTHER = "other"
