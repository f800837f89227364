"""The XID classification table: what each driver-reported GPU error means and what to do.

An XID is the NVIDIA driver's error code for a GPU event. Some are the workload's own fault and
say nothing about the hardware; some mean the GPU must leave service now. This table is the one
place that tells them apart; `health/rules.py` applies it with time, bursts and tenants in view.

`counts_as_fatal` marks the XIDs that need a drain and a reset; two such episodes on one node
within the lemon window send it to RMA instead of another reset. `rma_candidate` marks XIDs
after which a reset may not help; the rules confirm it from the node's counters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from gpucloud.health.verdict import Action, Health


class XidClass(StrEnum):
    APPLICATION = "application"
    FATAL = "fatal"
    DOUBLE_BIT_ECC = "double_bit_ecc"
    ROW_REMAP = "row_remap"
    ROW_REMAP_FAILURE = "row_remap_failure"
    NVLINK = "nvlink"
    OFF_BUS = "off_bus"
    TREND = "trend"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class XidPolicy:
    xid: int
    xid_class: XidClass
    meaning: str
    health: Health
    action: Action
    recovery: str
    counts_as_fatal: bool = False
    rma_candidate: bool = False


def _policies(xids: tuple[int, ...], xid_class: XidClass, meanings: dict[int, str], **kwargs) -> dict[int, XidPolicy]:
    return {xid: XidPolicy(xid=xid, xid_class=xid_class, meaning=meanings[xid], **kwargs) for xid in xids}


APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})

XID_TABLE: dict[int, XidPolicy] = {
    **_policies(
        tuple(sorted(APPLICATION_XIDS)),
        XidClass.APPLICATION,
        {
            13: "graphics engine exception",
            31: "GPU memory page fault",
            43: "GPU stopped processing (channel reset)",
            45: "preemptive cleanup after a previous error",
            68: "video processor exception",
        },
        health=Health.OK,
        action=Action.NONE,
        recovery="none on the node: count it; escalate when repeats span tenants",
    ),
    **_policies(
        (46, 95, 119, 120, 140, 143),
        XidClass.FATAL,
        {
            46: "GPU stopped processing",
            95: "uncontained ECC error",
            119: "GSP RPC timeout",
            120: "GSP error",
            140: "unrecovered ECC error",
            143: "GPU initialization failure",
        },
        health=Health.FAILED,
        action=Action.DRAIN,
        recovery="drain, reset, verify in burn-in",
        counts_as_fatal=True,
    ),
    48: XidPolicy(
        xid=48,
        xid_class=XidClass.DOUBLE_BIT_ECC,
        meaning="double-bit ECC error",
        health=Health.FAILED,
        action=Action.DRAIN,
        recovery="drain, reset to remap the row; RMA if the remap fails",
        counts_as_fatal=True,
        rma_candidate=True,
    ),
    63: XidPolicy(
        xid=63,
        xid_class=XidClass.ROW_REMAP,
        meaning="row remap recorded",
        health=Health.SUSPECT,
        action=Action.WATCH,
        recovery="trend it; the remap takes effect at the next reset (the wipe between tenants resets)",
    ),
    64: XidPolicy(
        xid=64,
        xid_class=XidClass.ROW_REMAP_FAILURE,
        meaning="row remap failed",
        health=Health.FAILED,
        action=Action.DRAIN,
        recovery="drain; RMA candidate (spare rows exhausted)",
        counts_as_fatal=True,
        rma_candidate=True,
    ),
    74: XidPolicy(
        xid=74,
        xid_class=XidClass.NVLINK,
        meaning="NVLink error",
        health=Health.FAILED,
        action=Action.DRAIN,
        recovery="drain, read link counters, reset; reseat or RMA",
        counts_as_fatal=True,
    ),
    79: XidPolicy(
        xid=79,
        xid_class=XidClass.OFF_BUS,
        meaning="GPU has fallen off the bus",
        health=Health.FAILED,
        action=Action.DRAIN_NOW,
        recovery="drain now, power-cycle; RMA on recurrence",
        counts_as_fatal=True,
        rma_candidate=True,
    ),
    **_policies(
        (92, 94),
        XidClass.TREND,
        {92: "high single-bit ECC error rate", 94: "contained ECC error"},
        health=Health.OK,
        action=Action.WATCH,
        recovery="trend it; the application restarts, the GPU stays",
    ),
}

# An XID this table does not know (often a newer driver's) makes the node suspect and watched,
# never drained: draining on an unknown number would turn one driver rollout into a fleet-wide
# drain. The condition names the XID, so an operator sees it and extends the table.
_UNKNOWN = XidPolicy(
    xid=-1,
    xid_class=XidClass.UNKNOWN,
    meaning="XID not in the classification table",
    health=Health.SUSPECT,
    action=Action.WATCH,
    recovery="operator review; add it to the XID table",
)


def classify_xid(xid: int) -> XidPolicy:
    policy = XID_TABLE.get(xid)
    if policy is None:
        return replace(_UNKNOWN, xid=xid)
    return policy


def is_application_xid(xid: int) -> bool:
    return xid in APPLICATION_XIDS
