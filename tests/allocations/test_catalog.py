"""Issue 40, "what you may ask for": `GET /v1/catalog` and `gpucloud catalog` (the fleet's GPU types
and regions, nodes available now, GPUs per node, the price book's price per GPU-hour), and
`GET /v1/whoami` and `gpucloud whoami` (a tenant's key: tenant, key, granted quotas and usage
this period; an operator's token: its name and role), over real HTTP with a real ledger.

Before: neither route nor command existed (404; `No such command`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from gpucloud.cli.main import app
from gpucloud.db import session_scope
from gpucloud.models.tables import Allocation
from support.ledger_auth import auth_for, post_usage
from support.ledger_harness import ledger_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.one_database]

PRICE = 2_490_000
MINUTE = 60_000
QUOTAS = [{"gpu_type": "H100", "region": "us-east-1", "max_gpus": 16}]


@pytest.fixture
def ledger_url(tmp_path: Path) -> Iterator[str]:
    with ledger_in_thread(f"sqlite:///{tmp_path / 'ledger.db'}", issuer_dir=tmp_path) as url:
        price_book = {"effective_from_ms": 0, "prices": [{"gpu_type": "H100", "price_per_hour_micro": PRICE}]}
        assert httpx.post(auth=auth_for(url), url=f"{url}/v1/price-book/versions", json=price_book).status_code == 201
        yield url


def _meter_now(ledger_url: str, db_url: str, tenant_id: str, *, minutes: int) -> None:
    """`minutes` of one H100 node's usage, ending now, in the open period."""
    with session_scope(db_url) as session:
        allocation = Allocation(tenant_id=tenant_id, gpu_type="H100", node_count=1, region="us-east-1")
        session.add(allocation)
        session.flush()
        allocation_id = allocation.id
    start = time.time_ns() // 1_000_000 - minutes * MINUTE
    post_usage(
        ledger_url, tenant_id=tenant_id, allocation_id=allocation_id, node="n-now", start_ms=start, minutes=minutes
    )


def _cli(h, *args: str, key: str | None = None, code: int = 0) -> str:
    env = {
        "GPUCLOUD_API__PORT": str(h.settings.api.port),
        "GPUCLOUD_API__OPERATOR_TOKEN": h.settings.operator_token,
        "GPUCLOUD_DATA_DIR": str(h.settings.data_dir),
        "COLUMNS": "250",
        **({"GPUCLOUD_API_KEY": key} if key else {}),
    }
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == code, result.output
    return result.output


def test_the_catalog_lists_what_the_fleet_has_with_the_ledgers_prices(db_url, make_harness, ledger_url):
    h = make_harness(db_url, nodes=2, ledger={"url": ledger_url})
    _, key = h.new_tenant(quotas=QUOTAS)
    with h.client(key) as tenant:
        assert tenant.get("/v1/catalog").json()["items"] == []  # nothing enrolled: nothing on offer
    h.enroll_fleet()  # enrolled, not yet burnt in: in the fleet, not available
    with h.client(key) as tenant, h.operator as op:
        catalog = tenant.get("/v1/catalog").json()
        assert catalog["items"] == [
            {
                "gpu_type": "H100",
                "region": "us-east-1",
                "nodes": 2,
                "available_nodes": 0,
                "gpus_per_node": 8,
                "price_per_gpu_hour_micro": PRICE,
                "discount_bp": 0,
            }
        ]
        assert (catalog["gpu_types"], catalog["regions"], catalog["prices_note"]) == (["H100"], ["us-east-1"], None)
        assert catalog["price_book_version"] is not None
        assert op.get("/v1/catalog").json()["items"] == catalog["items"]  # operators read it too
        assert tenant.get("/v1/catalog", params={"gpu_type": "h100"}).json()["items"] == catalog["items"]
        assert tenant.get("/v1/catalog", params={"gpu_type": "B200"}).json()["items"] == []
        unknown = tenant.get("/v1/catalog", params={"gpu_type": "H9000"})
        assert unknown.status_code == 422 and "unknown GPU type" in unknown.json()["detail"]

    listed = json.loads(_cli(h, "catalog", "-o", "json", key=key))
    assert listed["items"] == catalog["items"]
    table = _cli(h, "catalog", key=key)
    assert "H100" in table and "us-east-1" in table and "2.49" in table and "19.92" in table  # per GPU, per node


def test_without_a_ledger_the_catalog_still_answers_and_says_why_there_are_no_prices(db_url, make_harness):
    h = make_harness(db_url, nodes=1)
    h.enroll_fleet()
    with h.operator as op:
        catalog = op.get("/v1/catalog").json()
    assert [i["price_per_gpu_hour_micro"] for i in catalog["items"]] == [None]
    assert "billing is not configured" in catalog["prices_note"]


def test_whoami_shows_the_tenant_its_key_quotas_and_usage_and_an_operator_its_role(db_url, make_harness, ledger_url):
    h = make_harness(db_url, nodes=1, ledger={"url": ledger_url})
    tenant_id, key = h.new_tenant(quotas=QUOTAS)
    _meter_now(ledger_url, db_url, tenant_id, minutes=3)
    key_id = key.split(".")[0].removeprefix("gpc_")
    with h.client(key) as tenant:
        answer = tenant.get("/v1/whoami")
    assert answer.status_code == 200, answer.text
    me = answer.json()
    assert me["kind"] == "tenant" and me["tenant"]["id"] == tenant_id
    assert me["api_key"]["id"] == key_id and me["api_key"]["prefix"] == f"gpc_{key_id}."
    assert key.split(".")[1] not in answer.text  # never the secret
    assert me["quotas"]["quotas"] == QUOTAS  # what was granted, nothing beside it
    assert me["quotas"]["usage"][0]["usage_nodes"] == 1  # the allocation metered above is live
    assert me["usage_this_period"]["net_gpu_ms"] == 3 * 8 * MINUTE
    assert me["usage_this_period"]["period"] == time.strftime("%Y-%m", time.gmtime())

    shown = _cli(h, "whoami", key=key)
    assert tenant_id in shown and f"gpc_{key_id}." in shown and "0.40 GPU-hours" in shown
    assert "H100" in shown and "16" in shown
    operator = json.loads(_cli(h, "whoami", "-o", "json"))
    assert (operator["kind"], operator["operator"], operator["role"]) == ("operator", "bootstrap", "admin")
    assert "tenants" in operator["scopes"]


def test_a_ledger_that_does_not_answer_leaves_whoami_and_the_catalog_whole(db_url, make_harness):
    from gpucloud.devstack.stack import free_port

    h = make_harness(db_url, nodes=1, ledger={"url": f"http://127.0.0.1:{free_port()}"})
    _, key = h.new_tenant(quotas=QUOTAS)
    with h.client(key) as tenant:
        me, catalog = tenant.get("/v1/whoami").json(), tenant.get("/v1/catalog").json()
    assert me["quotas"]["quotas"] == QUOTAS and me["usage_this_period"] is None
    assert "did not answer" in me["usage_note"]
    assert "does not answer" in catalog["prices_note"]
