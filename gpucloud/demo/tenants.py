"""The demo's tenancy part: onboarding through its workflow, two tenants side by side (each its
own VNI, storage prefix and quota), a quota refusal, a foreign id answered 404, a key rotated,
and the second tenant offboarded. Public API only, operator and tenant keys."""

from __future__ import annotations

import uuid

from rich.table import Table

from gpucloud.client.api import Quotas
from gpucloud.demo.common import Demo, DemoFailed, refused
from gpucloud.models.tables import TenantPublic


def _finished(demo: Demo, operation_id: str, *, timeout_s: float = 120) -> None:
    operation = demo.operator.operations.wait(operation_id, timeout_s=timeout_s)
    if operation.status != "succeeded":
        raise DemoFailed(f"operation {operation_id} {operation.status}: {operation.error}")


def onboard(demo: Demo, name: str, *, quotas: Quotas | None = None) -> tuple[TenantPublic, str]:
    """Onboard a tenant through its workflow; (the tenant as it reads once active, its first key)."""
    accepted = demo.operator.tenants.create(f"{name}-{uuid.uuid4().hex[:6]}", quotas=quotas)
    with demo.console.status(f"onboarding {accepted.name}: VNI, storage, data key"):
        _finished(demo, accepted.operation.id)
    tenant = demo.operator.tenants.get(accepted.id)
    if tenant.status != "active" or accepted.api_key.key is None:
        raise DemoFailed(f"tenant {tenant.id} is {tenant.status} after onboarding")
    return tenant, accepted.api_key.key


def fleet_quota(nodes: int) -> Quotas:
    """A quota for the whole simulated fleet (H100 nodes of 8 in us-east-1): tenants hold only
    what an operator grants, so the demo grants it explicitly."""
    return [{"gpu_type": "H100", "region": "us-east-1", "max_gpus": nodes * 8}]


def _h100_quota(demo: Demo, tenant: TenantPublic) -> int:
    report = demo.operator.tenants.quotas(tenant.id)
    # The most specific rule wins: H100 in us-east-1 over `*`; none matching: none granted.
    rules = sorted(report.quotas, key=lambda q: (q.gpu_type == "*", q.region == "*"))
    matching = (q.max_gpus for q in rules if q.gpu_type in ("H100", "*") and q.region in ("us-east-1", "*"))
    return next(matching, 0)


def demo_tenants(demo: Demo, acme: TenantPublic, acme_allocation: str) -> None:
    """A second tenant beside acme: isolated, held to its quota, then offboarded."""
    one_node = [{"gpu_type": "H100", "region": "us-east-1", "max_gpus": 8}]
    globex, globex_key = onboard(demo, "globex", quotas=one_node)
    table = Table(title="two tenants, side by side")
    for column in ("tenant", "status", "VNI", "storage prefix", "H100 quota (GPUs)"):
        table.add_column(column)
    for t in (acme, globex):
        table.add_row(t.name, t.status, str(t.vni), t.storage_prefix or "", str(_h100_quota(demo, t)))
    demo.console.print(table)
    if acme.vni == globex.vni or acme.storage_prefix == globex.storage_prefix:
        raise DemoFailed("two tenants share a VNI or a storage prefix")

    tenant_b = demo.tenant(globex_key)
    first = tenant_b.allocations.create("H100", "us-east-1", 1)
    over = refused(409, lambda: tenant_b.allocations.create("H100", "us-east-1", 1), "a node over globex's quota")
    demo.console.print(f"globex's second node refused: [yellow]{over.detail}[/]")
    offered = ", ".join(
        f"{i.gpu_type} in {i.region}: {i.available_nodes} of {i.nodes} free" for i in tenant_b.catalog().items
    )
    demo.console.print(f"globex reads the catalog: {offered}")
    absent = refused(422, lambda: tenant_b.allocations.create("b200", "us-east-1", 1), "a GPU type the fleet lacks")
    demo.console.print(f"globex asks for B200: [yellow]{absent.detail}[/]")
    refused(404, lambda: tenant_b.allocations.get(acme_allocation), "globex reading acme's allocation")
    demo.console.print(f"globex asks for acme's allocation {acme_allocation}: HTTP 404 (as if it did not exist)")

    rotated = tenant_b.api_keys.rotate(globex_key.split(".")[0].removeprefix("gpc_"))
    refused(401, lambda: next(tenant_b.allocations.list(), None), "globex's replaced key")
    if rotated.key is None:
        raise DemoFailed("a rotated key came back without its secret")
    tenant_b = demo.tenant(rotated.key)
    list(tenant_b.allocations.list())
    demo.console.print(f"globex rotated its key: {rotated.replaces} -> {rotated.id} (the old one answers 401)")

    tenant_b.allocations.cancel(first.allocation.id)
    gone = demo.operator.tenants.offboard(globex.id)
    with demo.console.status("offboarding globex: allocations cancelled, nodes wiped, keys revoked"):
        _finished(demo, gone.operation.id, timeout_s=180)
    after = demo.operator.tenants.get(globex.id)
    refused(401, lambda: next(tenant_b.allocations.list(), None), "an offboarded tenant's key")
    demo.console.print(f"globex offboarded: status {after.status}, its keys revoked, its node wiped")
