"""Issue 13, row 10: page tokens are signed (HMAC) and type-checked; a forged one is a 400,
never a query (a cursor of 10**30 used to reach the database and answer 500)."""

from __future__ import annotations

import base64
import json

import pytest

from gpucloud.api import pagination
from gpucloud.web.problems import Problem

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def _unsigned(after, filters: dict) -> str:
    """A token as the API used to issue them: base64 JSON, no signature."""
    raw = json.dumps({"a": after, "f": pagination.fingerprint(filters)}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def test_forged_tampered_and_mistyped_tokens_are_400_through_the_api(db_url, make_harness):
    h = make_harness(db_url, nodes=1)
    with h.operator as op:
        for i in range(3):
            assert op.post("/v1/tenants", json={"name": f"pt-{i}"}).status_code == 202
        first = op.get("/v1/tenants", params={"page_size": 1})
        token = first.json()["next_page_token"]
        assert op.get("/v1/tenants", params={"page_size": 1, "page_token": token}).status_code == 200
        body, _, mac = token.partition(".")
        tampered = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        tampered["a"] = 10**30
        forged_body = base64.urlsafe_b64encode(json.dumps(tampered).encode()).decode().rstrip("=")
        for forged in (
            _unsigned(10**30, {}),  # what an attacker could write before tokens were signed
            f"{forged_body}.{mac}",  # a real token's signature on another cursor
            _unsigned("zzz", {}),
            token + "x",
        ):
            resp = op.get("/v1/tenants", params={"page_token": forged})
            assert resp.status_code == 400, (forged, resp.status_code, resp.text)
            assert resp.json()["type"].endswith("invalid-page-token")
        # A node listing's token (a string key) is not an integer cursor elsewhere, signed or not.
        nodes = op.get("/v1/nodes", params={"page_size": 1}).json()
        if nodes["next_page_token"]:
            assert op.get("/v1/tenants", params={"page_token": nodes["next_page_token"]}).status_code == 400


def test_tokens_carry_over_between_api_processes_sharing_the_secret_and_not_otherwise(monkeypatch):
    monkeypatch.setattr(pagination, "_secret", pagination._secret)  # restored after the test
    pagination.use_secret("deployment-secret")
    token = pagination.encode(7, {})
    pagination.use_secret("deployment-secret")  # another process, same settings
    assert pagination.decode(token, {}).after == 7
    pagination.use_secret("another-deployment")
    with pytest.raises(Problem):
        pagination.decode(token, {})
    for out_of_range in (-1, 2**63):
        with pytest.raises(Problem):
            pagination.decode(pagination.encode(out_of_range, {}), {})
