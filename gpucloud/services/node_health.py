"""What an operator reads of one node's health (`GET /v1/nodes/{id}/health`): its state, health
and conditions, the newest XID events, readings and signal observations."""

from __future__ import annotations

from sqlmodel import Session, col, select

from gpucloud.models.api_schemas import NodeHealth, SignalRecordPublic, XidRecordPublic
from gpucloud.models.health_tables import NodeReadingRecord, SignalObservationRecord, XidEventRecord
from gpucloud.models.tables import Node
from gpucloud.protocol.reports import NodeReading
from gpucloud.services.errors import NotFound


def node_health(session: Session, node_id: str, *, limit: int, reading_limit: int, signal_limit: int) -> NodeHealth:
    """The node's health with its newest `limit` XIDs, `reading_limit` readings and
    `signal_limit` signal observations, newest first."""
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound("node", node_id)
    rows = session.exec(
        select(XidEventRecord)
        .where(col(XidEventRecord.node_id) == node_id)
        .order_by(col(XidEventRecord.seq).desc())
        .limit(limit)
    ).all()
    readings = session.exec(
        select(col(NodeReadingRecord.reading))
        .where(col(NodeReadingRecord.node_id) == node_id)
        .order_by(col(NodeReadingRecord.timestamp).desc())
        .limit(reading_limit)
    ).all()
    signals = session.exec(
        select(SignalObservationRecord)
        .where(col(SignalObservationRecord.node_id) == node_id)
        .order_by(col(SignalObservationRecord.at).desc(), col(SignalObservationRecord.seq).desc())
        .limit(signal_limit)
    ).all()
    return NodeHealth(
        node_id=node.id,
        state=node.state,
        health=node.health,
        conditions=node.health_conditions,
        xid_history=[XidRecordPublic.model_validate(r, from_attributes=True) for r in rows],
        readings=[NodeReading.model_validate(r) for r in readings],
        signal_history=[SignalRecordPublic.model_validate(r, from_attributes=True) for r in signals],
    )
