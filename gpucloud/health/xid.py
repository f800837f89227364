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
    # What it left takes effect (or goes) at the next GPU reset: the wipe between tenants resets,
    # and a node idle when it happens is reset before the next tenant (`RESET_PENDING`).
    reset_pending: bool = False


# One row per XID: class, health, action, flags (`fatal`: counts_as_fatal, `rma`: rma_candidate,
# `next_reset`: reset_pending),
# what it means, and what recovers from it. Application XIDs say nothing about the hardware.
_TABLE = """
13  | application       | ok      | none      |           | graphics engine exception
    | none on the node: count it; escalate when repeats span tenants
31  | application       | ok      | none      |           | GPU memory page fault
    | none on the node: count it; escalate when repeats span tenants
43  | application       | ok      | none      |           | GPU stopped processing (channel reset)
    | none on the node: count it; escalate when repeats span tenants
45  | application       | ok      | none      |           | preemptive cleanup after a previous error
    | none on the node: count it; escalate when repeats span tenants
68  | application       | ok      | none      |           | video processor exception
    | none on the node: count it; escalate when repeats span tenants
46  | fatal             | failed  | drain     | fatal     | GPU stopped processing
    | drain, reset, verify in burn-in
95  | fatal             | failed  | drain     | fatal     | uncontained ECC error
    | drain, reset, verify in burn-in
119 | fatal             | failed  | drain     | fatal     | GSP RPC timeout
    | drain, reset, verify in burn-in
120 | fatal             | failed  | drain     | fatal     | GSP error
    | drain, reset, verify in burn-in
140 | fatal             | failed  | drain     | fatal     | unrecovered ECC error
    | drain, reset, verify in burn-in
143 | fatal             | failed  | drain     | fatal     | GPU initialization failure
    | drain, reset, verify in burn-in
48  | double_bit_ecc    | failed  | drain     | fatal rma | double-bit ECC error
    | drain, reset to remap the row; RMA if the remap fails
63  | row_remap         | suspect | watch     | next_reset | row remap recorded
    | trend it; the remap takes effect at the next reset (the wipe between tenants resets)
64  | row_remap_failure | failed  | drain     | fatal rma | row remap failed
    | drain; RMA candidate (spare rows exhausted)
74  | nvlink            | failed  | drain     | fatal     | NVLink error
    | drain, read link counters, reset; reseat or RMA
79  | off_bus           | failed  | drain_now | fatal rma | GPU has fallen off the bus
    | drain now, power-cycle; RMA on recurrence
92  | trend             | ok      | watch     |           | high single-bit ECC error rate
    | trend it; the application restarts, the GPU stays
94  | trend             | suspect | watch     | next_reset | contained ECC error
    | trend it; the application restarts, the GPU stays; reset before the next tenant
"""


def _parse(table: str) -> dict[int, XidPolicy]:
    lines = table.strip().splitlines()
    policies = {}
    for head, tail in zip(lines[::2], lines[1::2], strict=True):
        xid, xid_class, health, action, flags, meaning = (cell.strip() for cell in head.split("|"))
        policies[int(xid)] = XidPolicy(
            xid=int(xid),
            xid_class=XidClass(xid_class),
            meaning=meaning,
            health=Health(health),
            action=Action(action),
            recovery=tail.split("|", 1)[1].strip(),
            counts_as_fatal="fatal" in flags.split(),
            rma_candidate="rma" in flags.split(),
            reset_pending="next_reset" in flags.split(),
        )
    return policies


XID_TABLE: dict[int, XidPolicy] = _parse(_TABLE)
APPLICATION_XIDS = frozenset(x for x, p in XID_TABLE.items() if p.xid_class == XidClass.APPLICATION)
# The conditions whose cause the next GPU reset settles (an XID row flagged `next_reset`, a row remap
# pending in the readings or the signals): harmless to the tenant who saw them (the wipe after
# them resets every GPU), but a node idle with one is reset before it is handed to anyone.
RESET_PENDING = frozenset(
    {f"xid_{x}" for x, p in XID_TABLE.items() if p.reset_pending} | {"row_remap_pending", "gpu_row_remap_pending"}
)

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
