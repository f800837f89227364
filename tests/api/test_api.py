"""The public API over real HTTP: idempotency, pagination under inserts, tenant isolation, bad input."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

pytestmark = pytest.mark.integration

ALLOC = {"gpu_type": "H100", "node_count": 1, "region": "us-east-1"}


@pytest.fixture
async def ready_harness(ready_fleet):
    return await ready_fleet(nodes=8, latency_scale=0.02)


async def test_idempotent_create_sequential_and_mismatch(ready_harness):
    h = ready_harness
    _, key = await h.onboard()
    idem = {"Idempotency-Key": "create-1"}
    with h.client(key) as c:
        first = c.post("/v1/allocations", json=ALLOC, headers=idem)
        # Same key, same body (other key order and spacing): the first response, byte for byte.
        replay = c.post(
            "/v1/allocations",
            content=b'{"region":"us-east-1",  "node_count":1,"gpu_type":"H100"}',
            headers={**idem, "content-type": "application/json"},
        )
        assert first.status_code == replay.status_code == 202
        assert replay.content == first.content
        assert replay.headers["idempotent-replayed"] == "true"
        # Same key, different body: refused, and nothing new is created.
        other = c.post("/v1/allocations", json={**ALLOC, "node_count": 2}, headers=idem)
        assert other.status_code == 422
        assert other.json()["type"].endswith("/idempotency-key-reused")
        assert len(c.get("/v1/allocations").json()["items"]) == 1
    # Keys are per caller: another tenant's identical key is its own request.
    _, key2 = await h.onboard()
    with h.client(key2) as c2:
        assert (
            c2.post("/v1/allocations", json=ALLOC, headers=idem).json()["allocation"]["id"]
            != first.json()["allocation"]["id"]
        )


async def test_idempotent_create_concurrent_races_get_one_allocation(ready_harness):
    h = ready_harness
    _, key = await h.onboard()
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": str(uuid.uuid4())}
    async with httpx.AsyncClient(base_url=h.api.url, headers=headers, timeout=60) as c:
        responses = await asyncio.gather(*(c.post("/v1/allocations", json=ALLOC) for _ in range(8)))
    assert {r.status_code for r in responses} == {202}
    assert len({r.json()["allocation"]["id"] for r in responses}) == 1
    with h.client(key) as c:
        assert len(c.get("/v1/allocations").json()["items"]) == 1
    assert sum(1 for n in h.nodes() if n["allocation_id"]) == 1


async def test_pagination_never_skips_or_repeats_while_rows_are_inserted(ready_harness):
    h = ready_harness
    with h.operator as op:
        created = [op.post("/v1/tenants", json={"name": f"p-{i:03d}"}).json()["id"] for i in range(23)]
        seen, token, pages = [], "", 0
        while True:
            page = op.get("/v1/tenants", params={"page_size": 5, **({"page_token": token} if token else {})}).json()
            seen += [t["id"] for t in page["items"]]
            pages += 1
            # Rows created between pages must not shift the listing.
            op.post("/v1/tenants", json={"name": f"late-{pages}"})
            token = page["next_page_token"]
            if not token:
                break
        assert len(seen) == len(set(seen)), "a row was repeated"
        assert set(created) <= set(seen), "a row that existed before the listing was skipped"
        # A token is bound to its query's filters.
        bad = op.get("/v1/allocations", params={"page_token": "not-a-token"})
        assert bad.status_code == 400 and "page_token" in bad.json()["detail"]
        first = op.get("/v1/nodes", params={"page_size": 2, "state": "available"}).json()
        other_filter = op.get("/v1/nodes", params={"page_token": first["next_page_token"], "state": "active"})
        assert other_filter.status_code == 400
        assert op.get("/v1/nodes", params={"page_size": 1001}).status_code == 422


async def test_tenant_cannot_see_or_cancel_another_tenants_allocation(ready_harness):
    h = ready_harness
    a_id, key_a = await h.onboard()
    _, key_b = await h.onboard()
    with h.client(key_a) as a, h.client(key_b) as b:
        created = a.post("/v1/allocations", json=ALLOC).json()
        alloc_id, op_id = created["allocation"]["id"], created["operation"]["id"]
        for resp in (
            b.get(f"/v1/allocations/{alloc_id}"),
            b.post(f"/v1/allocations/{alloc_id}/cancel"),
            b.get(f"/v1/operations/{op_id}"),
            b.get(f"/v1/allocations/{alloc_id}/events"),
            b.get(f"/v1/tenants/{a_id}"),
            b.get(f"/v1/tenants/{a_id}/quotas"),
            b.get(f"/v1/tenants/{a_id}/api-keys"),
        ):
            assert resp.status_code == 404  # not 403: B learns nothing about A's ids
        assert b.get("/v1/allocations").json()["items"] == []
        assert b.get("/v1/allocations", params={"tenant_id": "anything"}).json()["items"] == []
        assert b.get("/v1/allocations", params={"tenant_id": a_id}).json()["items"] == []
        assert a.get(f"/v1/allocations/{alloc_id}").json()["status"] in ("provisioning", "ready")
        # Tenants cannot reach operator endpoints.
        assert b.get("/v1/nodes").status_code == 403
        assert b.post("/v1/tenants", json={"name": "evil"}).status_code == 403
    assert h.client("gpc_key_nope.secret").get("/v1/allocations").status_code == 401
    assert httpx.get(f"{h.api.url}/v1/allocations").status_code == 401


BAD_BODIES = [
    ({"gpu_type": "Z900", "node_count": 1, "region": "us-east-1"}, "gpu_type"),
    ({"gpu_type": "H100", "node_count": 0, "region": "us-east-1"}, "node_count"),
    ({"gpu_type": "H100", "node_count": -3, "region": "us-east-1"}, "node_count"),
    ({"gpu_type": "H100", "node_count": 100000, "region": "us-east-1"}, "node_count"),
    ({"gpu_type": "H100", "node_count": "many", "region": "us-east-1"}, "node_count"),
    ({"gpu_type": "H100", "node_count": 1}, "region"),
    ({"gpu_type": "H100", "node_count": 1, "region": "mars-1"}, "region"),
    ({"gpu_type": "H100", "node_count": 1, "region": "us-east-1", "color": "red"}, "color"),
]


async def test_bad_input_is_a_4xx_naming_the_field_and_writes_nothing(ready_harness):
    h = ready_harness
    _, key = await h.onboard()
    with h.client(key) as c:
        for body, field in BAD_BODIES:
            resp = c.post("/v1/allocations", json=body)
            assert resp.status_code == 422, resp.text
            assert resp.headers["content-type"].startswith("application/problem+json")
            assert field in resp.json()["detail"], (body, resp.json())
        assert c.get("/v1/allocations").json()["items"] == []
        malformed = c.post("/v1/allocations", content=b"{not json", headers={"content-type": "application/json"})
        assert malformed.status_code == 422
        assert c.get("/v1/allocations/alloc_doesnotexist").status_code == 404
    assert all(n["state"] == "available" for n in h.nodes())


@pytest.mark.one_database  # the database only underneath: on SQLite
async def test_health_and_openapi(ready_harness):
    h = ready_harness
    assert httpx.get(f"{h.api.url}/healthz").json() == {"ok": True}
    spec = httpx.get(f"{h.api.url}/openapi.json", timeout=30).json()  # built on first ask: seconds on 2 loaded cores
    assert "/v1/allocations" in spec["paths"] and "/v1/allocations/{allocation_id}/cancel" in spec["paths"]
