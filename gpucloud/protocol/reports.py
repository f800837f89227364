"""The node protocol's reports: what a node's agent (real or simulated) sends the control plane
on its own, at `POST /v1/agents/{heartbeats,readings,events,signals}`: heartbeats (`Heartbeat`),
what its probe reads from the node's GPUs (`NodeReading`), XID events (`XidEvent`) and the
signals that show no XID (`SignalReport`: kernel log, InfiniBand sysfs), each in its batch model,
which is also what the API accepts.

The readings are the contract between the probes (`adapters/nvml.py` on a real node, the
simulated probe in `sim/probe.py`) and everything that judges health (`health/`). They carry
raw counters exactly as NVML reports them; interpretation (rates, trends, thresholds) is the
health rules' job, so a reading can be re-judged later under a different policy.

A counter is `None` when the GPU or driver does not support it: "not supported" and "zero" are
different facts, and trend rules must not treat a missing counter as a healthy one. NVML's
counters are unsigned: a negative one is a broken sender, refused when the control plane
validates a pushed reading.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, computed_field

from gpucloud.models.tenant_messages import TENANT_ID_PATTERN

# NVML's clock event (formerly "throttle") reason bits, copied from pynvml's
# `nvmlClocksEventReason*` / `nvmlClocksThrottleReason*` constants so that this module decodes a
# mask without importing pynvml (a test checks the two stay in step).
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}

# Reasons the hardware imposes on itself: sustained, they point at cooling, power delivery or a
# failing board rather than at the workload.
HARDWARE_SLOWDOWN_REASONS = frozenset({"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})


def decode_clock_event_reasons(mask: int) -> list[str]:
    """Names of the bits set in an NVML clock event reason mask, lowest bit first.

    Bits this table does not know (a newer driver) are kept as `bit_<n>` rather than dropped,
    so a new reason is visible instead of silently read as "no reason".
    """
    names = []
    for bit in range(mask.bit_length()):
        value = 1 << bit
        if mask & value:
            names.append(CLOCK_EVENT_REASONS.get(value, f"bit_{bit}"))
    return names


class _Reading(BaseModel):
    model_config = ConfigDict(frozen=True)


class EccCounts(_Reading):
    """Memory ECC error totals. Volatile counts reset with the driver; aggregate ones persist."""

    volatile_corrected: NonNegativeInt | None = None
    volatile_uncorrected: NonNegativeInt | None = None
    aggregate_corrected: NonNegativeInt | None = None
    aggregate_uncorrected: NonNegativeInt | None = None


class RemappedRows(_Reading):
    """HBM row remapping state (A100 and later): rows remapped so far and the remapper's flags.

    `pending` means a remap is recorded but takes effect only after a GPU reset; `failure` means
    the remapper ran out of spare rows, which no reset can fix.
    """

    correctable: NonNegativeInt
    uncorrectable: NonNegativeInt
    pending: bool
    failure: bool


class NvLinkReading(_Reading):
    """One NVLink's state and data-link error counters. Counters are read on active links only."""

    link: NonNegativeInt
    active: bool
    replay: NonNegativeInt | None = None
    recovery: NonNegativeInt | None = None
    crc_flit: NonNegativeInt | None = None
    crc_data: NonNegativeInt | None = None


# Bounds on what an agent may send (a tenant has root on the node and can send anything): per
# request a node's worth, not a fleet's, and every field bounded.
AGENT_MAX_EVENTS = 500
AGENT_MAX_READINGS = 10
AGENT_MAX_SIGNAL_REPORTS = 10
MAX_GPUS_PER_NODE = 72
NodeId = Annotated[str, Field(min_length=1, max_length=128)]
Text = Annotated[str, Field(max_length=2000)]
ShortId = Annotated[str, Field(max_length=128)]
# A tenant's id names folders on the node (its weights, its keys): an id's characters only.
TenantId = Annotated[str, Field(pattern=TENANT_ID_PATTERN)]
# The kernel's boot id is a UUID (36 characters); the simulated fleet counts boots.
BootId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z-]+$")]


class GpuReading(_Reading):
    index: NonNegativeInt
    uuid: ShortId
    name: ShortId
    temperature_c: int | None = None
    power_w: NonNegativeFloat | None = None
    ecc: EccCounts = EccCounts()
    remapped_rows: RemappedRows | None = None
    nvlinks: tuple[NvLinkReading, ...] = ()
    pcie_replay: NonNegativeInt | None = None
    clock_event_reasons: NonNegativeInt | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def clock_event_reason_names(self) -> list[str]:
        if self.clock_event_reasons is None:
            return []
        return decode_clock_event_reasons(self.clock_event_reasons)


class FatalKind(StrEnum):
    """Probe failures that mean the node cannot run GPU work until someone intervenes."""

    DRIVER_NOT_LOADED = "driver_not_loaded"
    GPU_LOST = "gpu_lost"
    RESET_REQUIRED = "reset_required"
    # User-space NVML and the kernel module disagree: the driver was upgraded without a reboot.
    DRIVER_MISMATCH = "driver_mismatch"


class ProbeFatal(_Reading):
    kind: FatalKind
    gpu_index: NonNegativeInt | None = None
    detail: Text = ""


class NodeReading(_Reading):
    """One periodic sample of a whole node.

    `is_gpu_node` is False when no GPU library is installed: a CPU node, not a broken GPU node.
    `fatal_error` is set when the library is there but the driver or a GPU is gone; `gpus` then
    holds whatever could still be read.
    """

    node_id: NodeId
    timestamp: AwareDatetime
    is_gpu_node: bool
    gpus: tuple[GpuReading, ...] = Field(default=(), max_length=MAX_GPUS_PER_NODE)
    fatal_error: ProbeFatal | None = None


class XidEvent(_Reading):
    """One XID (driver-reported GPU error) as it happened on a node.

    The probe fills in where and when; `tenant_id` / `allocation_id` are stamped by whoever knows
    which workload held the node at that moment (the agent while it runs an allocation, or the
    control plane on ingest), because application XIDs are judged by how many tenants see them.
    What an agent sends there is not believed: the control plane stamps both from its own record.
    """

    node_id: NodeId
    gpu_index: int | None = Field(ge=0, lt=MAX_GPUS_PER_NODE)
    gpu_uuid: ShortId | None = None
    xid: int = Field(ge=0, le=1_000_000)
    timestamp: AwareDatetime
    message: Text = ""
    tenant_id: TenantId | None = None
    allocation_id: ShortId | None = None


class WorkloadStatus(BaseModel):
    """What runs of the allocation's workload on a node, as its agent reports it."""

    state: Literal["none", "running", "exited", "stopped"]
    allocation_id: ShortId | None = None
    exit_code: int | None = Field(None, ge=-(2**31), lt=2**31)
    isolation: str | None = Field(
        None,
        max_length=32,
        description="pid-namespace, process-group where namespaces are refused, or container (podman or docker)",
    )


class Heartbeat(BaseModel):
    """One node's heartbeat. A tenant has root on the node and may send anything here: every
    string is bounded, so a report costs the control plane a node's worth of memory at most."""

    node_id: NodeId
    tenant_id: TenantId | None = None
    workload_running: bool = False
    boot_id: BootId | None = None
    workload: WorkloadStatus | None = Field(None, description="the allocation's processes on the node")


class Signal(StrEnum):
    """Faults that show no XID, as a node sees them; `health/signals.py` says what each means."""

    IB_LINK_DOWN = "ib_link_down"
    IB_LINK_DOWNED = "ib_link_downed"
    IB_SYMBOL_ERRORS = "ib_symbol_errors"
    IB_RCV_ERRORS = "ib_rcv_errors"
    NIC_ERROR = "nic_error"
    PCIE_AER_UNCORRECTABLE = "pcie_aer_uncorrectable"
    PCIE_AER_CORRECTABLE = "pcie_aer_correctable"
    NVRM_ERROR = "nvrm_error"
    GPU_ROW_REMAP_FAILURE = "gpu_row_remap_failure"
    GPU_ROW_REMAP_PENDING = "gpu_row_remap_pending"
    ECC_DBE = "ecc_dbe"
    ECC_SBE_RATE = "ecc_sbe_rate"
    WORKLOAD_HANG = "workload_hang"
    NCCL_TIMEOUT = "nccl_timeout"
    THERMAL = "thermal"
    SDC_SUSPECT = "sdc_suspect"
    HOST_MAINTENANCE = "host_maintenance"
    # What the scheduled diagnostics of an idle node find (`AgentAction.DIAGNOSE`).
    DIAG_FAILURE = "diag_failure"
    NCCL_ALLREDUCE_SLOW = "nccl_allreduce_slow"
    NVBANDWIDTH_LOW = "nvbandwidth_low"


class SignalObservation(_Reading):
    """One occurrence of a signal, or a counter's growth over `span` (ending at `at`).

    `source` names where it was seen: an InfiniBand port (`mlx5_0/1`), a PCI address, an
    interface; thresholds count per source, since two ports each just below the bar are two
    healthy ports, not one bad one.
    """

    signal: Signal
    at: AwareDatetime
    source: ShortId = ""
    count: NonNegativeInt = 1
    span: timedelta | None = Field(None, ge=timedelta(0))
    detail: Text = ""


class SignalReport(BaseModel):
    """What a node's agent observed of the signals beyond XIDs since its last report, taken at `at`.

    Like a reading, it carries what the host showed (kernel log lines, sysfs counter growth), not
    a judgement: `health.signals.judge_signals` applies the table on the control plane's side.
    """

    node_id: NodeId
    at: AwareDatetime
    observations: list[SignalObservation] = Field(min_length=1, max_length=AGENT_MAX_EVENTS)


# How many reports one request carries at most (an agent sends its own one at a time; a
# simulated fleet too large to report node by node sends batches under the operator token).
MAX_HEARTBEATS_BATCH = 5000
MAX_EVENTS_BATCH = 5000
MAX_READINGS_BATCH = 1000
MAX_SIGNAL_REPORTS_BATCH = 1000


class HeartbeatBatch(BaseModel):
    heartbeats: list[Heartbeat] = Field(min_length=1, max_length=MAX_HEARTBEATS_BATCH)


class XidEventBatch(BaseModel):
    events: list[XidEvent] = Field(min_length=1, max_length=MAX_EVENTS_BATCH)


class ReadingBatch(BaseModel):
    readings: list[NodeReading] = Field(min_length=1, max_length=MAX_READINGS_BATCH)


class SignalReportBatch(BaseModel):
    reports: list[SignalReport] = Field(min_length=1, max_length=MAX_SIGNAL_REPORTS_BATCH)


def utc_now() -> datetime:
    """The default clock for probes; tests and simulations pass their own."""
    return datetime.now(UTC)
