"""Tenant onboarding and offboarding through the real stack (API over HTTP, Temporal, the worker,
the simulated fabric managers, the local object store): a tenant ends whole (`active`: VNI,
storage, key) or, with a step failing at any point, `failed` with every step undone; the first
key's secret is shown once; offboarding cancels, waits for wipes, revokes, releases and deletes.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from gpucloud.activities.faults import FaultPoint
from gpucloud.activities.storage import TENANT_RECORD
from gpucloud.bootstrap import tenant_store
from gpucloud.models.workflow_ids import offboarding_workflow_id, onboarding_workflow_id
from gpucloud.storage import retention
from gpucloud.storage.envelope import UnknownTenantKeyError
from support.histories import record, replayer
from support.stack import async_wait_until, settled_operation

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

ALLOC = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}


async def replays(temporal, workflow_id: str, *, record_as: str) -> None:
    """The workflow's history replays against the current code; GPUCLOUD_RECORD_HISTORIES=1 keeps
    it in tests/histories, where test_replay replays it on every run."""
    handle = temporal.get_workflow_handle(workflow_id)
    await handle.result()
    history = await handle.fetch_history()
    await replayer(temporal).replay_workflow(history)
    if os.environ.get("GPUCLOUD_RECORD_HISTORIES"):
        record(temporal, history, record_as)


@dataclass
class _Rule:
    remaining: int
    permanent: bool
    delay_s: float = 0.0


class Faults:
    """Fail tenant steps on demand: `arm(step, phase, times=, permanent=)`, or hold them up for
    `delay_s`; any tenant."""

    def __init__(self) -> None:
        self._rules: dict[tuple[str, str], _Rule] = {}
        self._lock = threading.Lock()
        self.hits: list[FaultPoint] = []

    def arm(self, step: str, phase: str, *, times: int = 1, permanent: bool = True, delay_s: float = 0.0) -> None:
        with self._lock:
            self._rules[(step, phase)] = _Rule(times, permanent, delay_s)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.hits.clear()

    def __call__(self, point: FaultPoint) -> None:
        with self._lock:
            rule = self._rules.get((point.step, point.phase))
            if rule is None or rule.remaining <= 0:
                return
            rule.remaining -= 1
            self.hits.append(point)
        if rule.delay_s:
            time.sleep(rule.delay_s)
            return
        if rule.permanent:
            raise ApplicationError(
                f"injected failure {point.phase} {point.step}", type="InjectedFault", non_retryable=True
            )
        raise RuntimeError(f"injected transient failure {point.phase} {point.step}")


@pytest.fixture
async def stack(db_url, make_harness, in_process_worker):
    """API, worker (with fault injection) and simulated fabric managers; no nodes needed."""
    h = make_harness(db_url, nodes=1, fabric=True)
    faults = Faults()
    await in_process_worker(h.settings, fault_hook=faults)
    return h, faults


def _sqlite(db_url: str) -> bool:
    return db_url.startswith("sqlite")


def _create(h, name: str | None = None, **body):
    with h.operator as op:
        return op.post("/v1/tenants", json={"name": name or f"t-{uuid.uuid4().hex[:8]}", **body})


async def _onboarded(h, **body) -> dict:
    """Create a tenant and wait for its onboarding to end; the 202 body, with the final operation."""
    resp = _create(h, **body)
    assert resp.status_code == 202, resp.text
    accepted = resp.json()
    with h.operator as op:
        accepted["final"] = await async_wait_until(
            lambda: settled_operation(op, accepted["operation"]["id"]),
            timeout_s=60,
            interval_s=0.05,
            what="onboarding",
        )
        accepted["tenant"] = op.get(f"/v1/tenants/{accepted['id']}").json()
    return accepted


def assert_whole(h, accepted: dict) -> None:
    tenant = accepted["tenant"]
    assert accepted["final"]["status"] == "succeeded"
    assert tenant["status"] == "active" and tenant["storage_prefix"] == f"tenants/{tenant['id']}/"
    assert h.fabric.vpc_of(tenant["id"]).vni == tenant["vni"]
    store = tenant_store(h.settings)
    assert store.tenant(tenant["id"]).get_encrypted(TENANT_RECORD)
    with h.client(accepted["api_key"]["key"]) as c:
        assert c.get(f"/v1/tenants/{tenant['id']}").json()["status"] == "active"


def assert_undone(h, accepted: dict, step: str) -> None:
    """`failed`, and nothing of the tenant left anywhere: keys, VPC, storage, data key."""
    tenant, tenant_id = accepted["tenant"], accepted["id"]
    assert accepted["final"]["status"] == "failed" and step in accepted["final"]["error"], accepted["final"]
    assert tenant["status"] == "failed" and step in tenant["failure_reason"]
    assert tenant["vni"] is None and tenant["storage_prefix"] is None
    assert h.fabric.vpc_of(tenant_id) is None
    store = tenant_store(h.settings)
    assert store.backend.list_keys(f"tenants/{tenant_id}/") == []
    assert tenant_id not in store.keys.tenants()
    assert retention.deletion_due(store.backend, tenant_id) is None
    with pytest.raises(UnknownTenantKeyError):
        store.keys.encrypt(tenant_id, b"x")
    with h.client(accepted["api_key"]["key"]) as c:
        assert c.get(f"/v1/tenants/{tenant_id}").status_code == 401
        assert c.post("/v1/allocations", json=ALLOC).status_code == 401
    with h.operator as op:
        assert all(k["revoked_at"] for k in op.get(f"/v1/tenants/{tenant_id}/api-keys").json()["items"])
        # A failed tenant gets no new keys.
        assert op.post(f"/v1/tenants/{tenant_id}/api-keys").status_code == 409


# Every forward step, failing before its effect or after it (the effect done, the report lost).
STEP_FAILURES = [
    (step, phase) for step in ("allocate_tenant_vni", "provision_tenant_storage") for phase in ("before", "after")
]


async def test_onboarding_failing_at_any_step_is_undone_completely(stack, temporal_env):
    h, faults = stack
    for step, phase in STEP_FAILURES:
        faults.clear()
        faults.arm(step, phase)
        accepted = await _onboarded(h)
        assert [(p.step, p.phase) for p in faults.hits] == [(step, phase)]
        assert_undone(h, accepted, step)

    # The undo steps fail too, for a while: they are retried until everything is undone.
    faults.clear()
    faults.arm("provision_tenant_storage", "after")
    faults.arm("revoke_tenant_keys", "before", times=1, permanent=False)
    faults.arm("delete_tenant_storage", "after", times=2, permanent=False)
    faults.arm("release_tenant_vni", "before", times=1, permanent=False)
    faults.arm("fail_tenant", "before", times=1, permanent=False)
    accepted = await _onboarded(h)
    assert len(faults.hits) == 6
    assert_undone(h, accepted, "provision_tenant_storage")
    if _sqlite(h.settings.database_url):
        await replays(
            temporal_env.client, onboarding_workflow_id(accepted["id"]), record_as="tenant_onboarding_undone_workflow"
        )

    # Transient failures of the steps themselves, and of activation past the point of no return,
    # are retried: the tenant ends whole.
    faults.clear()
    faults.arm("allocate_tenant_vni", "after", times=1, permanent=False)
    faults.arm("provision_tenant_storage", "before", times=2, permanent=False)
    faults.arm("activate_tenant", "before", times=2, permanent=False)
    accepted = await _onboarded(h)
    assert len(faults.hits) == 5
    assert_whole(h, accepted)
    # Tenants that failed do not keep the VNI space: each live VPC is one tenant's.
    vpcs = h.fabric.snapshot().vpcs
    assert [v.tenant_id for v in vpcs] == [accepted["id"]]


async def test_a_cancelled_onboarding_is_undone_once_the_step_in_flight_has_ended(stack, temporal_env):
    h, faults = stack
    # The storage step is held up before its effect: undoing it while it runs would leave
    # storage behind once it goes on.
    faults.arm("provision_tenant_storage", "before", delay_s=2.0)
    resp = _create(h)
    assert resp.status_code == 202
    tenant_id = resp.json()["id"]
    await async_wait_until(lambda: faults.hits, timeout_s=30, what="the storage step in flight")
    await temporal_env.client.get_workflow_handle(onboarding_workflow_id(tenant_id)).cancel()
    final = await h.wait_operation(resp.json()["operation"]["id"], expect="failed")
    assert "cancelled" in final["error"]
    with h.operator as op:
        tenant = op.get(f"/v1/tenants/{tenant_id}").json()
    assert_undone(h, {**resp.json(), "final": final, "tenant": tenant}, "cancelled")


async def test_first_key_is_shown_once_and_create_is_idempotent(stack):
    h, _ = stack
    idem = {"Idempotency-Key": str(uuid.uuid4())}
    body = {"name": f"acme-{uuid.uuid4().hex[:6]}", "quotas": [{"gpu_type": "H100", "region": "*", "max_gpus": 16}]}
    with h.operator as op:
        first = op.post("/v1/tenants", json=body, headers=idem)
        assert first.status_code == 202 and first.headers["location"] == f"/v1/tenants/{first.json()['id']}"
        accepted = first.json()
        assert accepted["status"] == "onboarding" and accepted["api_key"]["key"].startswith("gpc_")
        # Exactly what the operator granted: no implicit `*/*` row beside it.
        assert [(q["gpu_type"], q["region"], q["max_gpus"]) for q in accepted["quotas"]] == [("H100", "*", 16)]
        # A replay answers what was created, without the secret: it was shown once.
        replay = op.post("/v1/tenants", json=body, headers=idem)
        assert replay.status_code == 202 and replay.headers["idempotent-replayed"] == "true"
        assert replay.json()["api_key"]["key"] is None
        assert {**replay.json(), "api_key": None} == {**accepted, "api_key": None}
        assert replay.json()["api_key"]["id"] == accepted["api_key"]["id"]
        # Concurrent creates with one key: one tenant.
        other = {"Idempotency-Key": str(uuid.uuid4())}
        body2 = {"name": f"globex-{uuid.uuid4().hex[:6]}"}
    async with httpx.AsyncClient(
        base_url=h.api.url,
        timeout=60,
        headers={"Authorization": f"Bearer {h.settings.operator_token}", **other},
    ) as c:
        answers = await asyncio.gather(*(c.post("/v1/tenants", json=body2) for _ in range(6)))
    assert {a.status_code for a in answers} == {202}
    assert len({a.json()["id"] for a in answers}) == 1
    assert sum(a.json()["api_key"]["key"] is not None for a in answers) == 1
    with h.operator as op:
        # Names are taken for good, with or without a key.
        taken = op.post("/v1/tenants", json=body)
        assert taken.status_code == 409 and taken.json()["errors"][0]["field"] == "name"
        assert op.post("/v1/tenants", json={"name": "Bad Name"}).status_code == 422
        bad_quota = op.post(
            "/v1/tenants", json={"name": "q", "quotas": [{"gpu_type": "Z9", "region": "*", "max_gpus": 1}]}
        )
        assert bad_quota.status_code == 422 and "quotas.0.gpu_type" in bad_quota.json()["detail"]
    # The secret was stored hashed only: the database holds no plaintext.
    from gpucloud.db import session_scope
    from gpucloud.models.tables import ApiKey, IdempotencyRecord

    secret = accepted["api_key"]["key"].split(".", 1)[1]
    with session_scope(h.settings.database_url) as session:
        stored = [k.secret_hash for k in session.query(ApiKey).all()]
        stored += [r.response_body or "" for r in session.query(IdempotencyRecord).all()]
    assert not any(secret in s for s in stored)
    await h.wait_operation(accepted["operation"]["id"])


async def test_a_tenant_allocates_only_once_active(stack):
    h, faults = stack
    faults.arm("provision_tenant_storage", "before", times=1, permanent=False)
    resp = _create(h)
    tenant_id, key = resp.json()["id"], resp.json()["api_key"]["key"]
    with h.client(key) as c:
        refused = c.post("/v1/allocations", json=ALLOC)
        if refused.status_code == 409:  # still onboarding (the injected retry takes 0.5 s)
            assert refused.json()["type"].endswith("/tenant-not-active")
            assert refused.json()["tenant_status"] == "onboarding"
    await h.wait_operation(resp.json()["operation"]["id"])
    with h.client(key) as c:
        assert c.get(f"/v1/tenants/{tenant_id}").json()["status"] == "active"


async def test_workflow_engine_refusing_onboarding_keeps_nothing(stack, monkeypatch):
    h, _ = stack
    from gpucloud.services import tenant_requests as router

    async def refuse(*_args, **_kw):
        raise RPCError("unavailable", RPCStatusCode.UNAVAILABLE, b"")

    monkeypatch.setattr(router, "start_tenant_onboarding", refuse)
    name = f"t-{uuid.uuid4().hex[:8]}"
    refused = _create(h, name)
    assert refused.status_code == 503
    with h.operator as op:
        assert all(t["name"] != name for t in op.get("/v1/tenants", params={"page_size": 1000}).json()["items"])
    monkeypatch.undo()
    accepted = await _onboarded(h, name=name)  # the name was not kept either
    assert_whole(h, accepted)


async def test_db_vnis_are_unique_without_fabric_managers(db_url, make_harness, in_process_worker):
    h = make_harness(db_url, nodes=1)
    await in_process_worker(h.settings)
    with h.operator as op:
        created = [op.post("/v1/tenants", json={"name": f"v-{i}-{uuid.uuid4().hex[:4]}"}).json() for i in range(6)]
    for accepted in created:
        await h.wait_operation(accepted["operation"]["id"])
    with h.operator as op:
        vnis = [op.get(f"/v1/tenants/{a['id']}").json()["vni"] for a in created]
    assert None not in vnis and len(set(vnis)) == len(vnis)


async def test_offboarding_cancels_waits_for_wipes_revokes_and_deletes_storage(
    db_url, make_harness, in_process_worker, temporal_env
):
    h = make_harness(
        db_url,
        nodes=4,
        latency_scale=0.02,
        fabric=True,
        tenants__offboarding_poll_s=0.2,
        tenants__storage_retention_s=1.0,
    )
    await in_process_worker(h.settings)
    h.enroll_fleet()
    await h.wait_states({"available": 4})
    tenant_id, key = await h.onboard()
    other_id, other_key = await h.onboard()
    with h.client(key) as c:
        alloc_id = c.post("/v1/allocations", json={**ALLOC, "node_count": 2}).json()["allocation"]["id"]
    await h.wait_allocation(key, alloc_id, "ready")
    with h.client(other_key) as c:
        kept = c.post("/v1/allocations", json=ALLOC).json()["allocation"]["id"]
    store = tenant_store(h.settings)
    store.tenant(tenant_id).put("checkpoints/step-1", b"weights")

    with h.operator as op:
        # A tenant cannot offboard anyone, itself included.
        assert h.client(key).delete(f"/v1/tenants/{tenant_id}").status_code == 403
        started = op.delete(f"/v1/tenants/{tenant_id}")
        assert started.status_code == 202 and started.json()["tenant"]["status"] == "offboarding"
        again = op.delete(f"/v1/tenants/{tenant_id}")
        assert again.json()["operation"]["id"] == started.json()["operation"]["id"]
        assert op.delete("/v1/tenants/ten_doesnotexist").status_code == 404
    with h.client(key) as c:
        refused = c.post("/v1/allocations", json=ALLOC)
        assert refused.status_code in (401, 409)  # offboarding: no new allocation, whatever the timing
    await h.wait_operation(started.json()["operation"]["id"], timeout_s=90)

    with h.operator as op:
        tenant = op.get(f"/v1/tenants/{tenant_id}").json()
        assert tenant["status"] == "offboarded" and tenant["vni"] is None
        assert op.get(f"/v1/allocations/{alloc_id}").json()["status"] == "released"
    # Its nodes were released and wiped; the other tenant's allocation was not touched.
    assert not [n for n in h.nodes() if n["tenant_id"] == tenant_id]
    await h.wait_allocation(other_key, kept, "ready")
    assert h.client(key).get("/v1/allocations").status_code == 401
    assert h.fabric.vpc_of(tenant_id) is None and h.fabric.vpc_of(other_id) is not None
    # Storage is kept for the retention period, then deleted with its data key.
    await async_wait_until(
        lambda: store.backend.list_keys(f"tenants/{tenant_id}/") == [],
        timeout_s=30,
        what="storage deleted after retention",
    )
    assert tenant_id not in store.keys.tenants() and other_id in store.keys.tenants()
    assert store.tenant(other_id).get_encrypted(TENANT_RECORD)
    if _sqlite(db_url):
        await replays(temporal_env.client, onboarding_workflow_id(tenant_id), record_as="tenant_onboarding_workflow")
        await replays(temporal_env.client, offboarding_workflow_id(tenant_id), record_as="tenant_offboarding_workflow")


FABRIC_OUTAGE_S = 180.0


@pytest.mark.long
async def test_onboarding_during_a_three_minute_fabric_manager_outage_ends_active(stack):
    """A fabric manager's upgrade window is waited out: the new tenant is not failed or revoked."""
    h, _ = stack
    h.fabric.set_fault("unavailable")
    try:
        resp = _create(h)
        assert resp.status_code == 202, resp.text
        accepted = resp.json()
        started = time.monotonic()
        with h.operator as op:
            while time.monotonic() - started < FABRIC_OUTAGE_S:
                assert op.get(f"/v1/operations/{accepted['operation']['id']}").json()["status"] == "running"
                assert op.get(f"/v1/tenants/{accepted['id']}").json()["status"] == "onboarding"
                await asyncio.sleep(10)
    finally:
        h.fabric.set_fault(None)
    with h.operator as op:
        accepted["final"] = await async_wait_until(
            lambda: settled_operation(op, accepted["operation"]["id"]),
            timeout_s=90,
            interval_s=0.5,
            what="onboarding after the outage",
        )
        accepted["tenant"] = op.get(f"/v1/tenants/{accepted['id']}").json()
    assert_whole(h, accepted)


async def test_onboarding_past_its_deadline_is_undone_and_an_operator_can_extend_it(
    db_url, make_harness, in_process_worker, temporal_env
):
    h = make_harness(db_url, nodes=1, fabric=True, tenants={"onboarding_deadline_s": 4.0})
    await in_process_worker(h.settings)
    h.fabric.set_fault("unavailable")
    try:
        late, extended = _create(h).json(), _create(h).json()
        handle = temporal_env.client.get_workflow_handle(onboarding_workflow_id(extended["id"]))
        before = await handle.query("deadline")
        await handle.signal("extend_deadline", 600.0)
        after = await handle.query("deadline")
        assert (datetime.fromisoformat(after) - datetime.fromisoformat(before)).total_seconds() == 600.0
        await asyncio.sleep(8)  # past the first deadline, the managers still down
    finally:
        h.fabric.set_fault(None)
    with h.operator as op:
        for accepted in (late, extended):
            accepted["final"] = await async_wait_until(
                lambda a=accepted: settled_operation(op, a["operation"]["id"]),
                timeout_s=90,
                interval_s=0.5,
                what="onboarding after the outage",
            )
            accepted["tenant"] = op.get(f"/v1/tenants/{accepted['id']}").json()
    # Past its deadline: undone (once the managers were back to undo it), with the reason.
    assert_undone(h, late, "allocate_tenant_vni")
    assert "deadline" in late["final"]["error"]
    # Its deadline moved by the operator: it outlived the outage.
    assert_whole(h, extended)
