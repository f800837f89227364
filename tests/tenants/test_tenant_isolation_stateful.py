"""Random sequences of onboard / allocate / cancel / node failure and repair / offboard through the
real stack (API, Temporal, worker, simulated fleet and fabric managers, local object store).

After every step, no path connects two tenants:
- fabric: no partition or VPC holds two tenants' nodes (the isolation checker over the managers);
  each VNI is one tenant's, in the DB and on the SDN controller, and only a live tenant has one;
- storage: each tenant's objects sit under its own prefix, its sealed record opens with its own
  data key and with no other tenant's; a failed or purged tenant has no data key left;
- API: a tenant's key lists only its own resources, gets 404 for another's ids, and an offboarded
  tenant's key opens nothing;
- compute: in every node's transition history, a node provisioned for a tenant other than the
  one whose data it last held was wiped in between.

The machine runs on a thread, so that the worker keeps running on the test's event loop. What a
rule acts on comes from the live system (which nodes are active, which allocations still open),
so each rule draws a fixed number of choices and maps them onto what is there: Hypothesis then
sees the same draws whatever the system's timing did. No shrinking: a replay would not meet the
same system state; the failing step sequence is printed instead.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict

import httpx
import pytest
from cryptography.exceptions import InvalidTag
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from sqlmodel import select

from gpucloud.activities.storage import TENANT_RECORD
from gpucloud.bootstrap import tenant_store
from gpucloud.db import session_scope
from gpucloud.fabric.interface import FabricNode
from gpucloud.fabric.isolation import find_violations
from gpucloud.models.tables import TERMINAL_ALLOCATION, Allocation, NodeTransition, Tenant
from support.stack import settled_operation, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

NODES = 6
FAST = {
    "latency_scale": 0.02,
    "health__drain_grace_s": 0.2,
    "health__replacement_recheck_s": 0.3,
    "health__breaker_max_pulled_share": 1.0,
    "reconciler__backoff_base_s": 0.2,
    "reconciler__backoff_cap_s": 1.0,
    "tenants__offboarding_poll_s": 0.2,
    "tenants__storage_retention_s": 0.5,
}
LIVE = ("onboarding", "active", "offboarding")
IN_FLIGHT = ("reserved", "provisioning", "releasing", "wiping", "draining", "repairing", "burn_in")


class TenantIsolation(RuleBasedStateMachine):
    h = None  # the harness, set by the test
    loop: asyncio.AbstractEventLoop
    temporal = None

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[str, str] = {}  # tenant id -> its API key
        self.offboarded: set[str] = set()
        self.allocations: dict[str, str] = {}  # allocation id -> tenant id
        self.attempts = 0  # allocation requests sent (some were refused)
        self.store = tenant_store(self.h.settings)

    # ------------------------------------------------------------ helpers

    def _api(self, key: str | None = None) -> httpx.Client:
        return self.h.client(key) if key else self.h.operator

    @staticmethod
    def _pick(items: list[str], choice: int) -> str | None:
        return items[choice % len(items)] if items else None

    def _active(self) -> list[str]:
        return sorted(t for t in self.keys if t not in self.offboarded)

    def _open(self) -> list[str]:
        with session_scope(self.h.settings.database_url) as session:
            rows = session.exec(
                select(Allocation.id).where(
                    Allocation.id.in_(list(self.allocations)),
                    Allocation.status.not_in([s.value for s in TERMINAL_ALLOCATION]),
                )
            ).all()
        return sorted(rows)

    def _nodes(self) -> list[dict]:
        return self.h.nodes()

    def _wait_operation(self, op_id: str, timeout_s: float = 60) -> dict:
        with self._api() as op:
            final = wait_until(
                lambda: settled_operation(op, op_id),
                timeout_s=timeout_s,
                interval_s=0.05,
                what=f"operation {op_id}",
            )
        assert final["status"] == "succeeded", final
        return final

    # ------------------------------------------------------------ rules

    @precondition(lambda self: len(self._active()) < 3)
    @rule()
    def onboard(self) -> None:
        with self._api() as op:
            resp = op.post(
                "/v1/tenants",
                json={
                    "name": f"iso-{uuid.uuid4().hex[:8]}",
                    "quotas": [{"gpu_type": "H100", "region": "*", "max_gpus": 24}],
                },
            )
        assert resp.status_code == 202, resp.text
        self._wait_operation(resp.json()["operation"]["id"])
        self.keys[resp.json()["id"]] = resp.json()["api_key"]["key"]

    @precondition(lambda self: self._active())
    @rule(choice=st.integers(0, 1 << 16), count=st.integers(1, 2))
    def allocate(self, choice: int, count: int) -> None:
        tenant = self._pick(self._active(), choice)
        self.attempts += 1
        with self._api(self.keys[tenant]) as c:
            resp = c.post("/v1/allocations", json={"gpu_type": "H100", "node_count": count, "region": "us-east-1"})
        assert resp.status_code in (202, 409), resp.text  # 409: no capacity, or over the quota
        event(f"allocate: {resp.status_code} {resp.json().get('type', '').rsplit('/', 1)[-1]}")
        if resp.status_code == 202:
            self.allocations[resp.json()["allocation"]["id"]] = tenant

    @precondition(lambda self: self.attempts)
    @rule(choice=st.integers(0, 1 << 16))
    def cancel(self, choice: int) -> None:
        alloc = self._pick(self._open(), choice)
        if alloc is None:
            return
        tenant = self.allocations[alloc]
        if tenant in self.offboarded:
            return
        with self._api(self.keys[tenant]) as c:
            assert c.post(f"/v1/allocations/{alloc}/cancel").status_code in (200, 202)
        event("cancel")

    @precondition(lambda self: self.attempts)
    @rule(choice=st.integers(0, 1 << 16))
    def fail_a_node(self, choice: int) -> None:
        """A node of a ready allocation falls off the bus: drained now, replaced in its pod."""
        node = self._pick(
            sorted(n["id"] for n in self._nodes() if n["state"] == "active" and n["allocation_id"]), choice
        )
        if node is None:
            return
        with self._api() as op:
            assert op.post(f"/v1/nodes/{node}/xid", json={"xid": 79, "gpu_index": 0}).status_code == 200
        event("node failed")

    @precondition(lambda self: self.attempts)
    @rule()
    def repair(self) -> None:
        """The reconciler repairs quarantined nodes; a repair wipes the node before burn-in. A
        node that failed twice goes to RMA instead (and stays out of the fleet)."""
        if not any(n["state"] in ("draining", "quarantined") for n in self._nodes()):
            return

        def repaired() -> bool:
            states = {n["state"] for n in self._nodes()}
            if "quarantined" in states:  # sweep again for a node that was still draining
                asyncio.run_coroutine_threadsafe(self.h.sweep(self.temporal), self.loop).result(60)
            return not states & {"draining", "quarantined", "repairing"}

        wait_until(repaired, timeout_s=60, interval_s=0.5, what="repaired")
        event("nodes repaired")

    @precondition(lambda self: self._active())
    @rule(choice=st.integers(0, 1 << 16))
    def offboard(self, choice: int) -> None:
        tenant = self._pick(self._active(), choice)
        with self._api() as op:
            resp = op.delete(f"/v1/tenants/{tenant}")
        assert resp.status_code == 202, resp.text
        self._wait_operation(resp.json()["operation"]["id"], timeout_s=90)
        self.offboarded.add(tenant)
        event("offboard")

    # ------------------------------------------------------------ invariants

    @invariant()
    def vnis_belong_to_one_live_tenant(self) -> None:
        with session_scope(self.h.settings.database_url) as session:
            tenants = {t.id: t for t in session.exec(select(Tenant)).all()}
        held = [t.vni for t in tenants.values() if t.vni is not None]
        assert len(held) == len(set(held)), f"a VNI is recorded for two tenants: {held}"
        assert all(t.status in LIVE for t in tenants.values() if t.vni is not None)
        vpcs = self.h.fabric.snapshot().vpcs
        owners = [v.tenant_id for v in vpcs]
        assert len(owners) == len(set(owners)), f"a tenant has two VPCs: {vpcs}"
        for vpc in vpcs:
            tenant = tenants.get(vpc.tenant_id)
            assert tenant is not None and tenant.status in LIVE, f"VPC {vpc.vni} of a gone tenant {vpc.tenant_id}"
            if tenant.status == "active":
                assert tenant.vni == vpc.vni
        for tenant_id in self.offboarded:
            assert tenants[tenant_id].vni is None

    @invariant()
    def storage_opens_for_its_own_tenant_only(self) -> None:
        with session_scope(self.h.settings.database_url) as session:
            status = dict(session.exec(select(Tenant.id, Tenant.status)).all())
            prefixes = [p for p in session.exec(select(Tenant.storage_prefix)).all() if p is not None]
        assert len(prefixes) == len(set(prefixes))
        for key in self.store.backend.list_keys("tenants/"):
            owner = key.split("/")[1]
            assert status.get(owner) in (*LIVE, "offboarded"), f"object {key} of no live tenant"
        keyed = set(self.store.keys.tenants())
        assert all(status.get(t) in (*LIVE, "offboarded") for t in keyed)
        sealed = {t: self.store.backend.get(f"tenants/{t}/{TENANT_RECORD}") for t in keyed if status.get(t) == "active"}
        for owner, blob in sealed.items():
            context = f"tenants/{owner}/{TENANT_RECORD}"
            assert self.store.keys.decrypt(owner, blob, context=context)
            for other in sealed:
                if other != owner:
                    with pytest.raises(InvalidTag):
                        self.store.keys.decrypt(other, blob, context=context)

    @invariant()
    def keys_reach_their_own_tenant_only(self) -> None:
        mine: dict[str, set[str]] = defaultdict(set)
        for alloc, tenant in self.allocations.items():
            mine[tenant].add(alloc)
        for tenant, key in self.keys.items():
            with self._api(key) as c:
                if tenant in self.offboarded:
                    assert c.get("/v1/allocations").status_code == 401
                    continue
                listed = c.get("/v1/allocations", params={"page_size": 1000}).json()["items"]
                assert {a["tenant_id"] for a in listed} <= {tenant}
                assert {a["id"] for a in listed} == mine[tenant]
                assert {k["tenant_id"] for k in c.get("/v1/api-keys").json()["items"]} == {tenant}
                for other in self.keys:
                    if other == tenant:
                        continue
                    assert c.get(f"/v1/tenants/{other}").status_code == 404
                    for alloc in sorted(mine[other])[:2]:
                        assert c.get(f"/v1/allocations/{alloc}").status_code == 404

    @invariant()
    def nodes_are_wiped_between_tenants(self) -> None:
        with session_scope(self.h.settings.database_url) as session:
            tenant_of_alloc = dict(session.exec(select(Allocation.id, Allocation.tenant_id)).all())
            history = session.exec(select(NodeTransition).order_by(NodeTransition.seq)).all()
        reserved_for: dict[str, str | None] = {}
        holds: dict[str, str | None] = {}  # node -> whose data is on its disks
        for t in history:
            if t.event == "reserve" and t.op_id:
                reserved_for[t.node_id] = tenant_of_alloc.get(t.op_id.split("-", 1)[1])
            elif t.to_state == "provisioning":
                tenant = reserved_for.get(t.node_id)
                previous = holds.get(t.node_id)
                assert previous in (None, tenant), (
                    f"node {t.node_id} provisioned for {tenant} while holding {previous}'s data (seq {t.seq})"
                )
                holds[t.node_id] = tenant
            elif t.from_state in ("wiping", "repairing") and t.event == "ok":
                holds[t.node_id] = None

    @invariant()
    def no_fabric_path_between_tenants(self) -> None:
        def tenant_of() -> dict[str, str]:
            """Who holds each node: the tenant whose data is on it, else the tenant of the
            allocation it is reserved for (membership is applied before provisioning)."""
            with session_scope(self.h.settings.database_url) as session:
                owner = dict(session.exec(select(Allocation.id, Allocation.tenant_id)).all())
            return {
                n["id"]: n["tenant_id"] or owner.get(n["allocation_id"])
                for n in self._nodes()
                if n["tenant_id"] or n["allocation_id"]
            }

        before = tenant_of()
        snapshot = self.h.fabric.snapshot()
        after = tenant_of()
        topology = {
            n["id"]: FabricNode(
                node_id=n["id"],
                port_guids=tuple(n["ib_port_guids"]),
                nvl_domain=n.get("nvlink_domain"),
                gpu_uids=tuple(n.get("gpu_uids") or ()),
            )
            for n in self._nodes()
        }
        # Membership is applied after a node's data becomes a tenant's and removed before its
        # wipe; a node changing hands between the two reads could look unassigned in one of
        # them: a real path shows in both.
        found = [set(find_violations(snapshot, topology=topology, tenant_of=held)) for held in (before, after)]
        assert not (found[0] & found[1]), found[0] & found[1]

    def teardown(self) -> None:
        """Cancel what is left and let the fleet settle, then nothing of the fabric may remain."""
        for alloc in self._open():
            tenant = self.allocations[alloc]
            with self._api(self.keys[tenant]) as c:
                c.post(f"/v1/allocations/{alloc}/cancel")
        wait_until(lambda: not self._open(), timeout_s=90, interval_s=0.2, what="allocations released")
        wait_until(
            lambda: not any(n["state"] in IN_FLIGHT for n in self._nodes()),
            timeout_s=90,
            interval_s=0.2,
            what="nodes settled",
        )
        snapshot = self.h.fabric.snapshot()
        assert [p.pkey for p in snapshot.pkeys if p.name != "default"] == []
        assert snapshot.nvl_partitions == ()
        assert all(v.nodes == () for v in snapshot.vpcs)


@pytest.mark.long
async def test_no_path_connects_two_tenants_across_random_operations(ready_fleet, temporal_env):
    h = await ready_fleet(nodes=NODES, fabric=True, **FAST)
    machine = type(
        "BoundTenantIsolation",
        (TenantIsolation,),
        {"h": h, "loop": asyncio.get_running_loop(), "temporal": temporal_env.client},
    )
    await asyncio.to_thread(
        run_state_machine_as_test,
        machine,
        settings=settings(
            max_examples=3,
            stateful_step_count=12,
            deadline=None,
            database=None,
            phases=(Phase.generate,),
            suppress_health_check=list(HealthCheck),
        ),
    )
