"""Issue 13, row 11: the API checks who calls before it reads the body, and bounds the body.

Before: bodies had no size limit and were parsed before authentication, so a stranger's
malformed body got 422 (the body was read and judged) instead of 401."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.one_database]


def test_credentials_are_checked_before_the_body_and_the_body_is_bounded(db_url, make_harness):
    h = make_harness(db_url, nodes=1, api={"max_body_bytes": 64 * 1024})
    url = h.api.url
    malformed = b"{this is not json"
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=30) as anonymous:
        for extra in ({}, {"Authorization": "Bearer gpc_nobody.secret"}):
            resp = anonymous.post("/v1/allocations", content=malformed, headers={**headers, **extra})
            assert resp.status_code == 401, resp.text
            assert resp.headers["content-type"] == "application/problem+json"
            huge = anonymous.post("/v1/allocations", content=b"x" * (1 << 20), headers={**headers, **extra})
            assert huge.status_code == 401  # a stranger's body is never read
        assert anonymous.get("/healthz").status_code == 200
        assert anonymous.get("/openapi.json").status_code == 200

    with h.operator as op:
        assert op.post("/v1/tenants", content=malformed, headers=headers).status_code == 422
        too_large = op.post("/v1/tenants", content=b" " * (64 * 1024 + 1), headers=headers)
        assert too_large.status_code == 413 and "65536 bytes" in too_large.json()["detail"]

        def stream():  # no Content-Length: chunked transfer, counted as it arrives
            for _ in range(100):
                yield b" " * 1024

        chunked = op.post("/v1/tenants", content=stream(), headers=headers)
        assert chunked.status_code == 413
        # Within the limit, with or without Content-Length, the request goes through.
        body = b'{"name": "gate-ok"}'
        assert op.post("/v1/tenants", content=body, headers=headers).status_code == 202
        assert op.post("/v1/tenants", content=iter([body.replace(b"ok", b"ok2")]), headers=headers).status_code == 202
