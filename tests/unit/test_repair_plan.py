"""The reconciler starts a repair only for nodes the health loop pulled, and only when it can work."""

from datetime import UTC, datetime, timedelta

import pytest

from gpucloud.models.messages import NodeOperationKind
from gpucloud.reconciler.plan import NodeSnapshot, plan_node

NOW = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(("state", "health", "maintenance", "reachable", "start"), [
    ("quarantined", "failed", False, True, NodeOperationKind.REPAIR),
    ("quarantined", "suspect", False, True, NodeOperationKind.REPAIR),
    ("quarantined", "ok", False, True, None),  # an operator's drain: the operator decides
    ("quarantined", "failed", True, True, None),  # under maintenance
    ("quarantined", "failed", False, False, None),  # a silent agent would fail every rung
    ("rma", "failed", False, True, None),
    ("available", "failed", False, True, None),
])
def test_repair_started_for_health_quarantined_nodes_only(state, health, maintenance, reachable, start):
    node = NodeSnapshot(id="n1", state=state, health=health, maintenance=maintenance, agent_reachable=reachable)
    assert plan_node(node, now=NOW, heartbeat_timeout=timedelta(seconds=90)).start == start
