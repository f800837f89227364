"""Issue 40: enrollment records where a node takes SSH (its address on the tenants' network, its
sshd port, 22 unless named); a re-enrollment moves it; the allocation's tenant is shown it only
while the node is active in that allocation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpucloud.db import migrate, session_scope
from gpucloud.models.node_states import NodeState
from gpucloud.models.tables import Node, NodeEnroll
from gpucloud.services.node_access import ssh_endpoint
from gpucloud.services.nodes import enroll_nodes

pytestmark = [pytest.mark.unit, pytest.mark.one_database]


def _enroll(**fields) -> NodeEnroll:
    base = {
        "id": "gpu-1",
        "hostname": "gpu-1.internal",
        "region": "us-east-1",
        "pod": "pod0",
        "rack": "rack0",
        "gpu_type": "H100",
        "gpu_count": 8,
        "agent_url": "https://gpu-1.internal:8200",
    }
    return NodeEnroll.model_validate({**base, **fields})


def test_enrollment_records_the_endpoint_and_a_re_enrollment_moves_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    migrate(url)
    with session_scope(url) as session:
        enroll_nodes(session, [_enroll(ssh_host="10.20.0.11")])
    with session_scope(url) as session:
        node = session.get(Node, "gpu-1")
        assert (node.ssh_host, node.ssh_port) == ("10.20.0.11", 22)
    with session_scope(url) as session:
        assert enroll_nodes(session, [_enroll(ssh_host="127.0.0.1", ssh_port=40022)]) == ([], ["gpu-1"])
    with session_scope(url) as session:
        node = session.get(Node, "gpu-1")
        assert (node.ssh_host, node.ssh_port) == ("127.0.0.1", 40022)


@pytest.mark.parametrize(
    "fields", [{"ssh_host": "10.0.0.1; rm -rf /"}, {"ssh_host": "-oProxyCommand=x"}, {"ssh_port": 0}]
)
def test_an_endpoint_that_is_not_an_address_and_port_is_refused(fields):
    with pytest.raises(ValidationError):
        _enroll(**fields)


def test_the_tenant_sees_the_endpoint_only_while_the_node_is_active_in_its_allocation():
    node = Node(**_enroll(ssh_host="10.20.0.11", ssh_port=2222).model_dump())
    node.allocation_id, node.state = "alloc-1", NodeState.ACTIVE.value
    shown = ssh_endpoint(node, allocation_id="alloc-1", user="ubuntu")
    assert shown is not None and shown.command == "ssh -p 2222 ubuntu@10.20.0.11"
    assert ssh_endpoint(node, allocation_id="alloc-2", user="ubuntu") is None
    node.state = NodeState.RELEASING.value
    assert ssh_endpoint(node, allocation_id="alloc-1", user="ubuntu") is None
    node.state, node.ssh_host = NodeState.ACTIVE.value, None
    assert ssh_endpoint(node, allocation_id="alloc-1", user="ubuntu") is None
