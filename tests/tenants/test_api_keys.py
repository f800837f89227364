"""API key rotation (the old key works for the grace period, then not) and revocation (at once),
by the tenant for itself and by operators; one tenant cannot touch or see another's keys."""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture
async def keyed(db_url, make_harness, in_process_worker):
    h = make_harness(db_url, nodes=1)
    await in_process_worker(h.settings)
    return h


def _ok(h, key: str, tenant_id: str) -> int:
    with h.client(key) as c:
        return c.get(f"/v1/tenants/{tenant_id}").status_code


async def test_rotation_keeps_the_old_key_for_the_grace_period_only(keyed):
    h = keyed
    tenant_id, key = await h.onboard()
    old_id = key[4:].split(".")[0]
    with h.client(key) as c:
        rotated = c.post(f"/v1/api-keys/{old_id}/rotate", json={"grace_period_s": 2})
        assert rotated.status_code == 201, rotated.text
        new = rotated.json()
        assert new["replaces"] == old_id and new["key"].startswith(f"gpc_{new['id']}.")
        # A key is rotated once.
        again = c.post(f"/v1/api-keys/{old_id}/rotate", json={"grace_period_s": 0})
        assert again.status_code == 409 and new["id"] in again.json()["detail"]
    assert _ok(h, key, tenant_id) == 200 and _ok(h, new["key"], tenant_id) == 200
    await asyncio.sleep(2.2)
    assert _ok(h, key, tenant_id) == 401 and _ok(h, new["key"], tenant_id) == 200
    with h.client(new["key"]) as c:
        listed = {k["id"]: k for k in c.get("/v1/api-keys").json()["items"]}
        assert listed[old_id]["replaced_by"] == new["id"] and listed[old_id]["expires_at"]
        assert "secret_hash" not in listed[old_id] and "key" not in listed[old_id]

    # A rotation names its grace period: leaving it out is refused, and the key is not rotated.
    with h.client(new["key"]) as c:
        for body in (None, {}):
            unsaid = c.post(f"/v1/api-keys/{new['id']}/rotate", json=body)
            assert unsaid.status_code == 422 and "grace_period_s" in unsaid.text, unsaid.text
    assert _ok(h, new["key"], tenant_id) == 200
    # A grace period of 0: the old key stops at once.
    with h.client(new["key"]) as c:
        newer = c.post(f"/v1/api-keys/{new['id']}/rotate", json={"grace_period_s": 0}).json()
    assert _ok(h, new["key"], tenant_id) == 401 and _ok(h, newer["key"], tenant_id) == 200
    # An expired key cannot be rotated back to life.
    with h.client(newer["key"]) as c:
        assert c.post(f"/v1/api-keys/{old_id}/rotate", json={"grace_period_s": 0}).status_code == 409
        bad = c.post(f"/v1/api-keys/{newer['id']}/rotate", json={"grace_period_s": -1})
        assert bad.status_code == 422 and "grace_period_s" in bad.json()["detail"]


async def test_revocation_is_immediate_and_idempotent_and_operators_rotate_too(keyed):
    h = keyed
    tenant_id, key = await h.onboard()
    key_id = key[4:].split(".")[0]
    with h.client(key) as c:
        second = c.post("/v1/api-keys", headers={"Idempotency-Key": "k1"})
        assert second.status_code == 201
        replay = c.post("/v1/api-keys", headers={"Idempotency-Key": "k1"})
        assert replay.json()["id"] == second.json()["id"] and replay.json()["key"] is None
        assert len(c.get("/v1/api-keys").json()["items"]) == 2
        # A tenant may revoke the very key it calls with: it stops at once.
        revoked = c.delete(f"/v1/api-keys/{key_id}")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"]
        assert c.get("/v1/api-keys").status_code == 401
    second_key = second.json()["key"]
    with h.operator as op:
        first_revocation = op.get(f"/v1/tenants/{tenant_id}/api-keys").json()["items"]
        again = op.delete(f"/v1/tenants/{tenant_id}/api-keys/{key_id}")
        assert again.status_code == 200 and again.json()["revoked_at"] == next(
            k["revoked_at"] for k in first_revocation if k["id"] == key_id
        )
        # Operators rotate any tenant's key (a revoked one is refused).
        assert (
            op.post(f"/v1/tenants/{tenant_id}/api-keys/{key_id}/rotate", json={"grace_period_s": 0}).status_code == 409
        )
        rotated = op.post(f"/v1/tenants/{tenant_id}/api-keys/{second.json()['id']}/rotate", json={"grace_period_s": 60})
        assert rotated.status_code == 201 and rotated.json()["tenant_id"] == tenant_id
        assert op.post("/v1/tenants/ten_nope/api-keys").status_code == 404
        assert op.get("/v1/api-keys").status_code == 403  # operators name the tenant
    assert _ok(h, second_key, tenant_id) == 200  # in its grace period
    assert _ok(h, rotated.json()["key"], tenant_id) == 200


async def test_one_tenant_cannot_see_or_touch_another_tenants_keys_tenant_or_quotas(keyed):
    h = keyed
    a_id, a_key = await h.onboard()
    b_id, b_key = await h.onboard()
    b_key_id = b_key[4:].split(".")[0]
    with h.client(a_key) as a:
        for resp in (
            a.get(f"/v1/tenants/{b_id}"),
            a.get(f"/v1/tenants/{b_id}/quotas"),
            a.get(f"/v1/tenants/{b_id}/api-keys"),
            a.post(f"/v1/tenants/{b_id}/api-keys"),
            a.post(f"/v1/tenants/{b_id}/api-keys/{b_key_id}/rotate", json={"grace_period_s": 0}),
            a.delete(f"/v1/tenants/{b_id}/api-keys/{b_key_id}"),
            a.post(f"/v1/api-keys/{b_key_id}/rotate", json={"grace_period_s": 0}),
            a.delete(f"/v1/api-keys/{b_key_id}"),
        ):
            assert resp.status_code == 404, (resp.request.url, resp.status_code)
        # A foreign id and a made-up one answer the same: nothing to learn from the difference.
        made_up = a.get(f"/v1/tenants/ten_{uuid.uuid4().hex[:20]}").json()
        foreign = a.get(f"/v1/tenants/{b_id}").json()
        assert {k: v for k, v in made_up.items() if k not in ("detail", "instance")} == {
            k: v for k, v in foreign.items() if k not in ("detail", "instance")
        }
        assert [k["tenant_id"] for k in a.get("/v1/api-keys").json()["items"]] == [a_id]
        assert a.get("/v1/tenants").status_code == 403
        assert a.delete(f"/v1/tenants/{b_id}").status_code == 403
        assert a.put(f"/v1/tenants/{b_id}/quotas", json={"quotas": []}).status_code == 403
    assert _ok(h, b_key, b_id) == 200  # B's key untouched
