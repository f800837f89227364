"""Issue 37, item 2: admission shares slots per tenant (all its API keys) and per node, not per
bearer token; credentials are resolved before admission and remembered briefly; a tenant's live
keys are capped.

Before: a lane counted slots per raw token, so a tenant's second key took a second share of the
tenants' lane, and one node's credential could hold all 12 slots of the agents' lane (the other
nodes' heartbeats then waited and got 503, and the fleet turned unreachable).

The app under test is the API's own middleware in its order (the gate, which also bounds the body, then admission) in
front of a route that holds its slot until the test lets it go: no Temporal, no server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gpucloud.api.admission import Admission
from gpucloud.api.gate import CredentialCache, Gate
from gpucloud.config import ApiSettings, RequestBodySettings, Settings
from gpucloud.db import session_scope
from gpucloud.models.tables import ApiKey
from gpucloud.services import agent_credentials, api_keys, tenants
from support.held import Held
from support.nodes import enroll

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

OPERATOR = "operator-token"


def _stack(db_url: str, held: Held, *, cache: CredentialCache | None = None, **api) -> Gate:
    settings = ApiSettings(admission_wait_s=0.2, **api)
    cache = cache or CredentialCache(settings.credential_cache_s)
    return Gate(
        Admission(held, settings=settings),
        database_url=db_url,
        operator_token=OPERATOR,
        cache=cache,
        max_body_bytes=1024,
        max_chunk_bytes=1024,
        body=RequestBodySettings(),
    )


def _tenant(db_url: str, name: str, *, keys: int) -> list[str]:
    """The new tenant's keys (`gpc_<key id>.<secret>`)."""
    with session_scope(db_url) as session:
        tenant, _, _, first = tenants.create(session, name=name, quotas=[], actor="operator:test")
        return [first] + [api_keys.issue_key(session, tenant.id)[1] for _ in range(keys - 1)]


def _revoke(db_url: str, key: str) -> None:
    key_id = key[4:].split(".")[0]
    with session_scope(db_url) as session:
        tenant_id = session.get(ApiKey, key_id).tenant_id  # type: ignore[union-attr]
        api_keys.revoke_key(session, tenant_id, key_id)


def _client(app, token: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://api", headers={"Authorization": f"Bearer {token}"})


async def test_two_keys_of_one_tenant_share_one_tenant_share_while_another_tenant_gets_in(db_url):
    first, second = _tenant(db_url, "greedy", keys=2)
    (other,) = _tenant(db_url, "other", keys=1)
    held = Held()
    app = _stack(db_url, held, tenant_slots=8, caller_share=0.25)  # a tenant's share: 2 slots
    async with _client(app, first) as a, _client(app, second) as b, _client(app, other) as c:
        holding = [asyncio.create_task(a.get("/v1/allocations")) for _ in range(2)]
        await held.until(2)
        refused = await b.get("/v1/allocations")  # the tenant's other key: no second share
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.headers["content-type"] == "application/problem+json"
        assert "tenant (all its API keys together)" in refused.json()["detail"]
        admitted = asyncio.create_task(c.get("/v1/allocations"))
        await held.until(3)  # another tenant still gets a slot
        held.go.set()
        assert [r.status_code for r in await asyncio.gather(*holding, admitted)] == [200, 200, 200]


async def test_one_nodes_credential_cannot_fill_the_agents_lane_for_other_nodes(db_url):
    one, other = enroll(db_url, ["adm-0", "adm-1"])
    with session_scope(db_url) as session:
        stalled, fine = agent_credentials.issue(session, one), agent_credentials.issue(session, other)
    held = Held()
    app = _stack(db_url, held)  # the defaults: 12 agent slots, a node's share a quarter of them
    beat = {"heartbeats": [{"node_id": one}]}
    async with _client(app, stalled) as node, _client(app, fine) as neighbour:
        twelve = [asyncio.create_task(node.post("/v1/agents/heartbeats", json=beat)) for _ in range(12)]
        await held.until(3)
        await asyncio.sleep(0.05)
        assert held.in_flight == 3
        reported = asyncio.create_task(neighbour.post("/v1/agents/heartbeats", json=beat))
        await held.until(4)  # the other node is not kept waiting, let alone refused
        held.go.set()
        statuses = sorted(r.status_code for r in await asyncio.gather(*twelve))
        assert statuses == [200] * 3 + [429] * 9
        assert (await reported).status_code == 200


async def test_a_tenants_key_takes_the_tenants_lane_even_on_the_agents_paths(db_url):
    keys = _tenant(db_url, "pretender", keys=1)
    held = Held()
    settings = ApiSettings(admission_wait_s=0.2)
    admission = Admission(held, settings=settings)
    app = Gate(
        admission,
        database_url=db_url,
        operator_token=OPERATOR,
        cache=CredentialCache(settings.credential_cache_s),
        max_body_bytes=1024,
        max_chunk_bytes=1024,
        body=RequestBodySettings(),
    )
    async with _client(app, keys[0]) as tenant:
        sent = asyncio.create_task(tenant.post("/v1/agents/heartbeats", json={"heartbeats": []}))
        await held.until(1)
        assert admission.lanes["tenants"].in_flight == 1 and admission.lanes["agents"].in_flight == 0
        held.go.set()
        await sent


async def test_refused_retries_cost_no_credential_lookup_and_revocation_ends_within_the_ttl(db_url):
    (key,) = _tenant(db_url, "retrier", keys=1)
    now = [0.0]
    cache = CredentialCache(5.0, clock=lambda: now[0])
    held = Held()
    app = _stack(db_url, held, cache=cache, tenant_slots=4, caller_share=0.25)  # one slot a tenant
    lookups = []
    resolve = app._resolve
    app._resolve = lambda token: lookups.append(token) or resolve(token)  # type: ignore[method-assign]
    async with _client(app, key) as client:
        holding = asyncio.create_task(client.get("/v1/allocations"))
        await held.until(1)
        statuses = [(await client.get("/v1/allocations")).status_code for _ in range(50)]
        assert statuses == [429] * 50 and len(lookups) == 1  # one read for the token, none per retry
        held.go.set()
        assert (await holding).status_code == 200
        _revoke(db_url, key)  # behind this process's back (as another API process does)
        assert (await client.get("/v1/allocations")).status_code == 200  # remembered, within the TTL
        now[0] += 5.0
        assert (await client.get("/v1/allocations")).status_code == 401  # past it: read again
        assert len(lookups) == 2


def test_the_process_that_revokes_a_key_forgets_it_at_once():
    cache = CredentialCache(60.0)
    cache.put("gpc_key_a.secret", None)
    cache.put("gpc_key_b.secret", None)
    cache.put("made-up", None)
    cache.forget("gpc_key_a")
    assert [cache.get(t)[0] for t in ("gpc_key_a.secret", "gpc_key_b.secret", "made-up")] == [False, True, True]
    assert not CredentialCache(0).get("gpc_key_a.secret")[0]


async def test_a_tenant_holds_at_most_its_cap_of_live_keys_and_is_told_to_revoke_one(db_url, tmp_path):
    from gpucloud.api.app import create_app

    (key,) = _tenant(db_url, "keyring", keys=1)
    settings = Settings(data_dir=tmp_path, database={"url": db_url}, api={"max_api_keys_per_tenant": 3})
    transport = httpx.ASGITransport(app=create_app(settings, temporal=object()))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        client.headers["Authorization"] = f"Bearer {key}"
        made = [await client.post("/v1/api-keys") for _ in range(2)]
        assert [r.status_code for r in made] == [201, 201]
        over = await client.post("/v1/api-keys")
        assert over.status_code == 409, over.text
        problem = over.json()
        assert problem["type"].endswith("/too-many-api-keys") and problem["max_api_keys"] == 3
        assert "revoke one" in problem["detail"] and "3 live API keys" in problem["detail"]
        assert (await client.delete(f"/v1/api-keys/{made[0].json()['id']}")).status_code == 200
        assert (await client.post("/v1/api-keys")).status_code == 201  # room again


async def test_a_token_no_credential_looks_like_costs_no_lookup_and_no_cache_entry(db_url):
    """The gate runs before admission: a flood of made-up tokens must not take the credential
    lookups' threads and connections, nor push real callers out of the cache."""
    cache = CredentialCache(5.0)
    app = _stack(db_url, Held(), cache=cache)
    lookups = []
    resolve = app._resolve
    app._resolve = lambda token: lookups.append(token) or resolve(token)  # type: ignore[method-assign]
    for made_up in ("made-up", "gpc_no-dot", "Bearer-ish.token.with.dots"):
        async with _client(app, made_up) as stranger:
            assert (await stranger.get("/v1/allocations")).status_code == 401
    assert lookups == [] and not any(cache.get(t)[0] for t in ("made-up", "gpc_no-dot"))
    async with _client(app, "gpc_key_x.not-the-secret") as guesser:  # shaped like a key: looked up
        assert (await guesser.get("/v1/allocations")).status_code == 401
    assert lookups == ["gpc_key_x.not-the-secret"]


def test_a_replaced_agent_credential_is_forgotten_at_once_by_the_process_that_replaced_it(db_url, tmp_path):
    from fastapi.testclient import TestClient

    from gpucloud.api.app import create_app

    (node,) = enroll(db_url, ["cred.node-1"])  # an id with a dot: the cache names it as auth parses it
    settings = Settings(data_dir=tmp_path, database={"url": db_url}, api={"credential_cache_s": 60})
    with TestClient(create_app(settings, temporal=object())) as client:  # type: ignore[arg-type]
        operator = {"Authorization": f"Bearer {settings.operator_token}"}
        issue = f"/v1/nodes/{node}/agent-credential"
        old = client.post(issue, headers=operator).json()["token"]
        beat = {"heartbeats": [{"node_id": node}]}
        as_old = {"Authorization": f"Bearer {old}"}
        assert client.post("/v1/agents/heartbeats", json=beat, headers=as_old).status_code == 200
        assert client.post(issue, headers=operator).status_code == 201  # replaced
        assert client.post("/v1/agents/heartbeats", json=beat, headers=as_old).status_code == 401


async def test_a_refused_request_with_a_body_closes_its_connection_unread(db_url):
    """Admission's 429 (and 503) to a request whose body is on its way closes the connection,
    as the gate's refusals do: the server never reads a refused 64 MiB upload off the socket."""
    (key,) = _tenant(db_url, "uploader", keys=1)
    held = Held()
    app = _stack(db_url, held, tenant_slots=4, caller_share=0.25)  # one slot a tenant
    async with _client(app, key) as client:
        holding = asyncio.create_task(client.get("/v1/allocations"))
        await held.until(1)
        without_body = await client.get("/v1/allocations")
        with_body = await client.post("/v1/allocations", content=b"{}", headers={"content-type": "application/json"})
        assert without_body.status_code == with_body.status_code == 429
        assert "connection" not in without_body.headers and with_body.headers["connection"] == "close"
        held.go.set()
        await holding
