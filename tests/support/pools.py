"""A pool seeded straight into a control-plane database: H100 nodes `available` in region r1,
`pods` fabric domains of `per_pod` nodes (racks of `rack_size`), and active tenants `ten_0`..
each granted `max_gpus` of H100 there (admission refuses a tenant that is not active, and a
tenant holds only what is granted)."""

from __future__ import annotations

from sqlmodel import select

from gpucloud.db import session_scope
from gpucloud.models.tables import Node, NodeEnroll, Tenant, TenantQuota, TenantStatus
from gpucloud.services import nodes as node_service


def seed_pool(
    db_url: str, *, pods: int, per_pod: int, tenants: int, max_gpus: int, rack_size: int | None = None
) -> None:
    rack_size = rack_size or per_pod
    with session_scope(db_url) as session:
        node_service.enroll_nodes(
            session,
            [
                NodeEnroll(
                    id=f"n-{p}-{i:02d}",
                    hostname=f"h{p}{i}",
                    region="r1",
                    pod=f"pod{p}",
                    rack=f"pod{p}-r{i // rack_size}",
                    gpu_type="H100",
                    gpu_count=8,
                    agent_url="http://unused",
                )
                for p in range(pods)
                for i in range(per_pod)
            ],
        )
        for node in session.exec(select(Node)).all():
            node.state = "available"
            session.add(node)
        for t in range(tenants):
            session.add(Tenant(id=f"ten_{t}", name=f"tenant-{t}", status=TenantStatus.ACTIVE))
            session.add(TenantQuota(tenant_id=f"ten_{t}", gpu_type="H100", region="r1", max_gpus=max_gpus))
