"""The demo's tenancy part: onboarding through its workflow, two tenants side by side (each its
own VNI, storage prefix and quota), a quota refusal, a foreign id answered 404, a key rotated,
and the second tenant offboarded. Public API only, operator and tenant keys."""

from __future__ import annotations

import time
import uuid

import httpx
from rich.console import Console
from rich.table import Table


class TenantsDemoError(RuntimeError):
    pass


def _call(http: httpx.Client, method: str, path: str, *, expect: tuple[int, ...] = (200,), **kw) -> dict:
    resp = http.request(method, path, **kw)
    if resp.status_code not in expect:
        raise TenantsDemoError(f"{method} {path} -> HTTP {resp.status_code}: {resp.text[:400]}")
    return resp.json()


def wait_operation(op: httpx.Client, operation_id: str, *, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        operation = _call(op, "GET", f"/v1/operations/{operation_id}")
        if operation["status"] == "succeeded":
            return operation
        if operation["status"] == "failed":
            raise TenantsDemoError(f"operation {operation_id} failed: {operation.get('error')}")
        time.sleep(0.3)
    raise TenantsDemoError(f"operation {operation_id} did not finish in {timeout_s:.0f}s")


def onboard(
    console: Console, api_url: str, operator_token: str, name: str, *, quotas: list[dict] | None = None
) -> tuple[dict, str]:
    """Onboard a tenant through its workflow; (the tenant as it reads once active, its first key)."""
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {operator_token}"}, timeout=30) as op:
        accepted = _call(
            op,
            "POST",
            "/v1/tenants",
            expect=(202,),
            json={"name": f"{name}-{uuid.uuid4().hex[:6]}", **({"quotas": quotas} if quotas else {})},
        )
        with console.status(f"onboarding {accepted['name']}: VNI, storage, data key"):
            wait_operation(op, accepted["operation"]["id"])
        tenant = _call(op, "GET", f"/v1/tenants/{accepted['id']}")
    if tenant["status"] != "active":
        raise TenantsDemoError(f"tenant {tenant['id']} is {tenant['status']} after onboarding")
    return tenant, accepted["api_key"]["key"]


def demo_tenants(
    console: Console, api_url: str, operator_token: str, acme: dict, acme_key: str, acme_allocation: str
) -> None:
    """A second tenant beside acme: isolated, held to its quota, then offboarded."""
    one_node = [{"gpu_type": "H100", "region": "us-east-1", "max_gpus": 8}]
    globex, globex_key = onboard(console, api_url, operator_token, "globex", quotas=one_node)
    op = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {operator_token}"}, timeout=30)
    tenant_b = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {globex_key}"}, timeout=30)
    with op, tenant_b:
        table = Table(title="two tenants, side by side")
        for col in ("tenant", "status", "VNI", "storage prefix", "H100 quota (GPUs)"):
            table.add_column(col)
        for t in (acme, globex):
            report = _call(op, "GET", f"/v1/tenants/{t['id']}/quotas")
            # The most specific rule wins: H100 in us-east-1 over `*`.
            rules = sorted(report["quotas"], key=lambda q: (q["gpu_type"] == "*", q["region"] == "*"))
            h100 = next(
                (q["max_gpus"] for q in rules if q["gpu_type"] in ("H100", "*") and q["region"] in ("us-east-1", "*")),
                report["default_gpus"],
            )
            table.add_row(t["name"], t["status"], str(t["vni"]), t["storage_prefix"] or "", str(h100))
        console.print(table)
        if acme["vni"] == globex["vni"] or acme["storage_prefix"] == globex["storage_prefix"]:
            raise TenantsDemoError("two tenants share a VNI or a storage prefix")

        body = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}
        first = _call(tenant_b, "POST", "/v1/allocations", json=body, expect=(202,))
        refused = tenant_b.post("/v1/allocations", json=body)
        if refused.status_code != 409:
            raise TenantsDemoError(f"a second node over globex's quota answered {refused.status_code}")
        console.print(f"globex's second node refused: [yellow]{refused.json()['detail']}[/]")
        foreign = tenant_b.get(f"/v1/allocations/{acme_allocation}")
        if foreign.status_code != 404:
            raise TenantsDemoError(f"globex read acme's allocation: HTTP {foreign.status_code}")
        console.print(f"globex asks for acme's allocation {acme_allocation}: HTTP 404 (as if it did not exist)")

        rotated = _call(
            tenant_b,
            "POST",
            f"/v1/api-keys/{globex_key.split('.')[0].removeprefix('gpc_')}/rotate",
            json={"grace_period_s": 0},
            expect=(201,),
        )
        old = tenant_b.get("/v1/allocations")
        tenant_b.headers["Authorization"] = f"Bearer {rotated['key']}"
        if old.status_code != 401 or tenant_b.get("/v1/allocations").status_code != 200:
            raise TenantsDemoError("key rotation did not replace the old key")
        console.print(f"globex rotated its key: {rotated['replaces']} -> {rotated['id']} (the old one answers 401)")

        _call(tenant_b, "POST", f"/v1/allocations/{first['allocation']['id']}/cancel", expect=(202,))
        gone = _call(op, "DELETE", f"/v1/tenants/{globex['id']}", expect=(202,))
        with console.status("offboarding globex: allocations cancelled, nodes wiped, keys revoked"):
            wait_operation(op, gone["operation"]["id"], timeout_s=180)
        after = _call(op, "GET", f"/v1/tenants/{globex['id']}")
        if tenant_b.get("/v1/allocations").status_code != 401:
            raise TenantsDemoError("an offboarded tenant's key still works")
        console.print(f"globex offboarded: status {after['status']}, its keys revoked, its node wiped")
