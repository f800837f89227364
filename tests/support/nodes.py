"""Nodes enrolled straight into a control-plane database, for tests of the services below the API."""

from __future__ import annotations

from gpucloud.db import session_scope
from gpucloud.models.tables import NodeEnroll
from gpucloud.services import nodes as node_service


def enroll(db_url: str, ids: list[str], **fields) -> list[str]:
    """Enroll H100 x8 nodes with these ids (hostname = id; `fields` override the rest)."""
    defaults = {"region": "r1", "pod": "pod0", "rack": "pod0-r0", "gpu_type": "H100", "gpu_count": 8}
    specs = [NodeEnroll(**{"id": i, "hostname": i, "agent_url": "http://unused", **defaults, **fields}) for i in ids]
    with session_scope(db_url) as session:
        node_service.enroll_nodes(session, specs)
    return ids
