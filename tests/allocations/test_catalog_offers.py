"""Issue 40, "what you may ask for", without a server: GPU types matched in any case, a type or
region the fleet has none of told apart from a shortage, quota refusals in nodes and GPUs, and
no quota granted named with the command that grants one."""

from __future__ import annotations

import pytest
from sqlmodel import select

from gpucloud.api.schemas import AllocationRequest, QuotaRequest
from gpucloud.db import migrate, session_scope
from gpucloud.models.catalog import known_gpu_type
from gpucloud.models.tables import Node, NodeEnroll, TenantQuotaBase
from gpucloud.services.catalog import NotOffered, Offer, check_offered, fleet_offers, require_offered
from gpucloud.services.quotas import Limit, NoQuotaGranted, QuotaExceeded, nodes_and_gpus
from support.nodes import enroll

pytestmark = pytest.mark.unit

FLEET = [Offer("GB200", "us-east-1", 18, 18), Offer("H100", "us-east-1", 16, 4), Offer("H100", "eu-west-1", 8, 0)]


@pytest.mark.parametrize("spelling", ["h100", "H100", "  h100 "])
def test_gpu_types_match_in_any_case(spelling):
    """Before: `h100` was an unknown GPU type (422) on create and in quotas."""
    assert known_gpu_type(spelling) == "H100"
    assert AllocationRequest(gpu_type=spelling, node_count=1, region="us-east-1").gpu_type == "H100"
    assert QuotaRequest(gpu_type=spelling, region="*", max_gpus=8).gpu_type == "H100"
    assert AllocationRequest(gpu_type="gb200", nvl72_trays=2, region="r1").node_count == 2
    node = {"id": "n", "hostname": "n", "region": "r1", "pod": "p", "rack": "r", "gpu_count": 8, "agent_url": "x"}
    assert NodeEnroll(**node, gpu_type=spelling).gpu_type == "H100"  # enrolled as the catalogue spells it


def test_a_gpu_type_nobody_sells_is_still_unknown():
    assert known_gpu_type("H9000") is None
    with pytest.raises(ValueError, match="unknown GPU type 'H9000'"):
        AllocationRequest(gpu_type="H9000", node_count=1, region="us-east-1")


def test_a_type_the_fleet_has_none_of_says_so_and_lists_what_it_offers():
    """Before: B200 was accepted as valid and then refused as "try fewer nodes or later"."""
    with pytest.raises(NotOffered) as refused:
        check_offered(FLEET, gpu_type="B200", region="us-east-1")
    assert refused.value.field == "gpu_type"
    assert "the fleet has no B200 nodes" in refused.value.message
    assert "GB200 in us-east-1" in refused.value.message and "H100 in eu-west-1, us-east-1" in refused.value.message
    assert "later" not in refused.value.message


def test_a_type_offered_elsewhere_names_where():
    with pytest.raises(NotOffered) as refused:
        check_offered(FLEET, gpu_type="GB200", region="eu-west-1")
    assert refused.value.field == "gpu_type"
    assert refused.value.message == "the fleet has no GB200 nodes in eu-west-1; GB200 is on offer in us-east-1"


def test_an_unknown_region_lists_the_regions_on_offer():
    with pytest.raises(NotOffered) as refused:
        check_offered(FLEET, gpu_type="H100", region="ap-south-1")
    assert refused.value.field == "region"
    assert refused.value.message == "unknown region 'ap-south-1'; regions on offer: eu-west-1, us-east-1"


def test_a_pool_the_fleet_has_passes_even_with_nothing_free():
    """A shortage (no H100 free in eu-west-1) is for placement to answer, not a type not offered."""
    check_offered(FLEET, gpu_type="H100", region="eu-west-1")


def test_a_quota_refusal_says_nodes_and_gpus():
    """Before: "quota ... is 24; 16 in use, 16 requested": GPUs only, to a tenant that asked in nodes."""
    limit = Limit("H100", "us-east-1", 24)
    refused = QuotaExceeded(
        limit, gpu_type="H100", region="us-east-1", usage_gpus=16, requested_gpus=16, gpus_per_node=8
    )
    assert str(refused).startswith("2 nodes (16 GPUs) of H100 requested in us-east-1; the quota (H100/us-east-1) is 24")
    assert "2 nodes (16 GPUs) in use, 1 node (8 GPUs) left" in str(refused)
    assert refused.left_gpus == 8
    assert nodes_and_gpus(4, 4) == "1 node (4 GPUs)"


def test_no_quota_granted_names_the_command_that_grants_one():
    granted = [TenantQuotaBase(gpu_type="H100", region="us-east-1", max_gpus=64)]
    refused = NoQuotaGranted("ten_1", gpu_type="H100", region="eu-west-1", granted=granted)
    assert "no quota is granted for H100 in eu-west-1" in str(refused)
    assert "granted: H100/us-east-1: 64 GPUs" in str(refused)
    assert "`gpucloud tenants quota ten_1 H100:eu-west-1=GPUS`" in str(refused)


def test_the_fleet_offers_what_it_holds_and_counts_only_takeable_nodes_as_available(tmp_path):
    """Retired and RMA'd nodes are out of the fleet; cordoned, unhealthy or busy ones are in it
    but not available now."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    migrate(url)
    enroll(url, [f"n{i}" for i in range(7)], region="us-east-1")
    enroll(url, ["g0"], region="eu-west-1", gpu_type="GB200", gpu_count=4)
    states = {"n0": "available", "n1": "available", "n2": "available", "n3": "active", "n4": "retired", "n5": "rma"}
    with session_scope(url) as session:
        for node in session.exec(select(Node)).all():
            node.state = states.get(node.id, node.state)
            node.cordoned = node.id == "n1"
            node.health = "suspect" if node.id == "n2" else "ok"
            session.add(node)
    with session_scope(url) as session:
        offered = fleet_offers(session)
        assert offered == [Offer("GB200", "eu-west-1", 1, 0), Offer("H100", "us-east-1", 5, 1)]
        assert [o.gpus_per_node for o in offered] == [4, 8]
        assert fleet_offers(session, gpu_type="H100", region="eu-west-1") == []
        require_offered(session, gpu_type="H100", region="us-east-1")
        with pytest.raises(NotOffered, match="the fleet has no B200 nodes; on offer: GB200 in eu-west-1; H100 in"):
            require_offered(session, gpu_type="B200", region="us-east-1")


def test_the_old_default_quota_setting_is_refused_saying_what_to_do(monkeypatch, tmp_path):
    """A deployment that still sets it expects every tenant to get that quota: ignoring it would
    refuse its tenants' allocations with no word why."""
    from pydantic import ValidationError

    from gpucloud.config import Settings

    monkeypatch.setenv("GPUCLOUD_TENANTS__DEFAULT_GPU_QUOTA", "8192")
    with pytest.raises(ValidationError, match="no longer read: tenants hold only the quotas granted"):
        Settings(data_dir=tmp_path)
    monkeypatch.delenv("GPUCLOUD_TENANTS__DEFAULT_GPU_QUOTA")
    assert "default_gpu_quota" not in Settings(data_dir=tmp_path).tenants.model_dump()
