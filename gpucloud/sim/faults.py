"""The fault model of the simulated fleet: how often nodes break, how, and what the break looks like.

Rates and mix come from Meta's Llama 3 405B pre-training run: 16,384 H100 GPUs (2,048 nodes of
eight) over 54 days saw 419 unexpected interruptions, which is about 3.8e-3 interruptions per
8-GPU node-day. `rate_multiplier` speeds this up so a test or demo sees failures in minutes.

Each category of interruption manifests as what a host agent would actually observe: XIDs
(`health/xid.py`), counter jumps and drifts, a probe-fatal state (the GPU is lost), or, for
faults NVML cannot see (a NIC, a switch, host maintenance), a named host condition that the
fleet simulator applies itself. The manifestation weights within a category are this model's
choice; the paper gives only the categories.

Faults arrive as a Poisson process per node, drawn with a caller-seeded `random.Random`, so a
simulation replays exactly.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from gpucloud.health.categories import FaultCategory
from gpucloud.protocol.reports import FatalKind

SECONDS_PER_DAY = 86_400.0


LLAMA3_405B_GPUS = 16_384
LLAMA3_405B_DAYS = 54
LLAMA3_405B_INTERRUPTIONS = 419
# Interruptions by root cause. The paper lists a long tail below the ten named causes (thermal
# interface, SSD, power supply, chassis, IO board, dependencies, CPU, system memory): here
# `other`, sized so the total is the 419 observed.
LLAMA3_405B_MIX: dict[FaultCategory, int] = {
    FaultCategory.FAULTY_GPU: 148,
    FaultCategory.HBM3: 72,
    FaultCategory.SOFTWARE: 54,
    FaultCategory.NETWORK: 35,
    FaultCategory.HOST_MAINTENANCE: 32,
    FaultCategory.GPU_SRAM: 19,
    FaultCategory.GSP: 17,
    FaultCategory.NIC: 7,
    FaultCategory.NCCL_WATCHDOG: 7,
    FaultCategory.SILENT_DATA_CORRUPTION: 6,
}
LLAMA3_405B_MIX[FaultCategory.OTHER] = LLAMA3_405B_INTERRUPTIONS - sum(LLAMA3_405B_MIX.values())

GPUS_PER_NODE = 8
# An H100 or H200 SXM board has 18 NVLinks per GPU.
NVLINKS_PER_GPU = 18
# 419 / (2,048 nodes x 54 days) = 3.79e-3
INTERRUPTIONS_PER_NODE_DAY = LLAMA3_405B_INTERRUPTIONS / (LLAMA3_405B_GPUS / GPUS_PER_NODE * LLAMA3_405B_DAYS)


class Counter(StrEnum):
    """GPU counters a fault can bump or make drift; NVLink ones apply to one link."""

    ECC_CORRECTED = "ecc_corrected"
    ECC_UNCORRECTED = "ecc_uncorrected"
    REMAPPED_CORRECTABLE = "remapped_correctable"
    REMAPPED_UNCORRECTABLE = "remapped_uncorrectable"
    NVLINK_REPLAY = "nvlink_replay"
    NVLINK_RECOVERY = "nvlink_recovery"
    NVLINK_CRC_FLIT = "nvlink_crc_flit"
    NVLINK_CRC_DATA = "nvlink_crc_data"
    PCIE_REPLAY = "pcie_replay"


NVLINK_COUNTERS = frozenset(
    {Counter.NVLINK_REPLAY, Counter.NVLINK_RECOVERY, Counter.NVLINK_CRC_FLIT, Counter.NVLINK_CRC_DATA}
)


class CounterDrift(BaseModel):
    """A counter that keeps rising at `per_hour` on one GPU (and link), until the part is fixed."""

    model_config = ConfigDict(frozen=True)

    counter: Counter
    per_hour: float = Field(gt=0)
    gpu_index: int = 0
    link: int = 0


class Fault(BaseModel):
    """One interruption drawn for one node, `offset_s` seconds into the step it was drawn for.

    NVLink bumps and drifts apply to `link` of GPU `gpu_index`; the rest to the GPU.
    """

    model_config = ConfigDict(frozen=True)

    node_id: str
    category: FaultCategory
    offset_s: float
    gpu_index: int
    link: int = 0
    xids: tuple[int, ...] = ()
    bumps: dict[Counter, int] = {}
    remap_pending: bool = False
    remap_failure: bool = False
    drifts: tuple[CounterDrift, ...] = ()
    fatal: FatalKind | None = None
    host_condition: str | None = None


@dataclass(frozen=True)
class Manifestation:
    """One way a category shows itself; `weight` is relative within the category."""

    weight: float
    xids: tuple[int, ...] = ()
    bumps: dict[Counter, int] = field(default_factory=dict)
    remap_pending: bool = False
    remap_failure: bool = False
    drifts: tuple[tuple[Counter, float], ...] = ()
    fatal: FatalKind | None = None
    host_condition: str | None = None


MANIFESTATIONS: dict[FaultCategory, tuple[Manifestation, ...]] = {
    FaultCategory.FAULTY_GPU: (
        Manifestation(2, xids=(79,), fatal=FatalKind.GPU_LOST),
        Manifestation(1, xids=(119,)),
        Manifestation(1, xids=(120,)),
    ),
    FaultCategory.HBM3: (
        Manifestation(
            3, xids=(48,), bumps={Counter.ECC_UNCORRECTED: 1, Counter.REMAPPED_UNCORRECTABLE: 1}, remap_pending=True
        ),
        Manifestation(
            1,
            xids=(63, 64),
            bumps={Counter.REMAPPED_UNCORRECTABLE: 1},
            remap_failure=True,
            drifts=((Counter.ECC_CORRECTED, 200.0),),
        ),
    ),
    FaultCategory.SOFTWARE: (Manifestation(1, xids=(13,)), Manifestation(1, xids=(31,)), Manifestation(1, xids=(43,))),
    # The paper's "network switch/cable" is the scale-out fabric, which NVML cannot see; one in
    # five is modelled as the NVLink side (XID 74 with CRC errors that keep coming until reseated).
    FaultCategory.NETWORK: (
        Manifestation(4, host_condition="fabric_link_down"),
        Manifestation(
            1,
            xids=(74,),
            bumps={Counter.NVLINK_RECOVERY: 1},
            drifts=((Counter.NVLINK_CRC_FLIT, 500.0), (Counter.NVLINK_REPLAY, 500.0)),
        ),
    ),
    FaultCategory.HOST_MAINTENANCE: (Manifestation(1, host_condition="host_maintenance"),),
    FaultCategory.GPU_SRAM: (Manifestation(1, xids=(95,)), Manifestation(1, xids=(94,))),
    FaultCategory.GSP: (Manifestation(1, xids=(119,)), Manifestation(1, xids=(120,))),
    FaultCategory.NIC: (Manifestation(1, host_condition="nic_down"),),
    FaultCategory.NCCL_WATCHDOG: (Manifestation(1, host_condition="nccl_watchdog_timeout"),),
    # Found by checks and burn-in, never by NVML: that is what makes it silent.
    FaultCategory.SILENT_DATA_CORRUPTION: (Manifestation(1, host_condition="silent_data_corruption"),),
    FaultCategory.OTHER: (Manifestation(1, host_condition="host_hardware"),),
}

# The categories none of whose manifestations shows an XID: only the signals beyond XIDs reveal them.
NON_XID_CATEGORIES = frozenset(c for c, shown in MANIFESTATIONS.items() if not any(m.xids for m in shown))


class FaultModel(BaseModel):
    """Interruption rate and mix; `rate_multiplier` scales the rate and leaves the mix alone."""

    model_config = ConfigDict(frozen=True)

    interruptions_per_node_day: float = Field(default=INTERRUPTIONS_PER_NODE_DAY, gt=0)
    rate_multiplier: float = Field(default=1.0, ge=0)
    mix: dict[FaultCategory, int] = Field(default_factory=lambda: dict(LLAMA3_405B_MIX))
    gpus_per_node: int = Field(default=GPUS_PER_NODE, ge=1)
    nvlinks_per_gpu: int = Field(default=NVLINKS_PER_GPU, ge=1)

    @property
    def rate_per_node_second(self) -> float:
        return self.interruptions_per_node_day * self.rate_multiplier / SECONDS_PER_DAY

    def next_faults(self, nodes: Sequence[str], dt_s: float, rng: random.Random) -> list[Fault]:
        """The interruptions the given nodes suffer in the next `dt_s` seconds, in time order.

        Independent Poisson processes per node add up to one process over the fleet at the
        summed rate, so arrivals are drawn fleet-wide (cost ~ number of faults, not of nodes)
        and each lands on a uniformly chosen node.
        """
        fleet_rate = self.rate_per_node_second * len(nodes)
        if fleet_rate <= 0 or dt_s <= 0:
            return []
        categories = list(self.mix)
        cum_weights = list(itertools.accumulate(self.mix[c] for c in categories))
        faults = []
        offset = rng.expovariate(fleet_rate)
        while offset < dt_s:
            category = rng.choices(categories, cum_weights=cum_weights)[0]
            faults.append(self.manifest(rng.choice(nodes), category, offset, rng))
            offset += rng.expovariate(fleet_rate)
        return faults

    def manifest(self, node_id: str, category: FaultCategory, offset_s: float, rng: random.Random) -> Fault:
        """One fault of `category` on the node, shown as one of the category's manifestations
        (drawn by their weights): what `next_faults` draws, and what a caller forcing a category
        (`sim/fault_injection.py`'s top-up) injects."""
        options = MANIFESTATIONS[category]
        shown = rng.choices(options, [m.weight for m in options])[0]
        gpu_index = rng.randrange(self.gpus_per_node)
        link = rng.randrange(self.nvlinks_per_gpu)
        return Fault(
            node_id=node_id,
            category=category,
            offset_s=offset_s,
            gpu_index=gpu_index,
            link=link,
            xids=shown.xids,
            bumps=dict(shown.bumps),
            remap_pending=shown.remap_pending,
            remap_failure=shown.remap_failure,
            fatal=shown.fatal,
            host_condition=shown.host_condition,
            drifts=tuple(
                CounterDrift(counter=counter, per_hour=rate, gpu_index=gpu_index, link=link)
                for counter, rate in shown.drifts
            ),
        )


LLAMA3_405B = FaultModel()


def next_faults(
    nodes: Sequence[str], dt_s: float, rng: random.Random, *, model: FaultModel = LLAMA3_405B
) -> list[Fault]:
    """The simulated fleet's faults for one step; see `FaultModel.next_faults`."""
    return model.next_faults(nodes, dt_s, rng)
