"""A wipe's cleaning in the node's history: one event per step the agent answered (its GPUs reset,
each tenant disk sanitized, the tenant's files removed), with the agent's words as the cause, so
an operator reads in the node's events how it was cleaned before it went back to the pool.

The agent answers a repeated wipe request from memory, so a retried activity brings the same
steps again: each wipe's events carry its request id (`op_id`), and a wipe already recorded is
not recorded twice.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlmodel import Session, col, select

from gpucloud.models.tables import Node, NodeTransition, utcnow
from gpucloud.protocol.actions import DISK_SANITIZE, GPU_RESET, SCRATCH, CleaningStep

EVENTS = {GPU_RESET: "gpu_reset", DISK_SANITIZE: "disk_sanitized", SCRATCH: "scratch_removed"}
FAILED_EVENTS = {GPU_RESET: "gpu_reset_failed", DISK_SANITIZE: "disk_sanitize_failed", SCRATCH: "scratch_not_removed"}
# A node whose agent has no tenant disks configured: the event says none was sanitized.
NO_DISKS_EVENT = "disk_sanitize_skipped"


def event_for(step: CleaningStep) -> str:
    """The node event a step is recorded as (`gpu_reset`, `disk_sanitized`, `scratch_removed`, or
    for a failed step `gpu_reset_failed`, ...); a step this control plane does not know, by its
    own name."""
    if not step.ok:
        return FAILED_EVENTS.get(step.step, f"{step.step}_failed")
    if step.step == DISK_SANITIZE and step.method == "none":
        return NO_DISKS_EVENT
    return EVENTS.get(step.step, step.step)


def cause_for(step: CleaningStep) -> str:
    target = f"{step.target}: " if step.target else ""
    return f"{target}{step.method}: {step.answer}"


def op_id_for(request_id: str) -> str:
    return f"clean:{request_id}"


def record_cleaning(
    session: Session, wiped: Iterable[tuple[str, str, list[CleaningStep]]], *, actor: str = "system"
) -> int:
    """Record each wipe's steps ((node id, wipe request id, steps) each) as node events, in one
    transaction; a wipe whose events are recorded already, and a node that is gone, are skipped.
    How many events were added."""
    wipes = [(node_id, op_id_for(request_id), steps) for node_id, request_id, steps in wiped if steps]
    if not wipes:
        return 0
    node_ids = sorted({node_id for node_id, _, _ in wipes})
    nodes = {n.id: n for n in session.exec(select(Node).where(col(Node.id).in_(node_ids))).all()}
    recorded = set(
        session.exec(
            select(NodeTransition.node_id, NodeTransition.op_id).where(
                col(NodeTransition.node_id).in_(node_ids),
                col(NodeTransition.op_id).in_([op_id for _, op_id, _ in wipes]),
            )
        ).all()
    )
    now, added = utcnow(), 0
    for node_id, op_id, steps in wipes:
        node = nodes.get(node_id)
        if node is None or (node_id, op_id) in recorded:
            continue
        for step in steps:
            event = NodeTransition.noted(node, event_for(step), cause=cause_for(step), actor=actor, at=now)
            event.op_id = op_id
            session.add(event)
            added += 1
        recorded.add((node_id, op_id))
    return added
