"""Issue 13, row 14 (second half): chunk uploads count against a per-tenant storage quota.

Before: a tenant could upload chunks without limit (a disk-filling attack on the shared store).
Now an upload that would take the tenant past `registry.storage_quota_bytes` is a 409 naming the
quota and the usage, with nothing written; chunks already stored cost nothing again."""

from __future__ import annotations

import os

import blake3
import pytest

from gpucloud.services import storage_quota

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

QUOTA = 300_000


def _chunk(size: int) -> tuple[str, bytes]:
    data = os.urandom(size)
    return blake3.blake3(data).hexdigest(), data


async def test_uploads_past_the_tenants_storage_quota_are_refused(db_url, make_harness, in_process_worker):
    h = make_harness(db_url, nodes=1, registry={"storage_quota_bytes": QUOTA})
    await in_process_worker(h.settings)
    tenant_id, key = await h.onboard()
    other_id, other_key = await h.onboard()
    with h.client(key) as tenant, h.client(other_key) as other:
        assert tenant.post("/v1/models", json={"name": "big"}).status_code == 201
        assert other.post("/v1/models", json={"name": "big"}).status_code == 201
        first_id, first = _chunk(200_000)
        put = tenant.put(f"/v1/models/big/chunks/{first_id}", content=first)
        assert put.status_code == 201
        # The same chunk again is already stored: no new bytes, no quota.
        assert tenant.put(f"/v1/models/big/chunks/{first_id}", content=first).status_code == 200
        # Bytes that do not hash to their id store nothing, and their reservation is given back.
        forged_id, _ = _chunk(50_000)
        assert tenant.put(f"/v1/models/big/chunks/{forged_id}", content=os.urandom(50_000)).status_code == 422
        assert storage_quota.usage(h.settings.database_url, tenant_id) == 200_000
        second_id, second = _chunk(150_000)
        refused = tenant.put(f"/v1/models/big/chunks/{second_id}", content=second)
        assert refused.status_code == 409, refused.text
        problem = refused.json()
        assert problem["type"].endswith("storage-quota-exceeded")
        assert (problem["quota_bytes"], problem["usage_bytes"]) == (QUOTA, 200_000)
        assert str(QUOTA) in problem["detail"] and "200000" in problem["detail"]
        assert tenant.get(f"/v1/models/big/chunks/{second_id}").status_code == 404  # nothing written
        # Another tenant's quota is its own.
        assert other.put(f"/v1/models/big/chunks/{second_id}", content=second).status_code == 201
    assert storage_quota.usage(h.settings.database_url, tenant_id) == 200_000
    assert storage_quota.usage(h.settings.database_url, other_id) == 150_000
    # A garbage collection measures the store again, correcting any drift in the count.
    storage_quota.measured(h.settings.database_url, tenant_id, 5)
    with h.operator as op:
        gc = op.post("/v1/registry/gc", json={"tenant_id": tenant_id, "grace_period_seconds": 3600})
    assert gc.status_code == 200, gc.text
    assert storage_quota.usage(h.settings.database_url, tenant_id) == 200_000
